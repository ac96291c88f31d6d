//! Op definitions, one file per op family. A family's file holds everything about its ops: the
//! attributes, the `Tensor` methods that build them, shape and dtype rules, SBP candidates (from
//! the `sbp` crate's rule builders, which also give the output shapes), the global -> local
//! attribute mapping, the kernel trait each backend implements, and the backward rule written in
//! ops. The dispatcher knows ops only through [`Op`]'s delegating methods; a backend is a type
//! implementing every family's kernel trait ([`Backend`]), so a missing kernel fails to compile.
//!
//! Adding a family: a file here implementing [`OpFamily`] and declaring its kernel trait, one
//! line in `families!` below, and one kernel file per backend (`cpu/`, `cuda/ops/`).

mod attention;
mod dropout;
mod elementwise;
mod embedding;
mod gather;
mod grad;
mod layout;
mod loss;
mod mask;
mod matmul;
mod norm;
mod reduction;
mod rms_norm;
mod rotary;
mod softmax;

use std::fmt;
use std::hash::Hash;

use oxiflow_collectives::DType;
use oxiflow_sbp::{Region, RuleMode, Rules, Shape};
use smallvec::SmallVec;

use crate::tensor::Tensor;
use crate::{Result, TensorError};

pub use attention::{AttentionKernels, AttentionOp};
pub use dropout::{DropoutKernels, DropoutOp};
pub use elementwise::{
    broadcast_shapes, AdamPart, BinaryOp, ElementwiseKernels, ElementwiseOp, ScalarOp, UnaryOp,
};
pub use embedding::{EmbeddingKernels, EmbeddingOp};
pub use gather::{GatherKernels, GatherOp, IndexShard};
pub(crate) use grad::{Grad, Saved, Saves};
pub use layout::{LayoutKernels, LayoutOp};
pub use loss::{LossKernels, LossOp};
pub use mask::{MaskKernels, MaskOp, Triangle};
pub use matmul::{MatmulKernels, MatmulOp};
pub use norm::{NormKernels, NormOp};
pub use reduction::{ReductionKernels, ReductionOp};
pub use rms_norm::{RmsNormKernels, RmsNormOp};
pub use rotary::{RotaryKernels, RotaryOp};
pub use softmax::{SoftmaxKernels, SoftmaxOp};

/// A list of tensor dims (normalized, non-negative).
pub type Dims = SmallVec<[usize; 6]>;

/// Why metadata does not fit an op (the dispatcher adds the op, shapes, dtypes and SBPs).
#[derive(Debug)]
pub enum MetaError {
    Shape(String),
    DType(String),
}

/// Output dtype and rules (output shapes, and SBP candidates when asked for) of one op call.
pub struct Inferred {
    pub rules: Rules,
    pub dtype: DType,
}

impl Inferred {
    fn new(rules: Rules, dtype: DType) -> Self {
        Inferred { rules, dtype }
    }
}

/// What the dispatcher expects a kernel to return: this rank's output shape and dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutSpec {
    pub shape: Shape,
    pub dtype: DType,
}

/// Where this rank's pieces sit in an op call's global tensors: what [`OpFamily::local`] reads.
/// Regions are the global index ranges of the rank's pieces once the inputs have the chosen
/// signature's layout (the whole tensor for a broadcast or partial input); a local call passes
/// none, and every start reads 0.
pub struct LocalAt<'a> {
    /// Global shape of each input.
    pub global_inputs: &'a [&'a Shape],
    /// This rank's region of each input.
    pub input_regions: &'a [Region],
    /// Global shape of the output.
    pub out_global: &'a Shape,
    /// This rank's region of the output.
    pub out_region: &'a Region,
    /// This rank's output piece shape.
    pub out_local: &'a Shape,
}

impl LocalAt<'_> {
    /// Start of this rank's region of input `i` on `dim` (0 when out of range).
    pub fn input_start(&self, i: usize, dim: usize) -> usize {
        self.input_regions
            .get(i)
            .and_then(|r| r.get(dim))
            .map_or(0, |r| r.start)
    }

    /// Start of this rank's output region on `dim` (0 when out of range).
    pub fn out_start(&self, dim: usize) -> usize {
        self.out_region.get(dim).map_or(0, |r| r.start)
    }
}

/// The whole-tensor region of `shape`.
pub(crate) fn full_region(shape: &Shape) -> Region {
    shape.dims().iter().map(|&n| 0..n).collect()
}

/// One op family (see the module docs). Inputs reach `infer`, `run` and `backward` only after
/// the dispatcher has checked their count against `arity`, so they index inputs freely.
pub trait OpFamily: Clone + fmt::Debug + PartialEq + Eq + Hash + Send + Sync {
    /// The op's name, as errors print it.
    fn name(&self) -> &'static str;
    /// Number of inputs (min, max).
    fn arity(&self) -> (usize, usize);
    /// Checks shapes and dtypes; returns the output dtype and the op's rules.
    fn infer(
        &self,
        shapes: &[&Shape],
        dtypes: &[DType],
        mode: RuleMode,
    ) -> std::result::Result<Inferred, MetaError>;
    /// The op with one rank's local attributes, given where the rank's pieces sit in the global
    /// tensors (e.g. a reshape's local target, a mean's global divisor, a random mask's or a
    /// vocabulary shard's offset); None when they equal the global ones.
    fn local(&self, _at: &LocalAt<'_>) -> Option<Self> {
        None
    }
    /// Runs the op's kernel on one rank's pieces.
    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &OutSpec) -> Result<B::Piece>;
    /// What the backward rule reads, given which inputs need a gradient: the inputs and
    /// outputs the autograd node keeps until its backward runs (the rule sees every other one
    /// as metadata; reading one it did not declare is a typed error).
    fn saves(&self, needs: &[bool]) -> Saves;
    /// Input gradients from the output gradients (None where not needed or not
    /// differentiable with respect to that input), written with dispatched ops.
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>>;
}

