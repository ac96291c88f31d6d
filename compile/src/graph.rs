//! A program's replay on a device as one device graph (a CUDA graph): the first replay runs
//! launch by launch (it allocates the arena and warms the libraries' plans up), the second is
//! captured as one graph and launched, and every later one launches that graph after binding
//! the step's inputs. The graph reads the addresses its capture saw: the arena's (fixed), the
//! constants', each step input's piece at the capture (of the inputs it reads: one it never
//! reads is neither kept nor bound), and the output pieces the capture allocated. So a replay
//! launches it only when it may: an input with another piece is copied into the captured one,
//! which must then be the graph's alone; a large output piece of an
//! earlier launch must no longer be held (the launch writes it again), while small outputs
//! (a loss a caller keeps for its log) are handed out as copies made after each launch. Before
//! the capture and each launch the compute stream waits for the collectives that touched the
//! inputs (a ZeRO-3 shard's last all-gather, say): a capture cannot record that wait. When
//! it may not, that replay runs launch by launch (same results, in the same arena). Where no graph can be captured
//! (the CPU, a device that cannot, ops timed or traced, `OXIFLOW_CUDA_GRAPH=0`), and where
//! an input the program reads is a new piece each step from a collective queued before it (a
//! ZeRO-1/2 parameter all-gathered anew: a graph would wait for all of them before its first
//! kernel, launch by launch each op waits for its own), every replay runs launch by launch,
//! and the note says why.

use std::sync::{Arc, Weak};

use oxiflow_tensor::capture::piece_of;
use oxiflow_tensor::{
    awaits_collectives, capture_graph, copy_storage, duplicate_storage, graph_capture_refusal,
    order_after_collectives, BoundPiece, Device, DeviceGraph, Op, Storage, Tensor, TensorError,
};

use crate::error::{CompileError, Result};
use crate::ir::{NodeKind, Program};
use crate::replay::output_tensors;

/// Whether replays may use device graphs (`OXIFLOW_CUDA_GRAPH=0` turns them off; see
/// `oxiflow_collectives::env::device_graphs_allowed`).
fn graphs_allowed() -> bool {
    oxiflow_collectives::env::device_graphs_allowed()
}

/// How a program's replays run.
pub(crate) enum GraphState {
    /// Launch by launch so far (`replays` of them, the last one reading `seen`: each step
    /// input's piece, where the program reads it); the next may capture a graph.
    Launches {
        replays: u32,
        seen: Vec<Option<Weak<Storage>>>,
    },
    /// Each replay launches this graph.
    Graph(Box<GraphReplay>),
    /// Launch by launch for good, and why.
    Off(String),
}

impl std::fmt::Debug for GraphState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GraphState::Launches { replays, .. } => write!(f, "Launches({replays})"),
            GraphState::Graph(g) => write!(f, "Graph({} nodes)", g.graph.nodes()),
            GraphState::Off(why) => write!(f, "Off({why})"),
        }
    }
}

impl Default for GraphState {
    fn default() -> GraphState {
        GraphState::Launches {
            replays: 0,
            seen: Vec::new(),
        }
    }
}

/// A captured replay: the graph, the piece of each step input it reads (None for an input it
/// never reads, which is neither bound nor kept) and the pieces it writes the outputs into.
pub(crate) struct GraphReplay {
    graph: Box<dyn DeviceGraph>,
    /// Bound (see `BoundPiece`): an update written over one of these pieces is what the
    /// next bind would copy into it.
    inputs: Vec<Option<BoundPiece>>,
    /// Whether the program reads step input `k`.
    read: Vec<bool>,
    outputs: Vec<Option<Arc<Storage>>>,
    /// Whether output `k` is handed out as a copy (at most `COPIED_OUTPUT_BYTES` bytes).
    copied: Vec<bool>,
}

/// Outputs up to this size are handed out as copies made after each launch, so a caller may
/// keep them across steps; larger ones are handed out as the graph's own pieces.
const COPIED_OUTPUT_BYTES: usize = 1 << 20;

/// How many of `list`'s entries are `p`.
fn held_by<'a>(list: impl IntoIterator<Item = &'a Arc<Storage>>, p: &Arc<Storage>) -> usize {
    list.into_iter().filter(|q| Arc::ptr_eq(q, p)).count()
}

