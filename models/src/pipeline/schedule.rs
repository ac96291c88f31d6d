//! Pipeline schedules as per-stage action lists, pure functions of (schedule, stages,
//! micro-batches, virtual stages): GPipe (all forwards, then all backwards), 1F1B (a warm-up of
//! forwards, then one forward and one backward in turn) and interleaved 1F1B (Megatron's: each
//! stage holds `v` chunks, micro-batches go round in groups of `pp`). The messages the actions
//! send follow from the list; `program` is what a stage's host issues in order (receives in
//! each sender's order, actions, sends), which the runner follows. `PipelineSpec::validate`
//! runs every stage's list against the others (buffered sends, receives in any order) and
//! replays the programs on device streams (`streams`) to prove both finish.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::{Result, TensorError};

/// Which schedule orders the micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    GPipe,
    OneFOneB,
    Interleaved,
}

impl std::fmt::Display for Schedule {
    /// The name `train --schedule` takes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
        })
    }
}

/// One unit of work of a stage: the forward or backward pass of micro-batch `mb` through the
/// stage's chunk `chunk` (virtual stage `chunk * pp + stage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Forward { mb: usize, chunk: usize },
    Backward { mb: usize, chunk: usize },
}

/// A tensor crossing from one stage to another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Message {
    /// The stream of micro-batch `mb` entering virtual stage `to`.
    Activation { mb: usize, to: usize },
    /// The gradient of the stream of micro-batch `mb` leaving virtual stage `to`.
    Gradient { mb: usize, to: usize },
    /// The tied embedding table, first stage to last (start of the step).
    Tied,
    /// Its gradient from the last stage, back to the first (end of the step).
    TiedGradient,
}

/// One step of a stage's host program, in the order the runner issues it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostOp {
    /// Receive `msg` from stage `from` (kept until an action uses it).
    Recv { from: usize, msg: Message },
    /// Run an action on data computed or received before.
    Run(Action),
    /// Send `msg` (computed by the `Run` just before, or the tied table or its gradient) to
    /// stage `to`.
    Send { to: usize, msg: Message },
}

/// The pipeline of one training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineSpec {
    pub schedule: Schedule,
    /// Pipeline stages (`pp`).
    pub stages: usize,
    pub micro_batches: usize,
    /// Chunks per stage (interleaved only; 1 otherwise).
    pub virtual_stages: usize,
}

pub(super) fn spec_err(detail: String) -> TensorError {
    TensorError::Shape {
        op: "PipelineSpec::validate",
        shapes: "-".into(),
        sbps: "-".into(),
        detail,
    }
}

