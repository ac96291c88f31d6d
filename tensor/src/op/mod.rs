//! Op definitions, one file per op family, and their table. The contract (`family`) names no
//! family: a family's file builds on it and holds its ops' attributes, shape and dtype rules,
//! SBP candidates (from the `sbp` crate's rule builders, which also give the output shapes),
//! the global -> local attribute mapping, the backward rule (written with the `Tensor` methods
//! that build ops, `crate::methods`, above dispatch), and the kernel trait each backend
//! implements, with the family's [`RunKernels`] impl. The table ([`Op`]) sits above the
//! families: the dispatcher knows ops only through its delegating methods; a backend is a type
//! implementing every family's kernel trait ([`Backend`]), so a missing kernel fails to compile.
//!
//! Adding a family: a file here implementing [`OpFamily`] and [`RunKernels`] and declaring its
//! kernel trait, one line in `families!` below and one in [`CoreKernels`], its `Tensor`
//! methods in `crate::methods`, and one kernel file per backend (`cpu/`, the cuda crate's
//! `ops/`). A fused op that is not a core family is a custom op (`custom/`): the same, one
//! folder down.

mod attention;
pub mod custom;
mod dropout;
mod elementwise;
mod embedding;
mod extern_op;
mod family;
mod gather;
mod grad;
mod kernels;
mod layer_norm_grads;
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

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Shape};
use smallvec::SmallVec;

use crate::tensor::{inputs_text, sbps_text, shapes_text, Tensor};
use crate::{Result, TensorError};

pub use attention::{AttentionKernels, AttentionOp};
pub use custom::{CustomKernels, CustomOp};
pub use dropout::{DropoutKernels, DropoutOp};
pub use elementwise::{
    broadcast_shapes, BinaryOp, ElementwiseKernels, ElementwiseOp, ScalarOp, UnaryOp,
};
pub use embedding::EmbeddingOp;
pub use extern_op::{BackendId, Extern, ExternOp, KernelFn, KernelIo, Kernels, ScratchFn};
pub(crate) use family::{
    dim_ok, full_region, kernel_trait, name_and_arity, no_gradient, norm_dim, norm_dims,
    same_dtype, same_float_dtype, shape_rule, single, CallSite,
};
pub use family::{
    kernel_err, need_float, need_i64, scratch, Dims, F64Bits, Inferred, KernelBackend, LocalAt,
    MetaError, MetaResult, OpFamily, OutSpec, RunKernels, ViewOf,
};
pub use gather::{Addressing, Along, GatherKernels, GatherOp, IndexShard};
pub(crate) use grad::Saved;
pub use grad::{Grad, Saves};
pub use kernels::CoreKernels;
pub use layer_norm_grads::composed_layer_norm_grads;
pub use layout::{LayoutKernels, LayoutOp};
pub(crate) use loss::to_row_layout;
pub use loss::{ClassShard, LossKernels, LossOp};
pub(crate) use mask::triangular;
pub use mask::{MaskKernels, MaskOp, Triangle};
pub use matmul::{MatmulKernels, MatmulOp, MatmulProduct};
pub use norm::stats_dtype as norm_stats_dtype;
pub use norm::{NormKernels, NormOp};
pub use peers::Peers;
pub use reduction::{Extremum, ReductionKernels, ReductionOp};
pub use rms_norm::{RmsNormKernels, RmsNormOp};
pub use rotary::{RotaryKernels, RotaryOp};
pub use softmax::{SoftmaxKernels, SoftmaxOp};

/// A backend: kernels of every op family on one piece type (the core families' and, through
/// [`CustomKernels`], the custom ops').
pub trait Backend: CoreKernels + CustomKernels {}
impl<T: CoreKernels + CustomKernels> Backend for T {}

/// Declares the closed set of families: the [`Op`] enum and its delegating methods.
macro_rules! families {
    ($($variant:ident($ty:ty)),* $(,)?) => {
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
                    $(Op::$variant(o) => RunKernels::<B>::run(o, b, x, out)),*
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
    Elementwise(ElementwiseOp),
    Matmul(MatmulOp),
    Reduction(ReductionOp),
    Softmax(SoftmaxOp),
    Layout(LayoutOp),
    Embedding(EmbeddingOp),
    Norm(NormOp),
    Loss(LossOp),
    RmsNorm(RmsNormOp),
    Attention(AttentionOp),
    Dropout(DropoutOp),
    Gather(GatherOp),
    Mask(MaskOp),
    Rotary(RotaryOp),
    Custom(CustomOp),
    Extern(Extern),
}

/// `From` each custom op type for [`Op`] (as [`Op::Custom`]).
macro_rules! custom_into_op {
    ($($ty:ident),*) => {
        $(impl From<custom::$ty> for Op {
            fn from(op: custom::$ty) -> Op {
                Op::Custom(op.into())
            }
        })*
    };
}
custom::with_custom_op_types!(custom_into_op);

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

/// `e` as the typed error of `op` on `inputs` (naming their shapes, dtypes and SBPs).
pub fn meta_err(op: &Op, e: MetaError, inputs: &[&Tensor]) -> TensorError {
    match e {
        MetaError::Shape(detail) => TensorError::Shape {
            op: op.name(),
            shapes: shapes_text(inputs),
            sbps: sbps_text(inputs),
            detail,
        },
        MetaError::DType(detail) => TensorError::DType {
            op: op.name(),
            dtypes: inputs_text(inputs, ", ", Tensor::dtype),
            shapes: shapes_text(inputs),
            sbps: sbps_text(inputs),
            detail,
        },
    }
}