impl GraphReplay {
    /// Makes the captured input pieces hold `inputs`' values, or says why the graph cannot run
    /// now (nothing was copied then).
    fn bind(&self, inputs: &[Tensor]) -> Result<std::result::Result<(), String>> {
        for (k, p) in self.outputs.iter().enumerate() {
            if let (Some(p), false) = (p, self.copied[k]) {
                if Arc::strong_count(p) > held_by(self.outputs.iter().flatten(), p) {
                    return Ok(Err(format!(
                        "output {k} of the last replay is still held, and the graph writes it again"
                    )));
                }
            }
        }
        let mut copies = Vec::new();
        for (k, ((captured, t), _)) in self
            .inputs
            .iter()
            .zip(inputs)
            .zip(&self.read)
            .enumerate()
            .filter(|(_, (_, &read))| read)
        {
            match (captured.as_ref().map(BoundPiece::piece), piece_of(t)) {
                (None, None) => {}
                (Some(c), Some(now)) if Arc::ptr_eq(c, now) => {}
                (Some(c), Some(now)) => {
                    let bound = self.inputs.iter().flatten().map(BoundPiece::piece);
                    if Arc::strong_count(c) > held_by(bound, c) {
                        return Ok(Err(format!(
                            "input {k} has a new piece, and the one the graph reads is still held elsewhere"
                        )));
                    }
                    copies.push((now, c));
                }
                _ => return Ok(Err(format!("input {k} has a piece now, or none"))),
            }
        }
        for (now, c) in copies {
            copy_storage(now, c)?;
        }
        // The launch reads the bound pieces: after the collectives that wrote them.
        for p in self.inputs.iter().flatten() {
            order_after_collectives(p.piece());
        }
        Ok(Ok(()))
    }

