//! Op definitions, one file per op family. A family's file holds everything about its ops: the
//! attributes, the `Tensor` methods that build them, shape and dtype rules, SBP candidates (from
//! the `sbp` crate's rule builders, which also give the output shapes), the global -> local
//! attribute mapping, the kernel trait each backend implements, and the backward rule written in
//! ops. The dispatcher knows ops only through [`Op`]'s delegating methods; a backend is a type
//! implementing every family's kernel trait ([`Backend`]), so a missing kernel fails to compile.
//!
//! Adding a family: a file here implementing [`OpFamily`] and declaring its kernel trait, one
//! line in `families!` below, and one kernel file per backend (`cpu/`, `cuda/ops/`). A fused op
//! that is not a core family is a custom op (`custom/`): the same, one folder down.

mod attention;
pub mod custom;
mod dropout;
mod elementwise;
mod embedding;
mod extern_op;
mod gather;
mod grad;
mod layout;
mod loss;
mod mask;
mod matmul;
mod norm;
mod peers;
mod reduction;
mod rms_norm;
mod rotary;
mod softmax;

use std::fmt;
use std::hash::Hash;

use oxiflow_dtype::DType;
use oxiflow_sbp::{Region, RuleMode, Rules, Shape};
use smallvec::SmallVec;

use crate::tensor::Tensor;
use crate::{Result, TensorError};

pub use attention::{AttentionKernels, AttentionOp};
pub use custom::{CustomKernels, CustomOp};
pub use dropout::{DropoutKernels, DropoutOp};
pub use elementwise::{
    broadcast_shapes, BinaryOp, ElementwiseKernels, ElementwiseOp, ScalarOp, UnaryOp,
};
pub use embedding::{EmbeddingKernels, EmbeddingOp};
pub use extern_op::{
    BackendId, Extern, ExternKernels, ExternOp, KernelFn, KernelIo, Kernels, ScratchFn,
};
pub use gather::{Addressing, Along, GatherKernels, GatherOp, IndexShard};
pub(crate) use grad::Saved;
pub use grad::{Grad, Saves};
pub use layout::{LayoutKernels, LayoutOp};
pub use loss::{ClassShard, LossKernels, LossOp};
pub use mask::{MaskKernels, MaskOp, Triangle};
pub use matmul::{MatmulKernels, MatmulOp};
pub(crate) use norm::stats_dtype as norm_stats_dtype;
pub use norm::{NormKernels, NormOp};
pub use peers::Peers;
pub use reduction::{Extremum, ReductionKernels, ReductionOp};
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

/// The result of a metadata check: what `infer` and its helpers return.
pub type MetaResult<T> = std::result::Result<T, MetaError>;

/// Every output of one op call: its shape, dtype and (when asked for) SBP candidates, the
/// shapes and candidates in `rules` (one output shape, and one SBP per output in every
/// candidate, per entry of `dtypes`).
pub struct Inferred {
    pub rules: Rules,
    pub dtypes: SmallVec<[DType; 1]>,
}

impl Inferred {
    /// A single-output op's.
    pub fn new(rules: Rules, dtype: DType) -> Self {
        Inferred {
            rules,
            dtypes: smallvec::smallvec![dtype],
        }
    }
    /// An op's with one dtype per output.
    pub fn outputs(rules: Rules, dtypes: &[DType]) -> Self {
        Inferred {
            rules,
            dtypes: dtypes.iter().copied().collect(),
        }
    }
}

/// One output of an op call on this rank: the shape and dtype of the buffer the executor
/// allocates for the kernel to write.
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
    /// Where a global call runs (None for a call on local tensors): what `peers_along` reads.
    pub(crate) site: Option<CallSite<'a>>,
}

/// Where a global op call runs on this rank: the world, the rank, the placement and each
/// input's nd-SBP in the chosen signature.
pub(crate) struct CallSite<'a> {
    pub world: &'a oxiflow_collectives::SharedComm,
    pub rank: usize,
    pub placement: &'a oxiflow_placement::Placement,
    pub input_sbps: &'a [oxiflow_sbp::NdSbp],
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

    /// The ranks this rank exchanges pieces of input `i` with along `dim` (those of the mesh
    /// axis splitting `dim` in the chosen signature; this rank alone when none does or the call
    /// is local), or why there is no such group (the dim split on two mesh axes).
    pub fn peers_along(&self, i: usize, dim: usize) -> std::result::Result<Peers, String> {
        let shape = self
            .global_inputs
            .get(i)
            .ok_or_else(|| format!("no input {i}"))?;
        let len = shape.dims().get(dim).copied().unwrap_or(0);
        match &self.site {
            None => Ok(Peers::alone(len)),
            Some(site) => {
                let nd_sbp = site
                    .input_sbps
                    .get(i)
                    .ok_or_else(|| format!("no nd-SBP of input {i}"))?;
                Peers::along(site.world, site.rank, shape, site.placement, nd_sbp, dim)
            }
        }
    }
}

