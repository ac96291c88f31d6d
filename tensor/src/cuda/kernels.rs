//! The NVRTC kernels (`source.cu`): compiled once per process, looked up by name, launched on
//! the compute stream; the `Nd` shape/stride parameter block; the device Philox generator.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DeviceRepr, LaunchConfig};
use oxiflow_collectives::cuda_libs::{self, LibSearch};
use oxiflow_collectives::DType;

use super::{derr, runtime, Block};
use crate::Result;

/// The kernel source, compiled at run time.
pub(crate) const SOURCE: &str = include_str!("source.cu");

/// Most dims a strided kernel handles (more are collapsed first, or refused).
pub(crate) const MAXD: usize = 8;

/// Shape and two stride vectors, passed by value (matches `struct Nd` in the source).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Nd {
    pub ndim: i32,
    pub pad: i32,
    pub shape: [i64; MAXD],
    pub s0: [i64; MAXD],
    pub s1: [i64; MAXD],
}
// SAFETY: plain old data with the C layout the kernels expect.
unsafe impl DeviceRepr for Nd {}

impl Nd {
    /// Builds the block, collapsing dims of size 1 and adjacent dims that are contiguous in
    /// both stride vectors. None when more than `MAXD` dims remain.
    pub(crate) fn new(shape: &[usize], s0: &[i64], s1: &[i64]) -> Option<Nd> {
        let mut dims: Vec<(i64, i64, i64)> = Vec::new();
        for i in 0..shape.len() {
            let n = shape[i] as i64;
            if n == 1 {
                continue;
            }
            if let Some(last) = dims.last_mut() {
                if last.1 == s0[i] * n && last.2 == s1[i] * n {
                    *last = (last.0 * n, s0[i], s1[i]);
                    continue;
                }
            }
            dims.push((n, s0[i], s1[i]));
        }
        if dims.len() > MAXD {
            return None;
        }
        let mut p = Nd {
            ndim: dims.len() as i32,
            ..Nd::default()
        };
        for (i, (n, a, b)) in dims.into_iter().enumerate() {
            p.shape[i] = n;
            p.s0[i] = a;
            p.s1[i] = b;
        }
        Some(p)
    }
}

/// Row-major strides of `shape`.
pub(crate) fn strides(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc *= shape[i] as i64;
    }
    s
}

/// The kernels' name suffix of a dtype.
pub(crate) fn sfx(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I64 => "i64",
    }
}