    /// The step's outputs after a launch: the graph's pieces, small ones copied.
    fn outputs(&self, program: &Program) -> Result<Vec<Tensor>> {
        let pieces = self
            .outputs
            .iter()
            .zip(&self.copied)
            .map(|(p, &copy)| match p {
                Some(p) if copy => Ok(Some(Arc::new(duplicate_storage(p)?))),
                p => Ok(p.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        output_tensors(program, &pieces)
    }
}

/// The pieces of `inputs` that the program reads (`read`), held weakly: a `Weak` keeps its
/// allocation's address, so a later piece at the same address is never taken for it.
fn pieces_read(inputs: &[Tensor], read: &[bool]) -> Vec<Option<Weak<Storage>>> {
    inputs
        .iter()
        .zip(read)
        .map(|(t, &r)| piece_of(t).filter(|_| r).map(Arc::downgrade))
        .collect()
}

/// Why `program` on `device` with `inputs` (of which it reads those `read` says; `seen` the
/// pieces the last replay read) is never captured, if it is not: an op whose kernels a graph
/// cannot hold among them.
fn never(
    device: Device,
    program: &Program,
    inputs: &[Tensor],
    read: &[bool],
    seen: &[Option<Weak<Storage>>],
) -> Option<String> {
    if !matches!(device, Device::Cuda(_)) {
        return Some(format!("its arena is on {device}"));
    }
    if !graphs_allowed() {
        return Some("OXIFLOW_CUDA_GRAPH=0".into());
    }
    // Refused before anything is queued (ops timed or traced one by one): launch by launch,
    // where a capture failing midway in a program that communicates is an error.
    if let Some(why) = graph_capture_refusal(device) {
        return Some(why);
    }
    if let Some(why) = program.nodes.iter().find_map(|n| match &n.kind {
        NodeKind::Op(o) => match &o.local_op {
            Op::Extern(x) => x
                .op()
                .graph_refusal()
                .map(|why| format!("{}: {why}", x.op().name())),
            _ => None,
        },
        NodeKind::Boxing { .. } => None,
    }) {
        return Some(why);
    }
    if let Some(why) = inputs.iter().enumerate().find_map(|(k, t)| {
        piece_of(t)
            .filter(|p| p.device() != device)
            .map(|p| format!("input {k} is on {}, not {device}", p.device()))
    }) {
        return Some(why);
    }
    // An input with a new piece since the last replay that a collective still touches (a
    // ZeRO-1/2 parameter all-gathered anew after each step): a graph would copy each such
    // piece into its own after waiting for every such collective, before its first kernel,
    // where launch by launch each op waits only for its own inputs' (the forward pass runs
    // under the later gathers, as eager's does). A piece updated in place (a ZeRO-3 shard,
    // say) is the one the graph reads, whatever collective read it last.
    inputs
        .iter()
        .zip(read)
        .zip(seen)
        .enumerate()
        .find(|(_, ((t, &r), last))| {
            let new = |p: &Arc<Storage>| {
                last.as_ref()
                    .is_some_and(|w| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(p)))
            };
            r && piece_of(t).is_some_and(|p| new(p) && awaits_collectives(p))
        })
        .map(|(k, _)| {
            format!(
                "input {k} is a new piece written by a collective before each step, which \
                 launch by launch each op waits for only where it reads it"
            )
        })
}

/// One replay: its outputs, whether it launched the device graph, and a note when how
/// replays run changed.
pub(crate) struct GraphRun {
    pub outputs: Vec<Tensor>,
    pub launched_graph: bool,
    pub note: Option<String>,
    /// How long capturing and instantiating the device graph took, on the replay that did.
    pub graph_built_in: Option<std::time::Duration>,
}

impl GraphRun {
    fn launches(outputs: Vec<Tensor>, note: Option<String>) -> GraphRun {
        GraphRun {
            outputs,
            launched_graph: false,
            note,
            graph_built_in: None,
        }
    }
}

/// Runs one replay of `program` (on `device`) per `state`: `launches` runs it launch by
/// launch.
pub(crate) fn replay_with_graph(
    state: &mut GraphState,
    device: Device,
    program: &Program,
    inputs: &[Tensor],
    launches: &mut dyn FnMut() -> Result<Vec<Tensor>>,
) -> Result<GraphRun> {
    match state {
        GraphState::Off(_) => Ok(GraphRun::launches(launches()?, None)),
        GraphState::Launches { replays, seen } => {
            let read = program.inputs_read();
            if let Some(why) = never(device, program, inputs, &read, seen) {
                // The host has no graphs: nothing to say there.
                let note = matches!(device, Device::Cuda(_))
                    .then(|| format!("compiled step: replays launch by launch ({why})"));
                *state = GraphState::Off(why);
                return Ok(GraphRun::launches(launches()?, note));
            }
            if *replays == 0 {
                *replays = 1;
                *seen = pieces_read(inputs, &read);
                return Ok(GraphRun::launches(launches()?, None));
            }
            // A step input a collective touched (a ZeRO-3 shard's last all-gather, say) is
            // waited for now: a capture cannot record the wait on work queued before it.
            for p in inputs.iter().filter_map(piece_of) {
                order_after_collectives(p);
            }
            let mut outs = None;
            let started = std::time::Instant::now();
            let captured = capture_graph(device, &mut || match launches() {
                Ok(o) => {
                    outs = Some(o);
                    Ok(())
                }
                Err(e) => Err(TensorError::Capture {
                    op: "replay",
                    detail: e.to_string(),
                }),
            });
            match (captured, outs) {
                (Ok(graph), Some(outs)) => {
                    let built_in = started.elapsed();
                    let outputs: Vec<_> = outs.iter().map(|t| piece_of(t).cloned()).collect();
                    drop(outs);
                    let g = GraphReplay {
                        graph,
                        inputs: inputs
                            .iter()
                            .zip(&read)
                            .map(|(t, &r)| piece_of(t).filter(|_| r).cloned().map(BoundPiece::new))
                            .collect(),
                        read,
                        copied: outputs
                            .iter()
                            .map(|p| p.as_ref().is_some_and(|p| p.bytes() <= COPIED_OUTPUT_BYTES))
                            .collect(),
                        outputs,
                    };
                    g.graph.launch()?;
                    let outs = g.outputs(program)?;
                    let note = format!(
                        "compiled step: replays as one device graph of {} nodes ({} bytes kept for it besides the arena), captured and instantiated in {} ms",
                        g.graph.nodes(),
                        g.graph.kept_bytes(),
                        built_in.as_millis()
                    );
                    *state = GraphState::Graph(Box::new(g));
                    Ok(GraphRun {
                        outputs: outs,
                        launched_graph: true,
                        note: Some(note),
                        graph_built_in: Some(built_in),
                    })
                }
                (captured, _) => {
                    let why = match captured {
                        Err(e) => e.to_string(),
                        Ok(_) => "the capture gave no outputs".into(),
                    };
                    // A collective captured and never launched may leave NCCL's communicators
                    // out of step: a program that communicates stops here instead.
                    if program.nodes.iter().any(|n| n.communicates()) {
                        *state = GraphState::Off(why.clone());
                        return Err(CompileError::Replay {
                            node: program.nodes.len(),
                            op: "cuda graph",
                            detail: format!(
                                "capturing the step as a CUDA graph failed: {why}; OXIFLOW_CUDA_GRAPH=0 replays it launch by launch"
                            ),
                        });
                    }
                    let note = format!("compiled step: replays launch by launch ({why})");
                    *state = GraphState::Off(why);
                    Ok(GraphRun::launches(launches()?, Some(note)))
                }
            }
        }
        GraphState::Graph(g) => match g.bind(inputs)? {
            Ok(()) => {
                g.graph.launch()?;
                Ok(GraphRun {
                    outputs: g.outputs(program)?,
                    launched_graph: true,
                    note: None,
                    graph_built_in: None,
                })
            }
            Err(why) => {
                tracing::debug!("compiled step: this replay runs launch by launch: {why}");
                Ok(GraphRun::launches(launches()?, None))
            }
        },
    }
}
