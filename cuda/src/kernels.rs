//! The NVRTC kernels (`source.cu`): compiled once per process, looked up by name, launched on
//! the compute stream; the `Nd` shape/stride parameter block; the device Philox generator.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DeviceRepr, LaunchConfig};
use oxiflow_dtype::DType;

use super::derr;
use super::library_sources::ELEMENTWISE_PARTS;
use super::nvrtc_module::load_source;
use oxiflow_tensor::Result;

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

/// A grid-stride launch over `n` items.
pub fn grid(n: usize) -> LaunchConfig {
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
pub fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 65535 * 4) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches kernel `$kernel` (a `Kernel` id) of runtime `$rt` with config `$cfg` and the
/// argument variables.
#[macro_export]
macro_rules! launch {
    ($rt:expr, $op:expr, $kernel:expr, $cfg:expr; $($a:ident),* $(,)?) => {{
        let kernel: $crate::kernel_layer::Kernel = $kernel;
        let f = $rt.kernels($op)?.get($op, kernel)?;
        $rt.bind($op)?;
        use cudarc::driver::PushKernelArg as _;
        let mut b = $rt.stream().launch_builder(f);
        $( b.arg(&$a); )*
        let cfg: cudarc::driver::LaunchConfig = $cfg;
        // SAFETY: arguments match the kernel's signature in source.cu; pointers are live
        // device allocations of the sizes the kernel indexes.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| $crate::device_error($op, format!("launch of {kernel}: {e}")))
    }};
}
pub(crate) use launch;

/// The dtypes of the float templates (`INST` in the source) and of the templates for every
/// dtype (`INST_ALL`); 16-bit floats load and store 16 bits and compute in f32.
const FLOATS: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];
const EVERY: &[DType] = &DType::ALL;

/// The kernel templates of the source, each instantiated for some dtypes as
/// `extern "C" <base>_<dtype>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Template {
    Unary,
    UnaryBw,
    Scalar,
    Softmax,
    SoftmaxBw,
    LayerNorm,
    LayerNormBw,
    CrossEntropy,
    CrossEntropyBw,
    VocabLse,
    VocabLoss,
    VocabBw,
    Put,
    Rotary,
    Dropout,
    AttnSoftmax,
    FlashRows,
    FlashRowsBw,
    Adam,
    Binary,
    CopyNd,
    CopyRows,
    Fill,
    Create,
    ReduceRows,
    ReduceCols,
    ReduceMid,
    Take,
    Where,
    Triangular,
}

impl Template {
    const ALL: [Template; 30] = [
        Template::Unary,
        Template::UnaryBw,
        Template::Scalar,
        Template::Softmax,
        Template::SoftmaxBw,
        Template::LayerNorm,
        Template::LayerNormBw,
        Template::CrossEntropy,
        Template::CrossEntropyBw,
        Template::VocabLse,
        Template::VocabLoss,
        Template::VocabBw,
        Template::Put,
        Template::Rotary,
        Template::Dropout,
        Template::AttnSoftmax,
        Template::FlashRows,
        Template::FlashRowsBw,
        Template::Adam,
        Template::Binary,
        Template::CopyNd,
        Template::CopyRows,
        Template::Fill,
        Template::Create,
        Template::ReduceRows,
        Template::ReduceCols,
        Template::ReduceMid,
        Template::Take,
        Template::Where,
        Template::Triangular,
    ];

    /// The name before the dtype suffix.
    pub(crate) fn base(self) -> &'static str {
        match self {
            Template::Unary => "unary",
            Template::UnaryBw => "unary_bw",
            Template::Scalar => "scalar",
            Template::Softmax => "softmax",
            Template::SoftmaxBw => "softmax_bw",
            Template::LayerNorm => "layer_norm",
            Template::LayerNormBw => "layer_norm_bw",
            Template::CrossEntropy => "cross_entropy",
            Template::CrossEntropyBw => "cross_entropy_bw",
            Template::VocabLse => "vp_lse",
            Template::VocabLoss => "vp_loss",
            Template::VocabBw => "vp_bw",
            Template::Put => "put",
            Template::Rotary => "rotary",
            Template::Dropout => "dropout",
            Template::AttnSoftmax => "attn_softmax",
            Template::FlashRows => "flash_rows",
            Template::FlashRowsBw => "flash_rows_bw",
            Template::Adam => "adam",
            Template::Binary => "binary",
            Template::CopyNd => "copy_nd",
            Template::CopyRows => "copy_rows",
            Template::Fill => "fill",
            Template::Create => "create",
            Template::ReduceRows => "reduce_rows",
            Template::ReduceCols => "reduce_cols",
            Template::ReduceMid => "reduce_mid",
            Template::Take => "take",
            Template::Where => "where",
            Template::Triangular => "triangular",
        }
    }

    /// The dtypes the source instantiates the template for. `put` (an atomic scatter-add)
    /// exists for f32 and f64; 16-bit scatter-adds accumulate in an f32 copy.
    pub(crate) fn dtypes(self) -> &'static [DType] {
        match self {
            Template::Put => &[DType::F32, DType::F64],
            Template::Unary | Template::Scalar => EVERY,
            Template::Binary
            | Template::CopyNd
            | Template::CopyRows
            | Template::Fill
            | Template::Create
            | Template::ReduceRows
            | Template::ReduceCols
            | Template::ReduceMid
            | Template::Take
            | Template::Where
            | Template::Triangular => EVERY,
            _ => FLOATS,
        }
    }

    /// The kernel of this template for `dtype`.
    pub fn at(self, dtype: DType) -> Kernel {
        Kernel::Typed(self, dtype)
    }
}

