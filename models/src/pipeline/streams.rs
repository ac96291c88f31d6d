//! The stages' programs (`PipelineSpec::program`) replayed with the blocking rules of a device
//! transport, to prove a schedule cannot deadlock on GPUs. Two levels, both pure:
//!
//! *Hosts.* A host issues its program without waiting (device calls are queued). The runner
//! opens every channel of the step before its first transfer, in one sorted order on every
//! rank; were a channel opened at its first message instead (NCCL's communicator creation is
//! a rendezvous of both hosts), the first send on it would wait for the receiver's first
//! receive on it and the other way round: the check holds the programs to that too.
//!
//! *Devices.* Each stage has a compute stream and one stream per communicator it uses. An
//! action is a compute op; a send packs on the compute stream, then sends on its channel's
//! stream after the compute work queued before it; a receive runs on its channel's stream after
//! the compute work queued before it (its buffer's last users) and the compute stream waits for
//! it before the unpack. Ops on one stream run in order. A send and its receive match in order
//! per direction and complete together, once both have started (a point-to-point transfer
//! blocks its stream until the peer posts the other half; buffering only ever lets a send end
//! sooner, so a program that finishes here finishes with any buffering). Nothing waits for a
//! send but later ops on its own stream: the compute stream never waits for one (the
//! allocator never hands out a block a send may still read, see `DeviceFence::after_send`).
//!
//! Collectives inside a stage (tensor and data parallelism) are left out: every rank of a stage
//! runs the same program, so they meet at the same point of it on each.

use std::collections::{HashMap, HashSet, VecDeque};

use super::schedule::{spec_err, HostOp, PipelineSpec, Schedule};
use crate::{Result, TensorError};

/// Which communicator carries a message between two stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// One communicator (and stream) per ordered pair of ranks: messages from `a` to `b` never
    /// queue behind messages from `b` to `a` (`Communicator::one_way`, the NCCL backend's
    /// pipeline path).
    OneWayChannels,
    /// One communicator (and stream) per unordered pair, both directions in its order (a plain
    /// all-to-all of the two placements). 1F1B deadlocks on it.
    SharedPairs,
}

impl Transport {
    /// The channel of a message from stage `from` to stage `to`.
    fn channel(self, from: usize, to: usize) -> (usize, usize) {
        match self {
            Transport::OneWayChannels => (from, to),
            Transport::SharedPairs => (from.min(to), from.max(to)),
        }
    }
}

/// What a replay went through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayReport {
    /// Communicators opened (channels between stages).
    pub channels: usize,
    /// Device ops completed, over all stages and streams.
    pub device_ops: usize,
}

fn replay_err(spec: &PipelineSpec, transport: Transport, detail: String) -> TensorError {
    TensorError::Shape {
        op: "PipelineSpec::validate",
        shapes: "-".into(),
        sbps: "-".into(),
        detail: format!("{spec:?} on {transport:?}: {detail}"),
    }
}

/// The channel of a program op at `stage`, if it communicates.
fn channel_of(t: Transport, stage: usize, op: HostOp) -> Option<(usize, usize)> {
    match op {
        HostOp::Send { to, .. } => Some(t.channel(stage, to)),
        HostOp::Recv { from, .. } => Some(t.channel(from, stage)),
        HostOp::Run(_) => None,
    }
}

impl PipelineSpec {
    /// Checks the spec against a model of `layers` blocks (before any communication): counts
    /// at least 1, `virtual_stages` 1 unless interleaved, interleaved needs micro-batches a
    /// multiple of the stages and layers a multiple of `pp * v`, every chunk at least one
    /// layer; then proves every stage's action list runs to the end.
    pub fn validate(&self, layers: usize) -> Result<()> {
        let (pp, m, v) = (self.stages, self.micro_batches, self.virtual_stages);
        if pp == 0 || m == 0 || v == 0 {
            return Err(spec_err(format!(
                "stages {pp}, micro-batches {m} and virtual stages {v} must all be at least 1"
            )));
        }
        match self.schedule {
            Schedule::Interleaved => {
                if !m.is_multiple_of(pp) {
                    return Err(spec_err(format!(
                        "the interleaved schedule needs micro-batches ({m}) to be a multiple of the pipeline stages ({pp})"
                    )));
                }
                if !layers.is_multiple_of(pp * v) {
                    return Err(spec_err(format!(
                        "the interleaved schedule needs layers ({layers}) to be a multiple of stages x virtual stages ({pp} x {v})"
                    )));
                }
            }
            _ if v != 1 => {
                return Err(spec_err(format!(
                    "virtual stages ({v}) need the interleaved schedule, not {:?}",
                    self.schedule
                )))
            }
            _ => {}
        }
        if layers < pp * v {
            return Err(spec_err(format!(
                "{layers} layers cannot fill {pp} stages x {v} virtual stages (every chunk needs a layer)"
            )));
        }
        self.simulate()?;
        self.replay_on(Transport::OneWayChannels).map(|_| ())
    }