/// The whole-tensor region of `shape`.
pub(crate) fn full_region(shape: &Shape) -> Region {
    shape.dims().iter().map(|&n| 0..n).collect()
}

/// One op family (see the module docs). Inputs reach `infer`, `run` and `backward` only after
/// the dispatcher has checked their count against `arity`, so they index inputs freely; `run`
/// gets one output buffer per output `infer` gave, allocated by the executor ([`Op::execute`]).
pub trait OpFamily: Clone + fmt::Debug + PartialEq + Eq + Hash + Send + Sync {
    /// The op's name, as errors print it.
    fn name(&self) -> &'static str;
    /// Number of inputs (min, max).
    fn arity(&self) -> (usize, usize);
    /// Checks shapes and dtypes; returns every output's dtype and the op's rules (each output's
    /// shape and SBP candidates).
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred>;
    /// The op with one rank's local attributes, given where the rank's pieces sit in the global
    /// tensors (e.g. a reshape's local target, a mean's global divisor, a random mask's or a
    /// vocabulary shard's offset); None when they equal the global ones.
    fn local(&self, _at: &LocalAt<'_>) -> Option<Self> {
        None
    }
    /// Output 0 is a run of one input's elements under the output's shape (a reshape, or a
    /// range of a flat tensor): the executor makes it with [`KernelBackend::viewed`] (a view
    /// where the backend can share memory) instead of allocating and running a kernel.
    fn view_of(&self) -> Option<ViewOf> {
        None
    }
    /// Runs the op's kernels on one rank's pieces, writing every output into its buffer in
    /// `out` (uninitialised: the kernels write every element; they never replace a buffer,
    /// which may be a view of an arena, `crate::arena`).
    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()>;
    /// Whether output `i` carries a gradient (false: a statistic saved for the backward, such
    /// as a mean or a log-sum-exp; it gets no autograd history).
    fn differentiable(&self, _output: usize) -> bool {
        true
    }
    /// What the backward rule reads, given which inputs need a gradient: the inputs and
    /// outputs the autograd node keeps until its backward runs (the rule sees every other one
    /// as metadata; reading one it did not declare is a typed error).
    fn saves(&self, needs: &[bool]) -> Saves;
    /// Input gradients from the output gradients (`Grad::dys`: None for an output that got
    /// none; single-output ops read `Grad::dy`), None where an input needs none or is not
    /// differentiable, written with dispatched ops.
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>>;
}

/// The `differentiable`, `saves` and `backward` of an op family whose outputs carry no gradient
/// (an optimizer update, a statistic), inside its `impl OpFamily`: a backward through it is a
/// typed error naming the op and `$why`.
macro_rules! no_gradient {
    ($why:expr) => {
        fn differentiable(&self, _output: usize) -> bool {
            false
        }
        fn saves(&self, _needs: &[bool]) -> $crate::op::Saves {
            $crate::op::Saves::NOTHING
        }
        fn backward(
            &self,
            _g: &$crate::op::Grad<'_>,
        ) -> $crate::Result<Vec<Option<$crate::Tensor>>> {
            Err($crate::op::Grad::unsupported(self.name(), $why))
        }
    };
}
pub(crate) use no_gradient;

/// The buffers a backend's kernels read and write, and its one allocator: every output buffer
/// is allocated here by the executor (and every scratch buffer by the kernel that needs it), so
/// kernels never allocate their outputs.
pub trait KernelBackend {
    /// The backend's name, as errors print it (`cpu`, `cuda`).
    const NAME: &'static str;
    /// A piece a kernel reads.
    type Piece;
    /// A buffer a kernel writes: the shape and dtype of one output, uninitialised.
    type Out;
    /// A buffer of `spec`'s shape and dtype.
    fn alloc(&self, spec: &OutSpec) -> Result<Self::Out>;
    /// The shape and dtype of a buffer.
    fn out_spec(&self, out: &Self::Out) -> OutSpec;
    /// The shape and dtype of a piece.
    fn piece_spec(&self, x: &Self::Piece) -> OutSpec;
    /// A written buffer as a piece.
    fn finish(&self, out: Self::Out) -> Self::Piece;
    /// `x`'s elements `start..start + spec`'s count (row-major), same dtype, under `spec`'s
    /// shape: the same memory where the backend can share it, else a copy.
    fn viewed(&self, x: &Self::Piece, start: usize, spec: &OutSpec) -> Result<Self::Piece>;
    /// `x`'s elements under `spec`'s shape (same count and dtype): [`KernelBackend::viewed`]
    /// from element 0.
    fn reshaped(&self, x: &Self::Piece, spec: &OutSpec) -> Result<Self::Piece> {
        let have = self.piece_spec(x);
        if spec.shape.checked_numel() != Some(have.shape.numel()) || spec.dtype != have.dtype {
            return Err(kernel_err(
                "reshape",
                format!(
                    "cannot view {} {} as {} {}",
                    have.dtype, have.shape, spec.dtype, spec.shape
                ),
            ));
        }
        self.viewed(x, 0, spec)
    }
}