/// A grid-stride launch over `n` items.
pub(crate) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65535 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// 256-thread blocks over `batch` x `rows` runs of `run` items: x along a run (a warp
/// multiple, at most 256), y across rows, z across batches; grid-stride in all three.
pub(crate) fn rows_grid(batch: usize, rows: usize, run: usize) -> LaunchConfig {
    let bx = run.div_ceil(32).clamp(1, 8) * 32;
    let by = 256 / bx;
    LaunchConfig {
        grid_dim: (
            run.div_ceil(bx).clamp(1, 1024) as u32,
            rows.div_ceil(by).clamp(1, 65535) as u32,
            batch.clamp(1, 65535) as u32,
        ),
        block_dim: (bx as u32, by as u32, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of 256 threads per row (grid-stride over rows).
pub(crate) fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 65535 * 4) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches kernel `$name` of runtime `$rt` with config `$cfg` and the argument variables.
macro_rules! launch {
    ($rt:expr, $op:expr, $name:expr, $cfg:expr; $($a:ident),* $(,)?) => {{
        let f = $rt.kernels($op)?.get($op, &$name)?;
        $rt.bind($op)?;
        use cudarc::driver::PushKernelArg as _;
        let mut b = $rt.stream().launch_builder(f);
        $( b.arg(&$a); )*
        // SAFETY: arguments match the kernel's signature in source.cu; pointers are live
        // device allocations of the sizes the kernel indexes.
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(|e| $crate::cuda::derr($op, format!("launch of {}: {e}", $name)))
    }};
}
pub(crate) use launch;

/// Every kernel of the source, by name.
pub(crate) struct Kernels {
    funcs: HashMap<String, CudaFunction>,
    _module: Arc<CudaModule>,
}

fn names() -> Vec<String> {
    let mut v = Vec::new();
    for t in ["f32", "f64"] {
        for k in [
            "unary_bw",
            "softmax",
            "softmax_bw",
            "layer_norm",
            "layer_norm_bw",
            "cross_entropy",
            "cross_entropy_bw",
            "put",
            "rotary",
            "unary",
            "scalar",
            "dropout",
            "attn_softmax",
            "adam",
        ] {
            v.push(format!("{k}_{t}"));
        }
    }
    for t in ["f32", "f64", "i64"] {
        for k in [
            "binary",
            "copy_nd",
            "copy_rows",
            "fill",
            "create",
            "reduce_rows",
            "reduce_cols",
            "take",
            "where",
            "triangular",
        ] {
            v.push(format!("{k}_{t}"));
        }
    }
    for k in [
        "unary_i64",
        "scalar_i64",
        "matmul_i64",
        "philox",
        "copy_rows_v16",
        "f32_to_bf16",
        "attn_softmax_bf16",
        "softmax_bw_rows_bf16",
    ] {
        v.push(k.to_string());
    }
    for (a, b) in [
        ("f32", "f64"),
        ("f32", "i64"),
        ("f64", "f32"),
        ("f64", "i64"),
        ("i64", "f32"),
        ("i64", "f64"),
    ] {
        v.push(format!("cast_{a}_{b}"));
    }
    v
}

impl Kernels {
    pub(crate) fn compile(ctx: &Arc<CudaContext>) -> std::result::Result<Kernels, String> {
        let libs = LibSearch::default();
        cuda_libs::ensure_nvrtc(&libs).map_err(|e| e.to_string())?;
        let ptx = cudarc::nvrtc::compile_ptx(SOURCE).map_err(|e| format!("NVRTC: {e}"))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| format!("loading the kernel module: {e}"))?;
        let mut funcs = HashMap::new();
        for n in names() {
            let f = module
                .load_function(&n)
                .map_err(|e| format!("kernel {n}: {e}"))?;
            funcs.insert(n, f);
        }
        Ok(Kernels {
            funcs,
            _module: module,
        })
    }
    pub(crate) fn get(&self, op: &'static str, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| derr(op, format!("no CUDA kernel {name}")))
    }
}

/// Philox4x32-10 words for counters `start..start + n` under `seed` (the device twin of
/// `rng::philox4x32_10` with counter `[i, i >> 32, 0, 0]` and key `[seed, seed >> 32]`).
pub fn philox_words_device(seed: u64, start: u64, n: usize) -> Result<Vec<[u32; 4]>> {
    let op = "philox";
    let rt = runtime(op)?;
    let blk = Block::alloc(&rt, n.max(1) * 16)?;
    let (nb, c0, c1, c2, c3) = (n as i64, start as u32, (start >> 32) as u32, 0u32, 0u32);
    let (k0, k1, out) = (seed as u32, (seed >> 32) as u32, blk.ptr());
    launch!(rt, op, "philox", grid(n); nb, c0, c1, c2, c3, k0, k1, out)?;
    let mut host = vec![0u32; n * 4];
    super::storage::download(&rt, blk.ptr(), &mut host, op)?;
    Ok(host.chunks(4).map(|c| [c[0], c[1], c[2], c[3]]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nd_collapses_contiguous_dims() {
        let s = strides(&[4, 3, 5]);
        let p = Nd::new(&[4, 3, 5], &s, &s).unwrap();
        assert_eq!(p.ndim, 1);
        assert_eq!(p.shape[0], 60);
        // A column block [4, 2] of a [4, 5] array, packed contiguously.
        let p = Nd::new(&[4, 2], &[5, 1], &strides(&[4, 2])).unwrap();
        assert_eq!((p.ndim, p.shape[0], p.shape[1]), (2, 4, 2));
        assert!(Nd::new(&[2; 9], &[1, 0, 1, 0, 1, 0, 1, 0, 1], &[0; 9]).is_none());
    }

    #[test]
    fn every_kernel_name_is_in_the_source() {
        for n in names() {
            let suffix = n.rsplit('_').next().unwrap_or("");
            let direct = SOURCE.contains(&format!("void {n}("));
            let via_macro = ["f32", "f64", "i64"].contains(&suffix);
            assert!(direct || via_macro, "{n}");
        }
    }
}
