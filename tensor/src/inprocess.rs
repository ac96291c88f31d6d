//! Runs N ranks as threads of this process, each with its own installed `Context` over the
//! in-process communicator: the harness of the tests, the benchmark and examples.

use std::time::Duration;

use oxiflow_collectives::InProcessWorld;

use crate::context::Context;

/// Runs `f(rank)` on `n` threads, rank r with a context over member r of an in-process world
/// whose collectives give up after `timeout`. Returns the results in rank order; a rank that
/// panicked re-raises its panic here after all threads finished.
pub fn run_ranks<R: Send>(n: usize, timeout: Duration, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let comms = InProcessWorld::new(n, timeout);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    crate::op_trace::install();
                    let ctx = Context::new(comm);
                    let _guard = ctx.install();
                    f(rank)
                })
            })
            .collect();
        let results: Vec<std::thread::Result<R>> = handles.into_iter().map(|h| h.join()).collect();
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}
