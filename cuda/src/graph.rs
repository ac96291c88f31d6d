//! CUDA graphs: the work a closure queues on the runtime's compute stream (and the NCCL
//! streams its collectives fork from it) captured once as one graph and launched as one unit.
//! The capture runs the closure with nothing executing: the pool keeps the graph's memory
//! apart while it runs (see `alloc`), the compute stream joins every collective captured
//! before the capture ends, and the graph is instantiated and uploaded. A capture is refused,
//! before anything is queued, while ops are timed or traced (both read events on the host).

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use oxiflow_collectives::trace;

use super::alloc::GraphMemory;
use super::{derr, runtime, CudaRuntime};
use oxiflow_tensor::DeviceGraph;
use oxiflow_tensor::Result;

/// One captured graph, the memory it keeps and its node count.
pub(crate) struct CudaGraphRun {
    graph: Mutex<CudaGraph>,
    memory: Arc<GraphMemory>,
    rt: Arc<CudaRuntime>,
    nodes: usize,
}

// SAFETY: the graph's handles are used by one thread at a time (the mutex around them); CUDA
// graph objects may be used from any thread when calls on one object are serialised.
unsafe impl Send for CudaGraphRun {}
// SAFETY: as above: every use of the graph goes through its mutex.
unsafe impl Sync for CudaGraphRun {}

impl DeviceGraph for CudaGraphRun {
    fn launch(&self) -> Result<()> {
        let g = self.graph.lock().unwrap_or_else(|p| p.into_inner());
        g.launch()
            .map_err(|e| derr("graph launch", format!("cuda:{}: {e}", self.rt.ordinal())))
    }
    fn nodes(&self) -> usize {
        self.nodes
    }
    fn kept_bytes(&self) -> usize {
        self.memory.kept_bytes()
    }
}

impl Drop for CudaGraphRun {
    fn drop(&mut self) {
        self.rt
            .pool
            .release_graph(&self.memory, &self.rt.ctx, &self.rt.stream);
    }
}

/// Why the compute stream cannot be captured now, if it cannot.
pub(crate) fn refusal() -> Option<&'static str> {
    if super::timing::timing_on() {
        return Some("ops are timed one by one (a synchronisation around each)");
    }
    if trace::trace_enabled() {
        return Some("the trace times each op with events read on the host");
    }
    None
}

/// Captures what `f` queues on the compute stream of device `ordinal` (see the module doc).
pub(crate) fn capture(
    ordinal: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<Box<dyn DeviceGraph>> {
    let op = "graph capture";
    let rt = runtime(op)?;
    if rt.ordinal() != ordinal {
        return Err(derr(
            op,
            format!(
                "cuda:{ordinal} is not this process's device (cuda:{})",
                rt.ordinal()
            ),
        ));
    }
    if let Some(why) = refusal() {
        return Err(derr(op, format!("not captured: {why}")));
    }
    // A background cuDNN plan's warm-up orders the compute stream after its own stream: done
    // before the capture begins.
    super::cudnn_attention::wait_for_background_plans();
    rt.bind(op)?;
    let memory = rt
        .pool
        .begin_capture()
        .ok_or_else(|| derr(op, "another capture runs on this device"))?;
    // Relaxed: the pool's `cuMemAlloc` during the capture is not a stream operation.
    if let Err(e) = rt
        .stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
    {
        rt.pool.end_capture(&memory, false, &rt.ctx, &rt.stream);
        return Err(derr(op, format!("begin: {e}")));
    }
    let ran = f();
    // The collectives captured end in the graph: the compute stream waits for each.
    let mut joined = Ok(());
    for ev in memory.take_events() {
        if let Err(e) = rt.stream.wait(&ev) {
            joined = Err(e);
        }
    }
    let ended = rt.stream.end_capture(CUgraphInstantiate_flags(0));
    let graph = match (ran, joined, ended) {
        (Ok(()), Ok(()), Ok(Some(g))) => g,
        (ran, joined, ended) => {
            rt.pool.end_capture(&memory, false, &rt.ctx, &rt.stream);
            return Err(match (ran, joined, ended) {
                (Err(e), _, _) => e,
                (_, Err(e), _) => derr(op, format!("joining the captured collectives: {e}")),
                (_, _, Err(e)) => derr(op, format!("end: {e}")),
                _ => derr(op, "the capture gave no graph"),
            });
        }
    };
    rt.pool.end_capture(&memory, true, &rt.ctx, &rt.stream);
    let mut nodes = 0usize;
    // SAFETY: the graph handle is owned by `graph` and outlives the call; a null node array
    // asks only for the count.
    let counted = unsafe {
        cudarc::driver::sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes)
    };
    if counted != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        nodes = 0;
    }
    graph
        .upload()
        .map_err(|e| derr(op, format!("upload: {e}")))?;
    Ok(Box::new(CudaGraphRun {
        graph: Mutex::new(graph),
        memory,
        rt,
        nodes,
    }))
}