/// The piece type a backend's kernels take and return.
pub trait KernelBackend {
    type Piece;
}

/// Declares the closed set of families: the [`Op`] enum, its delegating methods and the
/// [`Backend`] trait requiring every family's kernels.
macro_rules! families {
    ($($variant:ident($ty:ty): $kernels:ident),* $(,)?) => {
        /// One op with its attributes (hashable: the dispatch cache key).
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub enum Op {
            $($variant($ty)),*
        }

        $(impl From<$ty> for Op {
            fn from(op: $ty) -> Op {
                Op::$variant(op)
            }
        })*

        /// A backend: kernels of every op family on one piece type.
        pub trait Backend: KernelBackend $(+ $kernels)* {}
        impl<T: KernelBackend $(+ $kernels)*> Backend for T {}

        impl Op {
            /// The op's name, as errors print it.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Op::$variant(o) => o.name()),*
                }
            }
            pub(crate) fn arity(&self) -> (usize, usize) {
                match self {
                    $(Op::$variant(o) => o.arity()),*
                }
            }
            pub(crate) fn infer(
                &self,
                shapes: &[&Shape],
                dtypes: &[DType],
                mode: RuleMode,
            ) -> std::result::Result<Inferred, MetaError> {
                match self {
                    $(Op::$variant(o) => o.infer(shapes, dtypes, mode)),*
                }
            }
            pub(crate) fn local(&self, at: &LocalAt<'_>) -> Option<Op> {
                match self {
                    $(Op::$variant(o) => o.local(at).map(Op::$variant)),*
                }
            }
            pub(crate) fn run<B: Backend>(
                &self,
                b: &B,
                x: &[&B::Piece],
                out: &OutSpec,
            ) -> Result<B::Piece> {
                match self {
                    $(Op::$variant(o) => o.run(b, x, out)),*
                }
            }
            pub(crate) fn saves(&self, needs: &[bool]) -> Saves {
                match self {
                    $(Op::$variant(o) => o.saves(needs)),*
                }
            }
            pub(crate) fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
                match self {
                    $(Op::$variant(o) => o.backward(g)),*
                }
            }
        }
    };
}

families! {
    Elementwise(ElementwiseOp): ElementwiseKernels,
    Matmul(MatmulOp): MatmulKernels,
    Reduction(ReductionOp): ReductionKernels,
    Softmax(SoftmaxOp): SoftmaxKernels,
    Layout(LayoutOp): LayoutKernels,
    Embedding(EmbeddingOp): EmbeddingKernels,
    Norm(NormOp): NormKernels,
    Loss(LossOp): LossKernels,
    RmsNorm(RmsNormOp): RmsNormKernels,
    Attention(AttentionOp): AttentionKernels,
    Dropout(DropoutOp): DropoutKernels,
    Gather(GatherOp): GatherKernels,
    Mask(MaskOp): MaskKernels,
    Rotary(RotaryOp): RotaryKernels,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bit pattern of an f64 attribute, so ops hash and compare exactly.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct F64Bits(u64);

impl F64Bits {
    pub fn new(v: f64) -> Self {
        F64Bits(v.to_bits())
    }
    pub fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}

impl fmt::Debug for F64Bits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// A rule builder's detail message as a shape error.
fn shape_rule(r: std::result::Result<Rules, String>) -> std::result::Result<Rules, MetaError> {
    r.map_err(MetaError::Shape)
}

fn need_float(dt: DType, what: &str) -> std::result::Result<(), MetaError> {
    if dt.is_float() {
        Ok(())
    } else {
        Err(MetaError::DType(format!(
            "{what} must be a float dtype, got {dt}"
        )))
    }
}

fn need_i64(dt: DType, what: &str) -> std::result::Result<(), MetaError> {
    if dt == DType::I64 {
        Ok(())
    } else {
        Err(MetaError::DType(format!("{what} must be i64, got {dt}")))
    }
}

fn same_dtype(dtypes: &[DType]) -> std::result::Result<DType, MetaError> {
    let d = dtypes[0];
    if dtypes.iter().any(|&x| x != d) {
        return Err(MetaError::DType("operands must have the same dtype".into()));
    }
    Ok(d)
}

fn dim_ok(shape: &Shape, d: usize) -> std::result::Result<(), MetaError> {
    if d >= shape.ndim() {
        return Err(MetaError::Shape(format!(
            "dim {d} out of range for {} dims",
            shape.ndim()
        )));
    }
    Ok(())
}

/// Normalizes a possibly negative dim of a tensor with `ndim` dims.
pub(crate) fn norm_dim(op: &'static str, t: &Tensor, d: isize) -> Result<usize> {
    let n = t.ndim() as isize;
    let v = if d < 0 { d + n } else { d };
    if v < 0 || v >= n.max(1) || (n == 0) {
        return Err(TensorError::Shape {
            op,
            shapes: t.shape().to_string(),
            sbps: crate::dispatch::sbps_text(&[t]),
            detail: format!("dim {d} out of range for {n} dims"),
        });
    }
    Ok(v as usize)
}

/// Normalizes, dedups and sorts a list of dims.
pub(crate) fn norm_dims(op: &'static str, t: &Tensor, dims: &[isize]) -> Result<Dims> {
    let mut out = Dims::new();
    for &d in dims {
        let v = norm_dim(op, t, d)?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// A typed error for a kernel handed data it cannot handle.
pub(crate) fn kernel_err(op: &'static str, detail: String) -> TensorError {
    TensorError::Kernel { op, detail }
}
