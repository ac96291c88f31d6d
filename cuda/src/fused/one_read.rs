//! The classifier that reads each row once (`classifier_one_read.cu`, its own NVRTC source built
//! beside the fused one): which launch a row gets (vectors a thread, threads, shared memory), and
//! the kernels' registers and occupancy as the device reports them.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::CudaFunction;

use crate::library_sources::ONE_READ_CLASSIFIER;
use crate::nvrtc_module::{module, Module};
use crate::raw::{aligned, invalid, Classifier, FResult, FloatType, FusedError, SMEM_BYTES};
use crate::CudaRuntime;

static ONE_READ_MODULE: OnceLock<Result<Module, String>> = OnceLock::new();

/// The one-read kernels' names.
fn one_read_names() -> Vec<String> {
    FloatType::ALL
        .into_iter()
        .flat_map(|t| CLASSIFIER_ROW_VECTORS.map(|r| format!("classifier_reg{r}_{}", t.suffix())))
        .collect()
}

/// The one-read module, and the dynamic shared memory its kernels may use a block: the device's
/// opt-in limit, granted to every kernel once when the module is first asked for (outside any
/// graph capture: the start-up build asks), or 48 KiB where that fails.
fn one_read_kernels(rt: &CudaRuntime, op: &'static str) -> FResult<(&'static Module, usize)> {
    static GRANTED: OnceLock<usize> = OnceLock::new();
    let m = module(
        &ONE_READ_MODULE,
        rt.context(),
        op,
        &ONE_READ_CLASSIFIER,
        one_read_names,
    )?;
    let base = SMEM_BYTES - CLASSIFIER_STATIC_SMEM;
    let granted = *GRANTED.get_or_init(|| {
        let optin = rt
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_or(0, |n| {
                (n.max(0) as usize).saturating_sub(CLASSIFIER_STATIC_SMEM)
            });
        let grant = |name: &String| {
            m.get(op, name).is_ok_and(|f| {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    optin as i32,
                )
                .is_ok()
            })
        };
        if optin > base && rt.bind(op).is_ok() && one_read_names().iter().all(grant) {
            optin
        } else {
            base
        }
    });
    Ok((m, granted))
}

/// The classifier kernels that read each row once are built for `V` 16-byte vectors per thread
/// for each V here, in blocks of at most [`CLASSIFIER_MAX_BLOCK`] threads (at V = 8 and 1024
/// threads the kernel uses the whole register file, 64 registers a thread).
const CLASSIFIER_ROW_VECTORS: [usize; 4] = [1, 2, 4, 8];
const CLASSIFIER_MAX_BLOCK: usize = 1024;
/// Shared memory the one-read kernels declare themselves (the block reductions' 256 bytes),
/// with room.
const CLASSIFIER_STATIC_SMEM: usize = 1024;
/// Dynamic shared memory of a block that leaves room for a second one on a Hopper
/// multiprocessor (228 KiB, 1 KiB of it reserved per block).
const TWO_BLOCKS_SMEM: usize = 112 * 1024 - CLASSIFIER_STATIC_SMEM;

/// A launch of the one-read classifier: `v` 16-byte vectors a thread in registers, `block`
/// threads, and `smem` bytes of shared memory for the rest of the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowPlan {
    pub v: usize,
    pub block: usize,
    pub smem: usize,
}

/// The one-read launch for rows of stride `ld` of `t`, with at most `smem_limit` bytes of
/// dynamic shared memory a block: the smallest built V whose row fits the registers of one
/// block (threads rounded up to a warp), except that a row needing 4 or more takes one vector
/// a thread in 1024 threads and the rest in shared memory where two such blocks fit a
/// multiprocessor; else the widest V in 1024 threads with the rest of the row in shared
/// memory; None where `ld` is not a whole number of vectors or the row fits neither.
pub(crate) fn row_plan(ld: usize, t: FloatType, smem_limit: usize) -> Option<RowPlan> {
    let per = 16 / t.size();
    if ld == 0 || !ld.is_multiple_of(per) {
        return None;
    }
    let nv = ld / per;
    if let Some(v) = CLASSIFIER_ROW_VECTORS
        .into_iter()
        .find(|&v| nv <= v * CLASSIFIER_MAX_BLOCK)
    {
        // Rows needing 4 or more vectors a thread hold one block a multiprocessor; one
        // vector a thread with the rest in shared memory holds two where that fits, and
        // runs faster (GPT-2's bf16 rows: 0.93 ms against 1.11 ms for 8192 rows on an H100).
        let tail = nv.saturating_sub(CLASSIFIER_MAX_BLOCK) * 16;
        if v >= 4 && tail <= TWO_BLOCKS_SMEM.min(smem_limit) {
            return Some(RowPlan {
                v: 1,
                block: CLASSIFIER_MAX_BLOCK,
                smem: tail,
            });
        }
        let block = nv.div_ceil(v).next_multiple_of(32);
        return Some(RowPlan { v, block, smem: 0 });
    }
    let v = CLASSIFIER_ROW_VECTORS[CLASSIFIER_ROW_VECTORS.len() - 1];
    let smem = (nv - v * CLASSIFIER_MAX_BLOCK) * 16;
    (smem <= smem_limit).then_some(RowPlan {
        v,
        block: CLASSIFIER_MAX_BLOCK,
        smem,
    })
}

/// Dynamic shared memory a one-read classifier block may use.
pub(super) fn classifier_smem_limit(rt: &CudaRuntime) -> FResult<usize> {
    Ok(one_read_kernels(rt, "fused classifier")?.1)
}