    /// Replays every stage's program (with the tied table when pp > 1) on `transport`; an
    /// error names what each stuck stage waits for.
    pub fn replay_on(&self, transport: Transport) -> Result<ReplayReport> {
        let programs: Vec<Vec<HostOp>> = (0..self.stages).map(|s| self.program(s, true)).collect();
        let channels = hosts(self, transport, &programs)?;
        let device_ops = devices(self, transport, &programs)?;
        Ok(ReplayReport {
            channels,
            device_ops,
        })
    }
}

/// The host level: every op is issued at once except the first op of each stage on each
/// channel, which waits until the other end reaches its first op on that channel.
fn hosts(spec: &PipelineSpec, t: Transport, programs: &[Vec<HostOp>]) -> Result<usize> {
    let pp = programs.len();
    // Per stage: channel -> index of its first op there.
    let first: Vec<HashMap<(usize, usize), usize>> = programs
        .iter()
        .enumerate()
        .map(|(s, p)| {
            let mut m = HashMap::new();
            for (i, &op) in p.iter().enumerate() {
                if let Some(c) = channel_of(t, s, op) {
                    m.entry(c).or_insert(i);
                }
            }
            m
        })
        .collect();
    let mut open: HashSet<(usize, usize)> = HashSet::new();
    let mut at = vec![0usize; pp];
    loop {
        let mut progressed = false;
        for s in 0..pp {
            while let Some(&op) = programs[s].get(at[s]) {
                let Some(c) = channel_of(t, s, op) else {
                    at[s] += 1;
                    progressed = true;
                    continue;
                };
                if first[s].get(&c) == Some(&at[s]) && !open.contains(&c) {
                    let peer = if c.0 == s { c.1 } else { c.0 };
                    let there = first[peer].get(&c).copied();
                    if there.is_none() || there != Some(at[peer]) {
                        break;
                    }
                    open.insert(c);
                }
                at[s] += 1;
                progressed = true;
            }
        }
        if at.iter().zip(programs).all(|(&i, p)| i == p.len()) {
            return Ok(open.len());
        }
        if !progressed {
            let stuck: Vec<String> = (0..pp)
                .filter_map(|s| {
                    programs[s]
                        .get(at[s])
                        .map(|op| format!("stage {s} opens a channel at {op:?}"))
                })
                .collect();
            return Err(replay_err(
                spec,
                t,
                format!("the hosts deadlock: {}", stuck.join("; ")),
            ));
        }
    }
}

/// A device op: the ops it waits for, and its send/receive partner key.
struct Node {
    stage: usize,
    what: String,
    deps: Vec<usize>,
    /// (from stage, to stage, sequence number of that direction) of a send or receive.
    transfer: Option<(usize, usize, usize)>,
}

/// The device level: builds every stage's streams from its program and completes ops until
/// all are done or none can progress.
fn devices(spec: &PipelineSpec, t: Transport, programs: &[Vec<HostOp>]) -> Result<usize> {
    let mut nodes: Vec<Node> = Vec::new();
    for (s, program) in programs.iter().enumerate() {
        let mut compute: Option<usize> = None;
        let mut stream_tail: HashMap<(usize, usize), usize> = HashMap::new();
        let mut sent: HashMap<usize, usize> = HashMap::new();
        let mut got: HashMap<usize, usize> = HashMap::new();
        let push = |nodes: &mut Vec<Node>, what: String, deps: Vec<Option<usize>>, tr| {
            nodes.push(Node {
                stage: s,
                what,
                deps: deps.into_iter().flatten().collect(),
                transfer: tr,
            });
            nodes.len() - 1
        };
        for &op in program {
            match op {
                HostOp::Run(a) => {
                    compute = Some(push(&mut nodes, format!("{a:?}"), vec![compute], None));
                }
                HostOp::Send { to, msg } => {
                    let pack = push(&mut nodes, format!("pack {msg:?}"), vec![compute], None);
                    compute = Some(pack);
                    let c = t.channel(s, to);
                    let k = sent.entry(to).or_default();
                    let n = push(
                        &mut nodes,
                        format!("send {msg:?} to stage {to}"),
                        vec![stream_tail.get(&c).copied(), Some(pack)],
                        Some((s, to, *k)),
                    );
                    *k += 1;
                    stream_tail.insert(c, n);
                }
                HostOp::Recv { from, msg } => {
                    let c = t.channel(from, s);
                    let k = got.entry(from).or_default();
                    let n = push(
                        &mut nodes,
                        format!("receive {msg:?} from stage {from}"),
                        vec![stream_tail.get(&c).copied(), compute],
                        Some((from, s, *k)),
                    );
                    *k += 1;
                    stream_tail.insert(c, n);
                    compute = Some(push(
                        &mut nodes,
                        format!("unpack {msg:?}"),
                        vec![compute, Some(n)],
                        None,
                    ));
                }
            }
        }
    }
    complete(spec, t, &nodes)
}

