//! The launches of `cp.cu`, context attention's glue around the fused attention calls: heads
//! repeated, partial outputs merged by their log-sum-exps, per-head gradients summed into their
//! groups, f32 accumulators stored, log-sum-exp rows copied, buffers filled; 32-bit indices.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;
use oxiflow_cuda::kernel_layer::grid;
use oxiflow_cuda::{device_error, launched, CudaRuntime, CudaSource, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::Result;

/// The kernels of `cp.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CpKernel {
    /// Rows of a block with each head repeated.
    Gather(DType),
    /// A partial output into the accumulator.
    Merge(DType),
    /// Per-query-head gradients summed into their group's f32 accumulator.
    AddGroups(DType),
    /// An f32 accumulator into an output.
    Store(DType),
    /// A partial log-sum-exp into the running one.
    MergeLse,
    /// Rows of the log-sum-exps, made contiguous.
    LseRows,
    /// An f32 buffer set to one value.
    Fill,
}

oxiflow_cuda::kernel_ids!(CpKernel {
    [F32, BF16, F16] {
        Gather => "cp_gather_rows",
        Merge => "cp_merge",
        AddGroups => "cp_add_groups",
        Store => "cp_store",
    },
    MergeLse => "cp_merge_lse",
    LseRows => "cp_lse_rows",
    Fill => "cp_fill",
});

static SOURCE: CudaSource<CpKernel> = CudaSource::new("context_parallel", include_str!("cp.cu"));

/// The launches of `cp.cu` for one call of element type `dt`.
pub(super) struct Glue<'a> {
    pub rt: &'a Arc<CudaRuntime>,
    pub name: &'static str,
    pub dt: DType,
}

impl Glue<'_> {
    /// Launches `k` over `count` threads with pointer arguments `ptrs`, then `float` (when
    /// given), then the `ints` as i64.
    fn launch(
        &self,
        k: CpKernel,
        count: usize,
        ptrs: &[u64],
        float: Option<f32>,
        ints: &[usize],
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        // The kernels index in 32 bits, with room for the grid's stride.
        if count > (u32::MAX / 2) as usize {
            return Err(device_error(
                self.name,
                format!("{k:?} over {count} elements (at most 2^31)"),
            ));
        }
        let f = SOURCE.function(self.rt, self.name, k)?;
        let ints: Vec<i64> = ints.iter().map(|&x| x as i64).collect();
        let mut l = self.rt.launcher(self.name, f)?;
        for p in ptrs {
            l.arg(p);
        }
        if let Some(x) = &float {
            l.arg(x);
        }
        for x in &ints {
            l.arg(x);
        }
        // SAFETY: each `cp.cu` kernel takes its pointers, then (cp_fill) a float, then i64
        // sizes, in the order the callers below pass them; every pointer is a live input,
        // output or scratch region covering the elements those sizes index (the layouts above
        // and the shapes checked before any launch), held by the executor past the launch.
        launched(self.name, unsafe { l.launch(grid(count)) })
    }

    /// `dst [b, rows, g rep, e]` <- rows `row0 ..` of `src [b, src_t, g, e]`, heads repeated.
    pub(super) fn gather(
        &self,
        (src, dst): (u64, u64),
        [b, rows, src_t, row0, g, rep, e]: [usize; 7],
    ) -> Result<()> {
        let n = b * rows * g * rep * e;
        let ints = [b, rows, src_t, row0, g, rep, e];
        self.launch(CpKernel::Gather(self.dt), n, &[src, dst], None, &ints)
    }

    /// Partial `(o, lse)` of `n` query rows into the accumulator `acc` `[b, t, h, e]` and the
    /// running log-sum-exps `lacc` at rows `row0 ..`.
    pub(super) fn merge(
        &self,
        (o, lse): (u64, u64),
        (acc, lacc): (u64, u64),
        [b, n, t, row0, h, e]: [usize; 6],
    ) -> Result<()> {
        let ints = [b, n, t, row0, h, e];
        self.launch(
            CpKernel::Merge(self.dt),
            b * n * h * e,
            &[o, lse, acc, lacc],
            None,
            &ints,
        )?;
        let ints = [b * h, n, t, row0];
        self.launch(CpKernel::MergeLse, b * h * n, &[lse, lacc], None, &ints)
    }

    /// `dst` f32 `[b, dst_t, g, e]` at rows `row0 ..` += `src [b, rows, g rep, e]` summed over
    /// each head's copies.
    pub(super) fn add_groups(
        &self,
        (src, dst): (u64, u64),
        [b, rows, dst_t, row0, g, rep, e]: [usize; 7],
    ) -> Result<()> {
        let ints = [b, rows, dst_t, row0, g, rep, e];
        self.launch(
            CpKernel::AddGroups(self.dt),
            b * rows * g * e,
            &[src, dst],
            None,
            &ints,
        )
    }

    /// `n` f32 values of `src` into `dst` of the call's type.
    pub(super) fn store(&self, src: u64, dst: &CudaStorage, n: usize) -> Result<()> {
        self.launch(CpKernel::Store(self.dt), n, &[src, dst.ptr()], None, &[n])
    }

    /// `dst [bh, n]` <- rows `row0 ..` of `src [bh, t]` (f32).
    pub(super) fn lse_rows(
        &self,
        (src, dst): (u64, u64),
        [bh, n, t, row0]: [usize; 4],
    ) -> Result<()> {
        self.launch(
            CpKernel::LseRows,
            bh * n,
            &[src, dst],
            None,
            &[bh, n, t, row0],
        )
    }

    /// `n` f32 values at `p` set to `v`.
    pub(super) fn fill(&self, p: u64, v: f32, n: usize) -> Result<()> {
        self.launch(CpKernel::Fill, n, &[p], Some(v), &[n])
    }
}
