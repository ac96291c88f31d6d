//! The op contract: what an op family is ([`OpFamily`]: name, arity, shape, dtype and SBP
//! rules, local attributes, saved tensors and backward; [`RunKernels`]: its kernels on a
//! backend), what a backend's buffers are ([`KernelBackend`]), and the metadata and helpers
//! every family's rules share. It names no family: the families build on it, and `op`'s table
//! of them ([`super::Op`]) sits above both.

use std::fmt;
use std::hash::Hash;

use oxiflow_dtype::DType;
use oxiflow_sbp::{Region, RuleMode, Rules, Shape};
use smallvec::SmallVec;

use super::grad::{Grad, Saves};
use super::peers::Peers;
use crate::tensor::{sbps_text, Tensor};
use crate::{Result, TensorError};

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

/// One op family (see the module docs). Inputs reach `infer`, [`RunKernels::run`] and
/// `backward` only after the dispatcher has checked their count against `arity`, so they index
/// inputs freely.
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

/// An op family's kernels on backend `B`, implemented for every backend with the family's
/// kernel trait (`impl<B: MatmulKernels> RunKernels<B> for MatmulOp`): the op's table
/// (`super::Op`) runs any family on any backend that has every family's kernels.
pub trait RunKernels<B: KernelBackend> {
    /// Runs the op's kernels on one rank's pieces, writing every output into its buffer in
    /// `out`, one per output `infer` gave, allocated by the executor (uninitialised: the
    /// kernels write every element; they never replace a buffer, which may be a view of an
    /// arena, `crate::arena`).
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()>;
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

/// The `name` and `arity` of an op family with one name and exactly `$inputs` inputs, inside
/// its `impl OpFamily`.
macro_rules! name_and_arity {
    ($name:literal, $inputs:literal) => {
        fn name(&self) -> &'static str {
            $name
        }

        fn arity(&self) -> (usize, usize) {
            ($inputs, $inputs)
        }
    };
}
pub(crate) use name_and_arity;

/// Declares an op family's kernel trait over [`KernelBackend`]: each `fn name(args..);` in it is
/// a kernel method `fn name(&self, args.., out: &mut Self::Out) -> Result<()>` that writes the
/// op's one output into `out`.
macro_rules! kernel_trait {
    (
        $(#[$attr:meta])*
        pub trait $name:ident {
            $(
                $(#[$fattr:meta])*
                fn $f:ident($($arg:ident: $ty:ty),* $(,)?);
            )*
        }
    ) => {
        $(#[$attr])*
        pub trait $name: $crate::op::KernelBackend {
            $(
                $(#[$fattr])*
                fn $f(&self, $($arg: $ty,)* out: &mut Self::Out) -> $crate::Result<()>;
            )*
        }
    };
}
pub(crate) use kernel_trait;

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
pub(crate) fn single<'a, T>(op: &'static str, out: &'a mut [T]) -> Result<&'a mut T> {
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
pub fn scratch<B: KernelBackend>(
    b: &B,
    spec: &OutSpec,
    f: impl FnOnce(&mut B::Out) -> Result<()>,
) -> Result<B::Piece> {
    let mut t = b.alloc(spec)?;
    f(&mut t)?;
    Ok(b.finish(t))
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
pub(crate) fn shape_rule(r: std::result::Result<Rules, String>) -> MetaResult<Rules> {
    r.map_err(MetaError::Shape)
}

/// A dtype error naming `what` unless `dt` is a float dtype.
pub fn need_float(dt: DType, what: &str) -> MetaResult<()> {
    if dt.is_float() {
        Ok(())
    } else {
        Err(MetaError::DType(format!(
            "{what} must be a float dtype, got {dt}"
        )))
    }
}

/// A dtype error naming `what` unless `dt` is i64.
pub fn need_i64(dt: DType, what: &str) -> MetaResult<()> {
    if dt == DType::I64 {
        Ok(())
    } else {
        Err(MetaError::DType(format!("{what} must be i64, got {dt}")))
    }
}

pub(crate) fn same_dtype(dtypes: &[DType]) -> MetaResult<DType> {
    let d = dtypes[0];
    if dtypes.iter().any(|&x| x != d) {
        return Err(MetaError::DType("operands must have the same dtype".into()));
    }
    Ok(d)
}

/// The one dtype of `dtypes`, a float dtype (`what` names the operands in the error).
pub(crate) fn same_float_dtype(dtypes: &[DType], what: &str) -> MetaResult<DType> {
    let dt = same_dtype(dtypes)?;
    need_float(dt, what)?;
    Ok(dt)
}

pub(crate) fn dim_ok(shape: &Shape, d: usize) -> MetaResult<()> {
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
            sbps: sbps_text(&[t]),
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
pub fn kernel_err(op: &'static str, detail: String) -> TensorError {
    TensorError::Kernel { op, detail }
}