/// Kahn's order over the op graph, where a send and its receive complete together once both
/// are ready. Returns the ops completed, or the stuck ops.
fn complete(spec: &PipelineSpec, t: Transport, nodes: &[Node]) -> Result<usize> {
    let n = nodes.len();
    let mut partner = vec![usize::MAX; n];
    let mut halves: HashMap<(usize, usize, usize), Vec<usize>> = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        if let Some(key) = node.transfer {
            halves.entry(key).or_default().push(i);
        }
    }
    for (key, ids) in &halves {
        match ids.as_slice() {
            [a, b] => {
                partner[*a] = *b;
                partner[*b] = *a;
            }
            _ => {
                return Err(replay_err(
                    spec,
                    t,
                    format!(
                        "transfer {key:?} has {} halves, not a send and a receive",
                        ids.len()
                    ),
                ))
            }
        }
    }
    let mut waiting: Vec<usize> = nodes.iter().map(|x| x.deps.len()).collect();
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in nodes.iter().enumerate() {
        for &d in &node.deps {
            after[d].push(i);
        }
    }
    let mut done = vec![false; n];
    let mut queue: VecDeque<usize> = (0..n).filter(|&i| waiting[i] == 0).collect();
    let mut finished = 0;
    while let Some(i) = queue.pop_front() {
        if done[i] {
            continue;
        }
        let mut group = vec![i];
        if partner[i] != usize::MAX {
            let p = partner[i];
            if waiting[p] != 0 {
                // Started, waiting for the other half.
                continue;
            }
            group.push(p);
        }
        for j in group {
            if done[j] {
                continue;
            }
            done[j] = true;
            finished += 1;
            for &k in &after[j] {
                waiting[k] -= 1;
                if waiting[k] == 0 {
                    queue.push_back(k);
                }
            }
        }
    }
    if finished == n {
        return Ok(n);
    }
    let mut stuck: Vec<String> = Vec::new();
    let mut seen = HashSet::new();
    for (i, node) in nodes.iter().enumerate() {
        if done[i] || !seen.insert(node.stage) {
            continue;
        }
        let why = if waiting[i] == 0 {
            "started, its peer's half not".to_string()
        } else {
            let open: Vec<&str> = node
                .deps
                .iter()
                .filter(|&&d| !done[d])
                .map(|&d| nodes[d].what.as_str())
                .collect();
            format!("waits for {}", open.join(", "))
        };
        stuck.push(format!("stage {}: {} ({why})", node.stage, node.what));
    }
    Err(replay_err(
        spec,
        t,
        format!("the devices deadlock: {}", stuck.join("; ")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{Message, Schedule};

    fn spec() -> PipelineSpec {
        PipelineSpec {
            schedule: Schedule::GPipe,
            stages: 2,
            micro_batches: 1,
            virtual_stages: 1,
        }
    }

    /// Stage 0 sends an activation and stage 1 a gradient, each before its receive: the two
    /// messages and the two programs.
    fn both_send_first() -> (Message, Message, Vec<Vec<HostOp>>) {
        let a = Message::Activation { mb: 0, to: 1 };
        let g = Message::Gradient { mb: 0, to: 0 };
        (a, g, exchange(a, g, true))
    }

    /// Stage 0 sends `a` then receives `g`; stage 1 sends `g` and receives `a`, the send first
    /// where `stage1_sends_first`.
    /// The error `check` (the hosts' or the devices' walk) gives `programs` under `t`, which it
    /// must refuse (`what`: the refusal expected).
    fn refusal(
        check: fn(&PipelineSpec, Transport, &[Vec<HostOp>]) -> Result<usize>,
        t: Transport,
        programs: &[Vec<HostOp>],
        what: &str,
    ) -> String {
        check(&spec(), t, programs).expect_err(what).to_string()
    }

    fn exchange(a: Message, g: Message, stage1_sends_first: bool) -> Vec<Vec<HostOp>> {
        let mut stage1 = vec![
            HostOp::Send { to: 0, msg: g },
            HostOp::Recv { from: 0, msg: a },
        ];
        if !stage1_sends_first {
            stage1.reverse();
        }
        vec![
            vec![
                HostOp::Send { to: 1, msg: a },
                HostOp::Recv { from: 1, msg: g },
            ],
            stage1,
        ]
    }

    /// Two stages that each send first: opening each one's channel waits for the other, whose
    /// host waits in its own opening.
    #[test]
    fn hosts_that_open_channels_crosswise_deadlock() {
        let (a, g, programs) = both_send_first();
        let e = refusal(
            hosts,
            Transport::OneWayChannels,
            &programs,
            "crosswise opening",
        );
        assert!(e.contains("the hosts deadlock"), "{e}");
        // Received in the other order, both open.
        let programs = exchange(a, g, false);
        assert_eq!(
            hosts(&spec(), Transport::OneWayChannels, &programs).ok(),
            Some(2)
        );
        assert!(devices(&spec(), Transport::OneWayChannels, &programs).is_ok());
    }

    /// Buffered sends would let two stages that both send first finish (once their channels
    /// are open); blocking transfers on one stream per pair do not.
    #[test]
    fn opposite_sends_on_one_stream_deadlock_on_devices() {
        let (_, _, programs) = both_send_first();
        let e = refusal(devices, Transport::SharedPairs, &programs, "deadlock");
        assert!(e.contains("the devices deadlock"), "{e}");
        assert!(devices(&spec(), Transport::OneWayChannels, &programs).is_ok());
    }
}