/// The one-read kernel of `plan` for `dtype`.
pub(super) fn one_read_fn(
    rt: &CudaRuntime,
    plan: &RowPlan,
    dtype: FloatType,
) -> FResult<&'static CudaFunction> {
    let op = "fused classifier";
    let name = format!("classifier_reg{}_{}", plan.v, dtype.suffix());
    one_read_kernels(rt, op)?.0.get(op, &name)
}

/// Blocks of `plan`'s kernel `f` resident on a multiprocessor, asked of the driver once per
/// plan (1 where it cannot say).
pub(super) fn resident_blocks(f: &CudaFunction, plan: &RowPlan, dtype: FloatType) -> usize {
    type Key = (usize, usize, usize, &'static str);
    static KNOWN: Mutex<Vec<(Key, usize)>> = Mutex::new(Vec::new());
    let key = (plan.v, plan.block, plan.smem, dtype.suffix());
    let mut known = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, n)) = known.iter().find(|(k, _)| *k == key) {
        return *n;
    }
    let n = f
        .occupancy_max_active_blocks_per_multiprocessor(plan.block as u32, plan.smem, None)
        .map_or(1, |n| n.max(1) as usize);
    known.push((key, n));
    n
}

/// What the device made of the one-read kernel of `plan` for `dtype`: registers a thread, local
/// (spilled) bytes a thread, and blocks resident on a multiprocessor.
pub fn row_plan_occupancy(
    rt: &Arc<CudaRuntime>,
    plan: &RowPlan,
    dtype: FloatType,
) -> FResult<String> {
    let op = "fused classifier";
    let f = one_read_fn(rt, plan, dtype)?;
    rt.bind(op)?;
    let e = |e: cudarc::driver::DriverError| invalid(op, e.to_string());
    let regs = f.num_regs().map_err(e)?;
    let local = f.local_size_bytes().map_err(e)?;
    let blocks = f
        .occupancy_max_active_blocks_per_multiprocessor(plan.block as u32, plan.smem, None)
        .map_err(e)?;
    Ok(format!("{regs} regs, {local} B local, {blocks} blocks/SM"))
}

/// The one-read launch of `v` vectors a thread in `block` threads for `a`, or why it cannot run.
pub(super) fn forced_plan(
    rt: &CudaRuntime,
    a: &Classifier,
    v: usize,
    block: usize,
) -> FResult<RowPlan> {
    let op = "fused classifier";
    let per = 16 / a.dtype.size();
    let dx = a.dlogits.unwrap_or(a.logits);
    let nv = a.ld / per;
    let smem = nv.saturating_sub(v * block) * 16;
    if !CLASSIFIER_ROW_VECTORS.contains(&v)
        || !block.is_multiple_of(32)
        || !(32..=CLASSIFIER_MAX_BLOCK).contains(&block)
        || !a.ld.is_multiple_of(per)
        || !aligned(&[a.logits, dx])
        || smem > classifier_smem_limit(rt)?
    {
        return Err(FusedError::Unsupported {
            op,
            detail: format!(
                "the one-read kernel with {v} vectors a thread in blocks of {block} for rows of {} {} (stride {}, {smem} bytes of shared memory)",
                a.v,
                a.dtype.suffix(),
                a.ld
            ),
        });
    }
    Ok(RowPlan { v, block, smem })
}

/// Builds the one-read classifier module now (from `build_times::start_background_builds`).
pub(crate) fn build_one_read_module(rt: &CudaRuntime) {
    let _ = one_read_kernels(rt, "background kernel build");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifier_row_plans() {
        let limit = 227 * 1024 - CLASSIFIER_STATIC_SMEM;
        let plan = |v, block, smem| Some(RowPlan { v, block, smem });
        // GPT-2's padded vocabulary: 6288 bf16 vectors, 1024 in registers and the rest in
        // shared memory (two blocks a multiprocessor); 12576 f32 vectors, 8192 in registers
        // and the rest in shared memory.
        assert_eq!(
            row_plan(50304, FloatType::Bf16, limit),
            plan(1, 1024, 5264 * 16)
        );
        assert_eq!(
            row_plan(50304, FloatType::F16, limit),
            plan(1, 1024, 5264 * 16)
        );
        // Two blocks' shared memory over the limit given: registers.
        assert_eq!(row_plan(50304, FloatType::Bf16, 48 * 1024), plan(8, 800, 0));
        assert_eq!(
            row_plan(50304, FloatType::F32, limit),
            plan(8, 1024, 4384 * 16)
        );
        assert_eq!(row_plan(8, FloatType::Bf16, limit), plan(1, 32, 0));
        assert_eq!(row_plan(1040, FloatType::F32, limit), plan(1, 288, 0));
        assert_eq!(row_plan(8200, FloatType::Bf16, limit), plan(2, 544, 0));
        assert_eq!(
            row_plan(32000, FloatType::Bf16, limit),
            plan(1, 1024, 2976 * 16)
        );
        assert_eq!(row_plan(65536, FloatType::Bf16, limit), plan(8, 1024, 0));
        assert_eq!(
            row_plan(100000, FloatType::Bf16, limit),
            plan(8, 1024, 4308 * 16)
        );
        // Not whole vectors, too wide, or more shared memory than allowed: two-pass.
        assert_eq!(row_plan(999, FloatType::Bf16, limit), None);
        assert_eq!(row_plan(1002, FloatType::F32, limit), None);
        assert_eq!(row_plan(8 * 24576, FloatType::Bf16, limit), None);
        assert_eq!(row_plan(50304, FloatType::F32, 48 * 1024), None);
    }
}