/// Where a view op's output lies (see [`OpFamily::view_of`]): input `input`'s elements from
/// `start` (row-major), as many as the output holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ViewOf {
    pub input: usize,
    pub start: usize,
}

/// The only output buffer of a single-output op.
fn single<'a, T>(op: &'static str, out: &'a mut [T]) -> Result<&'a mut T> {
    let n = out.len();
    match out {
        [y] => Ok(y),
        _ => Err(kernel_err(
            op,
            format!("expects one output buffer, got {n}"),
        )),
    }
}

/// A scratch piece of `spec` written by `f` (for ops whose `run` composes kernels).
fn scratch<B: Backend>(
    b: &B,
    spec: &OutSpec,
    f: impl FnOnce(&mut B::Out) -> Result<()>,
) -> Result<B::Piece> {
    let mut t = b.alloc(spec)?;
    f(&mut t)?;
    Ok(b.finish(t))
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
                &self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode,
            ) -> MetaResult<Inferred> {
                match self {
                    $(Op::$variant(o) => o.infer(shapes, dtypes, mode)),*
                }
            }
            pub(crate) fn local(&self, at: &LocalAt<'_>) -> Option<Op> {
                match self {
                    $(Op::$variant(o) => o.local(at).map(Op::$variant)),*
                }
            }
            pub(crate) fn view_of(&self) -> Option<ViewOf> {
                match self {
                    $(Op::$variant(o) => o.view_of()),*
                }
            }
            fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
                match self {
                    $(Op::$variant(o) => o.run(b, x, out)),*
                }
            }
            pub(crate) fn differentiable(&self, output: usize) -> bool {
                match self {
                    $(Op::$variant(o) => o.differentiable(output)),*
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
    Custom(CustomOp): CustomKernels,
    Extern(Extern): ExternKernels,
}

impl Op {
    /// The executor of one op call on one backend: allocates every output of `specs` through
    /// the backend's allocator, runs the op's kernels into them and returns them as pieces (a
    /// view op gets `KernelBackend::reshaped` instead).
    pub(crate) fn execute<B: Backend>(
        &self,
        b: &B,
        x: &[&B::Piece],
        specs: &[OutSpec],
    ) -> Result<SmallVec<[B::Piece; 1]>> {
        if let [spec] = specs {
            return Ok(smallvec::smallvec![self.execute_one(b, x, spec)?]);
        }
        let mut out: SmallVec<[B::Out; 1]> = SmallVec::with_capacity(specs.len());
        for spec in specs {
            out.push(b.alloc(spec)?);
        }
        self.run(b, x, &mut out)?;
        Ok(out.into_iter().map(|o| b.finish(o)).collect())
    }

    /// The op's kernels into given output buffers (one per output, of its shape and dtype),
    /// where an arena placed them; a view op has no kernel and is an error here.
    pub(crate) fn execute_into<B: Backend>(
        &self,
        b: &B,
        x: &[&B::Piece],
        out: &mut [B::Out],
    ) -> Result<()> {
        if self.view_of().is_some() {
            return Err(kernel_err(
                self.name(),
                "a view has no kernel to run into a buffer".into(),
            ));
        }
        self.run(b, x, out)
    }

    /// [`Op::execute`] of a single-output call.
    pub(crate) fn execute_one<B: Backend>(
        &self,
        b: &B,
        x: &[&B::Piece],
        spec: &OutSpec,
    ) -> Result<B::Piece> {
        if let Some(v) = self.view_of() {
            let Some(src) = x.get(v.input) else {
                return Err(kernel_err(
                    self.name(),
                    format!("no input {} to view", v.input),
                ));
            };
            return b.viewed(src, v.start, spec);
        }
        let mut out = b.alloc(spec)?;
        self.run(b, x, std::slice::from_mut(&mut out))?;
        Ok(b.finish(out))
    }
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
fn shape_rule(r: std::result::Result<Rules, String>) -> MetaResult<Rules> {
    r.map_err(MetaError::Shape)
}

fn need_float(dt: DType, what: &str) -> MetaResult<()> {
    if dt.is_float() {
        Ok(())
    } else {
        Err(MetaError::DType(format!(
            "{what} must be a float dtype, got {dt}"
        )))
    }
}

fn need_i64(dt: DType, what: &str) -> MetaResult<()> {
    if dt == DType::I64 {
        Ok(())
    } else {
        Err(MetaError::DType(format!("{what} must be i64, got {dt}")))
    }
}

fn same_dtype(dtypes: &[DType]) -> MetaResult<DType> {
    let d = dtypes[0];
    if dtypes.iter().any(|&x| x != d) {
        return Err(MetaError::DType("operands must have the same dtype".into()));
    }
    Ok(d)
}

/// The one dtype of `dtypes`, a float dtype (`what` names the operands in the error).
fn same_float_dtype(dtypes: &[DType], what: &str) -> MetaResult<DType> {
    let dt = same_dtype(dtypes)?;
    need_float(dt, what)?;
    Ok(dt)
}

fn dim_ok(shape: &Shape, d: usize) -> MetaResult<()> {
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