impl PipelineSpec {
    /// Virtual stages in all (`pp * v`).
    pub fn chunks(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// The pipeline stage of virtual stage `g`.
    pub fn stage_of(&self, g: usize) -> usize {
        g % self.stages.max(1)
    }

    /// Stage `stage`'s actions in order.
    pub fn actions(&self, stage: usize) -> Vec<Action> {
        let (pp, m) = (self.stages.max(1), self.micro_batches);
        match self.schedule {
            Schedule::GPipe => (0..m)
                .map(|mb| Action::Forward { mb, chunk: 0 })
                .chain((0..m).map(|mb| Action::Backward { mb, chunk: 0 }))
                .collect(),
            Schedule::OneFOneB => {
                let warmup = (pp - 1 - stage.min(pp - 1)).min(m);
                let f = |mb| Action::Forward { mb, chunk: 0 };
                let b = |mb| Action::Backward { mb, chunk: 0 };
                let mut out: Vec<Action> = (0..warmup).map(f).collect();
                for i in 0..m - warmup {
                    out.push(f(warmup + i));
                    out.push(b(i));
                }
                out.extend((m - warmup..m).map(b));
                out
            }
            Schedule::Interleaved => self.interleaved(stage),
        }
    }

    /// Megatron's interleaved order: the k-th forward runs chunk `(k / pp) % v` on
    /// micro-batch `(k / (pp v)) pp + k % pp`; backwards likewise with the chunks reversed.
    fn interleaved(&self, stage: usize) -> Vec<Action> {
        let (pp, m, v) = (
            self.stages.max(1),
            self.micro_batches,
            self.virtual_stages.max(1),
        );
        let total = m * v;
        let at = |k: usize, forward: bool| {
            let in_group = k % (pp * v);
            let chunk = in_group / pp;
            let chunk = if forward { chunk } else { v - 1 - chunk };
            let mb = (k / (pp * v)) * pp + k % pp;
            if forward {
                Action::Forward { mb, chunk }
            } else {
                Action::Backward { mb, chunk }
            }
        };
        let warmup = ((pp - 1 - stage.min(pp - 1)) * 2 + (v - 1) * pp).min(total);
        let mut out: Vec<Action> = (0..warmup).map(|k| at(k, true)).collect();
        for i in 0..total - warmup {
            out.push(at(warmup + i, true));
            out.push(at(i, false));
        }
        out.extend((total - warmup..total).map(|k| at(k, false)));
        out
    }

    /// The virtual stage of `a` on `stage`.
    pub fn virtual_stage(&self, stage: usize, a: Action) -> usize {
        match a {
            Action::Forward { chunk, .. } | Action::Backward { chunk, .. } => {
                chunk * self.stages + stage
            }
        }
    }

    /// What `a` on `stage` needs from other stages (or earlier actions) before it runs.
    pub fn needs(&self, stage: usize, a: Action) -> Option<Message> {
        let g = self.virtual_stage(stage, a);
        match a {
            Action::Forward { mb, .. } if g > 0 => Some(Message::Activation { mb, to: g }),
            Action::Backward { mb, .. } if g + 1 < self.chunks() => {
                Some(Message::Gradient { mb, to: g })
            }
            _ => None,
        }
    }

    /// What `a` on `stage` sends when done, with the receiving stage.
    pub fn sends(&self, stage: usize, a: Action) -> Option<(usize, Message)> {
        let g = self.virtual_stage(stage, a);
        match a {
            Action::Forward { mb, .. } if g + 1 < self.chunks() => {
                Some((self.stage_of(g + 1), Message::Activation { mb, to: g + 1 }))
            }
            Action::Backward { mb, .. } if g > 0 => {
                Some((self.stage_of(g - 1), Message::Gradient { mb, to: g - 1 }))
            }
            _ => None,
        }
    }

    /// Every message `stage` sends to another stage, in order, with the receiving stage: the
    /// tied table first (first stage), the actions' messages, the tied gradient last (last
    /// stage). Messages a stage sends to itself are left out.
    pub fn outbox(&self, stage: usize) -> Vec<(usize, Message)> {
        self.outbox_of(stage, true)
    }

    /// Every message of the step between different stages, as (sender, receiver, message), in
    /// each sender's order, stage by stage (with the tied table's when `tied`).
    pub fn messages(&self, tied: bool) -> Vec<(usize, usize, Message)> {
        (0..self.stages)
            .flat_map(|from| {
                self.outbox_of(from, tied)
                    .into_iter()
                    .map(move |(to, m)| (from, to, m))
            })
            .collect()
    }

    /// `outbox`, with the tied table and its gradient only when `tied`.
    fn outbox_of(&self, stage: usize, tied: bool) -> Vec<(usize, Message)> {
        let pp = self.stages;
        let tied = tied && pp > 1;
        let mut out = Vec::new();
        if tied && stage == 0 {
            out.push((pp - 1, Message::Tied));
        }
        for a in self.actions(stage) {
            if let Some((to, msg)) = self.sends(stage, a) {
                if to != stage {
                    out.push((to, msg));
                }
            }
        }
        if tied && stage == pp - 1 {
            out.push((0, Message::TiedGradient));
        }
        out
    }

    /// What stage `stage`'s host issues, in order, when the first and last chunks share a
    /// parameter (`tied`, pp > 1: the table goes to the last stage first, its gradient back
    /// last). Before an action that needs a message from another stage, the stage receives that
    /// sender's messages in the order it sent them up to the one needed (keeping early ones),
    /// so every pair of stages receives in send order; messages to itself are kept, not sent.
    pub fn program(&self, stage: usize, tied: bool) -> Vec<HostOp> {
        let pp = self.stages;
        let tied = tied && pp > 1;
        let mut expected: HashMap<usize, VecDeque<Message>> = (0..pp)
            .filter(|&s| s != stage)
            .map(|from| {
                let q = self
                    .outbox_of(from, tied)
                    .into_iter()
                    .filter(|&(to, _)| to == stage)
                    .map(|(_, m)| m)
                    .collect();
                (from, q)
            })
            .collect();
        let mut received: HashSet<Message> = HashSet::new();
        let mut out = Vec::new();
        let mut take = |from: usize, msg: Message, out: &mut Vec<HostOp>| {
            if received.remove(&msg) {
                return;
            }
            while let Some(next) = expected.get_mut(&from).and_then(VecDeque::pop_front) {
                out.push(HostOp::Recv { from, msg: next });
                if next == msg {
                    return;
                }
                received.insert(next);
            }
        };
        if tied && stage == 0 {
            out.push(HostOp::Send {
                to: pp - 1,
                msg: Message::Tied,
            });
        }
        if tied && stage == pp - 1 {
            take(0, Message::Tied, &mut out);
        }
        for a in self.actions(stage) {
            if let Some(msg) = self.needs(stage, a) {
                let from = self.sender_of(msg);
                if from != stage {
                    take(from, msg, &mut out);
                }
            }
            out.push(HostOp::Run(a));
            if let Some((to, msg)) = self.sends(stage, a) {
                if to != stage {
                    out.push(HostOp::Send { to, msg });
                }
            }
        }
        if tied && stage == pp - 1 {
            out.push(HostOp::Send {
                to: 0,
                msg: Message::TiedGradient,
            });
        }
        if tied && stage == 0 {
            take(pp - 1, Message::TiedGradient, &mut out);
        }
        out
    }

    /// The stage that sends `msg` (for the tied messages: the first stage for the table, the
    /// last for its gradient).
    pub fn sender_of(&self, msg: Message) -> usize {
        match msg {
            Message::Activation { to, .. } => self.stage_of(to.saturating_sub(1)),
            Message::Gradient { to, .. } => self.stage_of(to + 1),
            Message::Tied => 0,
            Message::TiedGradient => self.stages.saturating_sub(1),
        }
    }

    /// The ideal bubble fraction: `(p - 1) / (m + p - 1)`, interleaved `(p - 1) / (v m + p - 1)`.
    pub fn bubble_theory(&self) -> f64 {
        let (p, m, v) = (
            self.stages as f64,
            self.micro_batches as f64,
            self.virtual_stages as f64,
        );
        (p - 1.0) / (v * m + p - 1.0)
    }

    /// The bubble of this schedule when every forward through a whole stage costs `forward`
    /// and every backward `backward` (a chunk a `1/v` share) and messages cost nothing: each
    /// action starts when its stage is free and its input has been sent; the result is the
    /// mean over stages of the fraction of the makespan a stage is idle.
    pub fn replay(&self, forward: f64, backward: f64) -> Result<f64> {
        let pp = self.stages;
        let v = self.virtual_stages.max(1) as f64;
        let lists: Vec<Vec<Action>> = (0..pp).map(|s| self.actions(s)).collect();
        let mut sent: std::collections::HashMap<Message, f64> = std::collections::HashMap::new();
        let mut clock = vec![0.0f64; pp];
        let mut busy = vec![0.0f64; pp];
        let mut at = vec![0usize; pp];
        while at.iter().zip(&lists).any(|(&i, l)| i < l.len()) {
            let mut progressed = false;
            for s in 0..pp {
                while let Some(&a) = lists[s].get(at[s]) {
                    let ready = match self.needs(s, a) {
                        None => Some(clock[s]),
                        Some(m) => sent.get(&m).map(|&t| t.max(clock[s])),
                    };
                    let Some(start) = ready else { break };
                    let cost = match a {
                        Action::Forward { .. } => forward / v,
                        Action::Backward { .. } => backward / v,
                    };
                    clock[s] = start + cost;
                    busy[s] += cost;
                    if let Some((_, m)) = self.sends(s, a) {
                        sent.insert(m, clock[s]);
                    }
                    at[s] += 1;
                    progressed = true;
                }
            }
            if !progressed {
                return Err(spec_err(format!("{self:?} deadlocks in the replay")));
            }
        }
        let span = clock.iter().copied().fold(0.0, f64::max);
        if span <= 0.0 {
            return Ok(0.0);
        }
        Ok(busy.iter().map(|b| 1.0 - b / span).sum::<f64>() / pp as f64)
    }

    /// Runs every stage's list against the others with buffered sends and receives in any
    /// order; returns the number of rounds, or the stages stuck and what they wait for.
    pub fn simulate(&self) -> Result<usize> {
        let pp = self.stages;
        let lists: Vec<Vec<Action>> = (0..pp).map(|s| self.actions(s)).collect();
        let expected: usize = 2 * self.micro_batches * self.virtual_stages;
        for (s, l) in lists.iter().enumerate() {
            let distinct: HashSet<&Action> = l.iter().collect();
            if l.len() != expected || distinct.len() != expected {
                return Err(spec_err(format!(
                    "stage {s} has {} actions ({} distinct), expected {expected}",
                    l.len(),
                    distinct.len()
                )));
            }
        }
        let mut sent: HashSet<Message> = HashSet::new();
        let mut done_fwd: HashSet<(usize, usize, usize)> = HashSet::new();
        let mut at = vec![0usize; pp];
        let mut rounds = 0;
        while at.iter().zip(&lists).any(|(&i, l)| i < l.len()) {
            rounds += 1;
            let mut progressed = false;
            for s in 0..pp {
                while let Some(&a) = lists[s].get(at[s]) {
                    let ready = self.needs(s, a).is_none_or(|m| sent.contains(&m))
                        && match a {
                            Action::Backward { mb, chunk } => done_fwd.contains(&(s, mb, chunk)),
                            Action::Forward { .. } => true,
                        };
                    if !ready {
                        break;
                    }
                    if let Action::Forward { mb, chunk } = a {
                        done_fwd.insert((s, mb, chunk));
                    }
                    if let Some((_, m)) = self.sends(s, a) {
                        sent.insert(m);
                    }
                    at[s] += 1;
                    progressed = true;
                }
            }
            if !progressed {
                let stuck: Vec<String> = (0..pp)
                    .filter_map(|s| {
                        lists[s].get(at[s]).map(|&a| {
                            format!("stage {s} at {a:?} waits for {:?}", self.needs(s, a))
                        })
                    })
                    .collect();
                return Err(spec_err(format!(
                    "{self:?} deadlocks: {}",
                    stuck.join("; ")
                )));
            }
        }
        Ok(rounds)
    }
}
