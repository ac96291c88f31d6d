//! Flash attention without cuDNN (`flash_attention.cu`): the fallback of the fused attention,
//! with the same inputs and outputs (O and the f32 log-sum-exp `[B, H, T]`; dQ, dK, dV), for
//! f32, bf16 and f16 operands, never materialising `[B, H, T, T]`. Every kernel computes in
//! f32 and is deterministic. One NVRTC module per element type, compiled on first use.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::library_sources::FLASH_ATTENTION;
use super::nvrtc_module::{self, launch_fn, module, Module};
use super::raw::{AttentionBackward, AttentionForward, AttentionShape, Bhtd, FResult, FloatType};
use super::{Block, CudaRuntime};

/// Rows of a block (4 warps x 4 rows) and its threads (as in the source).
const BR: usize = 16;
const THREADS: u32 = 128;
/// Shared memory a block may use without opting in (floats).
const SMEM_FLOATS: usize = 12 * 1024;

/// `struct Dims` of the source.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: i32,
    h: i32,
    t: i32,
    d: i32,
    tile: i32,
    causal: i32,
    scale: f32,
    pad: i32,
}
// SAFETY: plain old data with the C layout of `struct Dims`.
unsafe impl DeviceRepr for Dims {}

/// `struct View` of the source.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct View {
    ptr: u64,
    s: [i64; 4],
}
// SAFETY: plain old data with the C layout of `struct View`.
unsafe impl DeviceRepr for View {}

fn view(v: &Bhtd) -> View {
    View {
        ptr: v.ptr,
        s: v.strides,
    }
}

static MODULES: [OnceLock<Result<Module, String>>; 3] =
    [OnceLock::new(), OnceLock::new(), OnceLock::new()];

/// The slot of `t`'s module in [`MODULES`] (and its source in `FLASH_ATTENTION`).
fn slot(t: FloatType) -> usize {
    match t {
        FloatType::F32 => 0,
        FloatType::Bf16 => 1,
        FloatType::F16 => 2,
    }
}

