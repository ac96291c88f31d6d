//! `CompiledStep`: a step function compiled on its first call with given input shapes,
//! dtypes and layouts (captured by running it eagerly), replayed on later calls with the same
//! ones, and compiled again, saying what changed, when they differ. On a device the first
//! call's outputs come from the program's first replay, run as part of the compile: the
//! capture's own values may be provisional (a fused attention computed by other kernels while
//! cuDNN builds the plans the replays run), and the compile time counts the wait for them.
//!
//! A step is a closure and its inputs: every tensor whose value may change between calls
//! (the batch, parameters, optimizer state) must be one of the inputs, and the closure returns
//! every tensor the caller needs afterwards (the loss, the new parameters and state), which the
//! caller stores back itself (the replay does not run the closure). Anything else the closure
//! reads is a constant of the program, as are the host values it reads (attributes such as a
//! learning rate): a closure must give the same program for the same inputs.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oxiflow_tensor::arena::Arena;
use oxiflow_tensor::capture::start_capture;
use oxiflow_tensor::{memory, Device, DeviceType, MatmulPrecision, Tensor};

use crate::error::CompileError;
use crate::graph::{replay_with_graph, GraphState};
use crate::ir::{Program, StepKey};
use crate::passes::arena::{plan_arena, ArenaPlan};
use crate::passes::dce::{eliminate_dead_code, DceStats};
use crate::passes::fusion::{fuse_elementwise, prebuild_kernels, FusionStats};
use crate::passes::liveness::{liveness, Liveness};
use crate::recorder::{Recorder, Recording, Refusal};
use crate::replay::{arena_device, replay};

/// One compiled program with its plans, and the arena its replays run in (allocated by the
/// first replay, reused by every later one; a replay holds it alone).
#[derive(Debug)]
pub struct Compiled {
    pub program: Program,
    pub live: Liveness,
    pub arena: ArenaPlan,
    pub report: CompileReport,
    memory: Mutex<Option<Arena>>,
    /// How replays run (launch by launch, or one device graph: see [`crate::graph`]).
    graph: Mutex<GraphState>,
    /// What changed in how replays run, until read.
    note: Mutex<Option<String>>,
    /// Replays that launched the device graph, and those that ran launch by launch.
    counts: Mutex<ReplayCounts>,
    /// How long capturing and instantiating the device graph took, once it was.
    graph_built_in: Mutex<Option<Duration>>,
}

/// How a program's replays ran so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayCounts {
    /// Replays that launched the program's device graph (its capture included).
    pub graph: usize,
    /// Replays that ran launch by launch.
    pub launches: usize,
}