/// One kernel of the source: launch sites name kernels only through this id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// A template at one dtype.
    Typed(Template, DType),
    /// Element-wise conversion between two different dtypes (each value rounded once).
    Cast(DType, DType),
    /// i64 matrix product (cuBLAS covers the floats).
    MatmulI64,
    Philox,
    /// The plain copy of `copy_rows` in 16-byte units.
    CopyRowsV16,
    /// The f32 -> bf16 copy of the bf16 matmul precision.
    F32ToBf16,
    /// f32 attention probabilities with their bf16 copy.
    AttnSoftmaxBf16,
    /// f32 row softmax backward with its bf16 copy.
    SoftmaxBwRowsBf16,
}

impl Kernel {
    /// Every kernel the source defines.
    pub(crate) fn all() -> Vec<Kernel> {
        let mut v: Vec<Kernel> = Template::ALL
            .iter()
            .flat_map(|&t| t.dtypes().iter().map(move |&d| t.at(d)))
            .collect();
        for a in DType::ALL {
            v.extend(
                DType::ALL
                    .into_iter()
                    .filter(|&b| b != a)
                    .map(|b| Kernel::Cast(a, b)),
            );
        }
        v.extend([
            Kernel::MatmulI64,
            Kernel::Philox,
            Kernel::CopyRowsV16,
            Kernel::F32ToBf16,
            Kernel::AttnSoftmaxBf16,
            Kernel::SoftmaxBwRowsBf16,
        ]);
        v
    }

    /// The `extern "C"` name in the source (the one mapping from ids to names).
    pub(crate) fn name(self) -> String {
        match self {
            Kernel::Typed(t, d) => format!("{}_{}", t.base(), d.as_str()),
            Kernel::Cast(a, b) => format!("cast_{}_{}", a.as_str(), b.as_str()),
            Kernel::MatmulI64 => "matmul_i64".into(),
            Kernel::Philox => "philox".into(),
            Kernel::CopyRowsV16 => "copy_rows_v16".into(),
            Kernel::F32ToBf16 => "f32_to_bf16".into(),
            Kernel::AttnSoftmaxBf16 => "attn_softmax_with_bf16_copy".into(),
            Kernel::SoftmaxBwRowsBf16 => "softmax_bw_rows_bf16".into(),
        }
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Every kernel of the source, by id.
pub struct Kernels {
    funcs: HashMap<Kernel, CudaFunction>,
    _modules: Vec<Arc<CudaModule>>,
}

impl Kernels {
    pub(crate) fn compile(ctx: &Arc<CudaContext>) -> std::result::Result<Kernels, String> {
        let built: Vec<std::result::Result<Arc<CudaModule>, String>> = std::thread::scope(|s| {
            let parts: Vec<_> = ELEMENTWISE_PARTS
                .iter()
                .map(|part| s.spawn(move || load_source(ctx, part.what, part.text)))
                .collect();
            parts
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a compile thread panicked".into()))
                })
                .collect()
        });
        let modules = built
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut funcs = HashMap::new();
        for k in Kernel::all() {
            let name = k.name();
            let f = modules
                .iter()
                .find_map(|m| m.load_function(&name).ok())
                .ok_or_else(|| format!("kernel {k}: in no part of the source"))?;
            funcs.insert(k, f);
        }
        Ok(Kernels {
            funcs,
            _modules: modules,
        })
    }
    pub fn get(&self, op: &'static str, kernel: Kernel) -> Result<&CudaFunction> {
        self.funcs
            .get(&kernel)
            .ok_or_else(|| derr(op, format!("no CUDA kernel {kernel}")))
    }
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

    /// The whole source (every part holds it, after its `OXI_PART` line).
    const SOURCE: &str = ELEMENTWISE_PARTS[0].text;

    /// The line of the source that instantiates template group `group` (`INST`, `INST_ALL`)
    /// for dtype `d`.
    fn instantiated(group: &str, d: DType) -> bool {
        SOURCE
            .lines()
            .any(|l| l.starts_with(&format!("{group}({}, ", d.as_str())))
    }

    #[test]
    fn every_kernel_name_is_in_the_source() {
        let all = Kernel::all();
        assert_eq!(
            all.len(),
            all.iter().collect::<std::collections::HashSet<_>>().len()
        );
        for k in all {
            let n = k.name();
            let direct = SOURCE.contains(&format!("void {n}("));
            let via_macro = match k {
                Kernel::Typed(t, d) => ["INST", "INST_ALL", "INST_PUT"].iter().any(|g| {
                    let body = SOURCE
                        .split(&format!("#define {g}(NAME, T)"))
                        .nth(1)
                        .and_then(|rest| rest.split("\n\n").next())
                        .unwrap_or("");
                    body.contains(&format!("void {}_##NAME(", t.base())) && instantiated(g, d)
                }),
                Kernel::Cast(a, b) => SOURCE.lines().any(|l| {
                    l.starts_with(&format!("CAST({}, ", a.as_str()))
                        && l.contains(&format!(", {}, ", b.as_str()))
                }),
                _ => false,
            };
            assert!(direct || via_macro, "{n} is not in source.cu");
        }
    }
}