fn kernels(rt: &CudaRuntime, op: &'static str, t: FloatType) -> FResult<&'static Module> {
    let i = slot(t);
    let n = t.suffix();
    module(&MODULES[i], rt.context(), op, &FLASH_ATTENTION[i], || {
        let mut v = vec![format!("flash_dsum_{n}")];
        for p in [2, 4, 8] {
            for k in ["fwd", "dkdv", "dq"] {
                v.push(format!("flash_{k}_{n}_{p}"));
            }
        }
        v
    })
}

/// Whether the kernels for `t` are loaded or load from the binary, without compiling.
pub(crate) fn loads_at_once(rt: &CudaRuntime, t: FloatType) -> bool {
    let i = slot(t);
    nvrtc_module::loads_at_once(&MODULES[i], rt.context(), &FLASH_ATTENTION[i])
}

/// Head-dim elements per lane of the instantiation serving `d`.
fn per_lane(d: usize) -> usize {
    match d {
        0..=64 => 2,
        65..=128 => 4,
        _ => 8,
    }
}

fn dims(s: &AttentionShape, tile: usize) -> Dims {
    Dims {
        b: s.batch as i32,
        h: s.heads as i32,
        t: s.seq as i32,
        d: s.head_dim as i32,
        tile: tile as i32,
        causal: s.causal as i32,
        scale: s.scale,
        pad: 0,
    }
}

/// A tile of at most 64 rows such that `fixed + tile * per_row` floats fit in shared memory.
fn tile(fixed: usize, per_row: usize) -> usize {
    (SMEM_FLOATS.saturating_sub(fixed) / per_row).clamp(1, 64)
}

fn grid(s: &AttentionShape, smem_floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((s.batch * s.heads) as u32, s.seq.div_ceil(BR) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (smem_floats * 4) as u32,
    }
}

/// The shape of a call that passed its own check (`checked`) and fits the launch grid, and the
/// kernels of its element type.
fn prepare(
    rt: &CudaRuntime,
    op: &'static str,
    checked: FResult<()>,
    s: AttentionShape,
) -> FResult<(AttentionShape, &'static Module)> {
    checked?;
    if s.batch * s.heads > i32::MAX as usize || s.seq.div_ceil(BR) > 65535 {
        return Err(super::raw::invalid(
            op,
            format!(
                "{} x {} heads of {} rows exceed the launch grid",
                s.batch, s.heads, s.seq
            ),
        ));
    }
    Ok((s, kernels(rt, op, s.dtype)?))
}

/// The fused attention forward (O and the log-sum-exp) without cuDNN.
pub fn forward(rt: &Arc<CudaRuntime>, a: &AttentionForward) -> FResult<()> {
    let op = "flash attention forward";
    let (s, m) = prepare(rt, op, a.check(op), a.shape)?;
    let d = s.head_dim;
    let bc = tile(BR * d, 2 * d + 1);
    let smem = BR * d + bc * (2 * d + 1);
    let f = m.get(
        op,
        &format!("flash_fwd_{}_{}", s.dtype.suffix(), per_lane(d)),
    )?;
    let (z, q, k, v, o, lse) = (
        dims(&s, bc),
        view(&a.q),
        view(&a.k),
        view(&a.v),
        view(&a.o),
        a.lse,
    );
    launch_fn!(rt, op, f, grid(&s, smem); z, q, k, v, o, lse)
}

/// The fused attention backward (dQ, dK, dV) without cuDNN; always deterministic.
pub fn backward(rt: &Arc<CudaRuntime>, a: &AttentionBackward) -> FResult<()> {
    let op = "flash attention backward";
    let (s, m) = prepare(rt, op, a.check(op), a.shape)?;
    let d = s.head_dim;
    let n = s.dtype.suffix();
    let rows = s.batch * s.heads * s.seq;
    let dsum_block = Block::alloc(rt, rows * 4)?;
    let dsum = dsum_block.ptr();
    let (q, k, v, o, d_o) = (view(&a.q), view(&a.k), view(&a.v), view(&a.o), view(&a.d_o));
    let (dq, dk, dv, lse) = (view(&a.dq), view(&a.dk), view(&a.dv), a.lse);

    let f = m.get(op, &format!("flash_dsum_{n}"))?;
    let z = dims(&s, 0);
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(8).min(65535 * 4) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_fn!(rt, op, f, cfg; z, o, d_o, dsum)?;

    // dK, dV: key rows per block, query tiles of bq rows (Q and dO padded, lse and dsum).
    let bq = tile(2 * BR * d, 2 * (d + 1) + 2);
    let smem = 2 * BR * d + bq * (2 * (d + 1) + 2);
    let f = m.get(op, &format!("flash_dkdv_{n}_{}", per_lane(d)))?;
    let z = dims(&s, bq);
    launch_fn!(rt, op, f, grid(&s, smem); z, q, k, v, d_o, lse, dsum, dk, dv)?;

    // dQ: query rows per block, key tiles of bc rows (K and V padded).
    let bc = tile(2 * BR * d, 2 * (d + 1));
    let smem = 2 * BR * d + bc * 2 * (d + 1);
    let f = m.get(op, &format!("flash_dq_{n}_{}", per_lane(d)))?;
    let z = dims(&s, bc);
    launch_fn!(rt, op, f, grid(&s, smem); z, q, k, v, d_o, lse, dsum, dq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_shared_memory() {
        for d in [8, 32, 64, 80, 128, 200, 256] {
            let bc = tile(BR * d, 2 * d + 1);
            assert!(BR * d + bc * (2 * d + 1) <= SMEM_FLOATS, "fwd d {d}");
            let bq = tile(2 * BR * d, 2 * (d + 1) + 2);
            assert!(
                2 * BR * d + bq * (2 * (d + 1) + 2) <= SMEM_FLOATS,
                "dkdv d {d}"
            );
            assert!((1..=64).contains(&bc) && (1..=64).contains(&bq));
            assert!(per_lane(d) * 32 >= d);
        }
    }
}