impl Compiled {
    /// Runs the program on `inputs` in its arena (see [`replay`]); on a CUDA device from the
    /// second replay on as one CUDA graph where it can (see [`crate::graph`]).
    pub fn replay(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, CompileError> {
        let mut memory = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        let device = arena_device(&self.program, &self.arena);
        if memory.is_none() {
            *memory = Some(Arena::new(device, self.arena.bytes)?);
        }
        let Some(arena) = memory.as_ref() else {
            return Err(CompileError::Inputs {
                detail: "the program's arena is missing".into(),
            });
        };
        let mut state = self.graph.lock().unwrap_or_else(|e| e.into_inner());
        let ran = replay_with_graph(&mut state, device, &self.program, inputs, &mut || {
            replay(&self.program, &self.live, &self.arena, arena, inputs)
        })?;
        let mut note = ran.note;
        if let Some(t) = ran.graph_built_in {
            *self
                .graph_built_in
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(t);
            note = note.map(|n| {
                format!(
                    "{n}; compile time with it {} ms",
                    (self.report.compile_time + t).as_millis()
                )
            });
        }
        if let Some(n) = note {
            *self.note.lock().unwrap_or_else(|e| e.into_inner()) = Some(n);
        }
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if ran.launched_graph {
            counts.graph += 1;
        } else {
            counts.launches += 1;
        }
        Ok(ran.outputs)
    }

    /// How long capturing and instantiating the program's device graph took, once a replay
    /// did (the report's compile time counts the capture, the passes and the first replay;
    /// this is the rest of what compiling the step costs on a device).
    pub fn graph_built_in(&self) -> Option<Duration> {
        *self
            .graph_built_in
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// How the replays ran so far.
    pub fn replay_counts(&self) -> ReplayCounts {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What changed in how replays run since the last call (the first replay as one device
    /// graph, or why replays run launch by launch), once.
    pub fn take_note(&self) -> Option<String> {
        self.note.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Whether replays launch one device graph now.
    pub fn replays_as_graph(&self) -> bool {
        matches!(
            *self.graph.lock().unwrap_or_else(|e| e.into_inner()),
            GraphState::Graph(_)
        )
    }

    /// The arena the replays run in, once the first replay allocated it: its bytes and, on
    /// the host, its address (the same on every replay).
    pub fn arena_in_use(&self) -> Option<(usize, usize)> {
        let memory = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        memory.as_ref().map(|a| (a.bytes(), a.host_address()))
    }
}

/// What a compilation did.
#[derive(Clone, Debug)]
pub struct CompileReport {
    /// Global ops captured (every rank's count is the same).
    pub ops: usize,
    /// Kernels this rank runs after the passes.
    pub kernels: usize,
    /// Boxing runs kept (each every member's collectives).
    pub boxings: usize,
    /// What dead-code elimination removed.
    pub removed: DceStats,
    /// What element-wise fusion did.
    pub fusion: FusionStats,
    /// Bytes of this rank's arena.
    pub arena_bytes: usize,
    /// Bytes of the inputs and constants the program reads (outside the arena).
    pub external_bytes: usize,
    /// Most bytes above what was live before, measured while the capture ran eagerly (device
    /// blocks when the step made any, else host bytes where the program counts them;
    /// process-wide).
    pub eager_peak: Option<usize>,
    /// Capture, passes and, on a device, the first replay (which gives the step's outputs and
    /// waits for the kernels replays run).
    pub compile_time: Duration,
    /// Why it compiled again (None for the first compilation).
    pub recompiled_because: Option<String>,
}

impl fmt::Display for CompileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "compiled: {} ops -> {} kernels, arena {} bytes (eager peak {} bytes), compile time {} ms",
            self.ops,
            self.kernels,
            self.arena_bytes,
            self.eager_peak
                .map_or_else(|| "unmeasured".to_string(), |b| b.to_string()),
            self.compile_time.as_millis()
        )
    }
}

/// What one call did.
#[derive(Debug)]
pub enum StepRun {
    /// The step was captured (it ran eagerly) and compiled.
    Compiled(Arc<Compiled>),
    /// The compiled program was replayed.
    Replayed,
}

/// A step compiled per input key (see the module docs).
#[derive(Default)]
pub struct CompiledStep {
    programs: Vec<Arc<Compiled>>,
    last_key: Option<StepKey>,
}

/// The eager bytes counters now: device blocks, and host bytes when counted.
fn memory_now() -> (memory::MemoryStats, Option<memory::MemoryStats>) {
    (memory::device(), memory::host())
}

/// The eager step's peak above what was live before it: device blocks when the step made
/// any (its values live on a device), else host bytes when counted.
fn eager_peak_of(
    before: (memory::MemoryStats, Option<memory::MemoryStats>),
    after: (memory::MemoryStats, Option<memory::MemoryStats>),
) -> Option<usize> {
    if after.0.peak > 0 {
        return Some(after.0.peak.saturating_sub(before.0.live));
    }
    match (before.1, after.1) {
        (Some(b), Some(a)) if a.peak > 0 => Some(a.peak.saturating_sub(b.live)),
        _ => None,
    }
}

impl CompiledStep {
    pub fn new() -> CompiledStep {
        CompiledStep::default()
    }

    /// The programs compiled so far.
    pub fn programs(&self) -> &[Arc<Compiled>] {
        &self.programs
    }

    /// What changed in how the programs' replays run since the last call (see
    /// [`Compiled::take_note`]).
    pub fn take_notes(&self) -> Vec<String> {
        self.programs.iter().filter_map(|c| c.take_note()).collect()
    }

    /// Runs the step on `inputs`: replays the program compiled for their key, or captures
    /// `step` (running it eagerly) and compiles it. Returns the step's outputs and what
    /// happened; the step's own errors come back as they are, the compiler's converted. Every
    /// rank must call it alike. The step's products are f32 ones ([`CompiledStep::run_at`]
    /// names another precision).
    pub fn run<E, F>(
        &mut self,
        inputs: &[Tensor],
        step: F,
    ) -> std::result::Result<(Vec<Tensor>, StepRun), E>
    where
        E: From<CompileError>,
        F: FnOnce() -> std::result::Result<Vec<Tensor>, E>,
    {
        self.run_at(inputs, MatmulPrecision::F32, step)
    }

    /// [`CompiledStep::run`] of a step whose products run at `matmul` (its model's policy):
    /// a program is replayed only for calls at the precision it was captured at.
    pub fn run_at<E, F>(
        &mut self,
        inputs: &[Tensor],
        matmul: MatmulPrecision,
        step: F,
    ) -> std::result::Result<(Vec<Tensor>, StepRun), E>
    where
        E: From<CompileError>,
        F: FnOnce() -> std::result::Result<Vec<Tensor>, E>,
    {
        let key = StepKey::of(inputs, matmul);
        let found = self.programs.iter().find(|c| c.program.key == key).cloned();
        if let Some(c) = found {
            self.last_key = Some(key);
            let outs = c.replay(inputs)?;
            return Ok((outs, StepRun::Replayed));
        }
        let reason = self.last_key.as_ref().map(|old| key.changes_from(old));
        let (outs, compiled) = capture(key.clone(), inputs, step, reason)?;
        let compiled = Arc::new(compiled);
        self.programs.push(compiled.clone());
        self.last_key = Some(key);
        Ok((outs, StepRun::Compiled(compiled)))
    }
}

/// Whether the step runs on a device: some input is placed on one (for a global tensor its
/// placement's device type, the same on every rank; else the local tensor's device).
fn on_device(inputs: &[Tensor]) -> bool {
    inputs.iter().any(|t| match t.placement() {
        Some(p) => p.device() != DeviceType::Cpu,
        None => t.device() != Device::Cpu,
    })
}

/// Captures `step` on `inputs` and compiles it.
fn capture<E, F>(
    key: StepKey,
    inputs: &[Tensor],
    step: F,
    reason: Option<String>,
) -> std::result::Result<(Vec<Tensor>, Compiled), E>
where
    E: From<CompileError>,
    F: FnOnce() -> std::result::Result<Vec<Tensor>, E>,
{
    let started = Instant::now();
    // On a device the step's outputs are the first replay's (decided once, before the
    // capture, which may then compute provisional values).
    let replays = on_device(inputs);
    let recording = Rc::new(RefCell::new(Recording::new(inputs)));
    let before = memory_now();
    memory::reset_peaks();
    let outs = {
        let guard = start_capture(Box::new(Recorder(recording.clone(), replays)));
        let _guard = guard.map_err(CompileError::from)?;
        step()
    };
    let eager_peak = eager_peak_of(before, memory_now());
    let recording = Rc::try_unwrap(recording)
        .map(RefCell::into_inner)
        .map_err(|_| CompileError::Inputs {
            detail: "the capture's recorder is still installed".into(),
        })?;
    match recording.refusal() {
        Some(Refusal::HostRead(op, tensor)) => {
            return Err(CompileError::HostRead {
                op,
                tensor: tensor.clone(),
            }
            .into())
        }
        Some(Refusal::HostData(op, tensor)) => {
            return Err(CompileError::HostData {
                op,
                tensor: tensor.clone(),
            }
            .into())
        }
        Some(Refusal::Unreplayable(op, why)) => {
            return Err(CompileError::Unreplayable {
                op,
                why: why.clone(),
            }
            .into())
        }
        None => {}
    }
    let mut outs = outs?;
    let mut program = recording.finish(key, &outs);
    let ops = program.op_count();
    let removed = eliminate_dead_code(&mut program);
    let fusion = fuse_elementwise(&mut program);
    prebuild_kernels(&program).map_err(CompileError::from)?;
    let live = liveness(&program);
    let arena = plan_arena(&live);
    let report = CompileReport {
        ops,
        kernels: program.kernel_count(),
        boxings: program.boxing_count(),
        removed,
        fusion,
        arena_bytes: arena.bytes,
        external_bytes: program.external_bytes(),
        eager_peak,
        compile_time: Duration::ZERO,
        recompiled_because: reason,
    };
    let mut compiled = Compiled {
        program,
        live,
        arena,
        report,
        memory: Mutex::new(None),
        graph: Mutex::new(GraphState::default()),
        note: Mutex::new(None),
        counts: Mutex::new(ReplayCounts::default()),
        graph_built_in: Mutex::new(None),
    };
    // The capture may have computed provisional values while kernels the replays run were
    // made ready (see `CaptureSink::replaces_device_values`). Every rank of a device program
    // replays alike.
    if replays {
        drop(std::mem::take(&mut outs));
        outs = compiled.replay(inputs)?;
    }
    compiled.report.compile_time = started.elapsed();
    Ok((outs, compiled))
}
