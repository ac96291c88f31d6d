//! Custom ops: fused ops that are not core families (in the spirit of candle's `CustomOp` and
//! OneFlow's user ops). Each lives in one file here holding the op as an [`OpFamily`] impl
//! (attributes, shape/dtype checks with SBP candidates, local attributes, the saved set and the
//! backward rule) and its kernel trait with its [`RunKernels`] impl; the `Tensor` methods that
//! build it are `crate::methods::custom::<name>`, and its kernels live in one file per backend
//! (`cpu/custom/<name>.rs`, the cuda crate's `ops/custom/<name>.rs`). Like the core families, a
//! custom op never calls dispatch.
//!
//! Registering one is one line in `custom_ops!` below (`module::Variant(Type): KernelTrait`):
//! it declares the module, adds the op to [`CustomOp`] (which dispatches through `Op::Custom`
//! like any family, hashable as the dispatch cache key) and its kernel trait to
//! [`CustomKernels`], which every backend must implement, so a backend without its kernels
//! does not compile; the op table makes each type an `Op` (`with_custom_op_types!`).

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Shape};

use super::family::{Inferred, LocalAt, MetaResult, OpFamily, RunKernels, ViewOf};
use super::grad::{Grad, Saves};
use super::kernels::CoreKernels;
use crate::tensor::Tensor;
use crate::Result;

/// Declares the custom ops: their modules, the [`CustomOp`] enum delegating [`OpFamily`] to
/// each, and [`CustomKernels`] requiring each one's kernel trait.
macro_rules! custom_ops {
    ($($module:ident :: $variant:ident($ty:ident): $kernels:ident),* $(,)?) => {
        $(
            mod $module;
            pub use $module::*;
        )*

        /// One custom op with its attributes.
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub enum CustomOp {
            $($variant($ty)),*
        }

        $(
            impl From<$ty> for CustomOp {
                fn from(op: $ty) -> CustomOp {
                    CustomOp::$variant(op)
                }
            }
        )*

        /// The kernels of every custom op, and of the core families they compose.
        pub trait CustomKernels: CoreKernels $(+ $kernels)* {}
        impl<T: CoreKernels $(+ $kernels)*> CustomKernels for T {}

        /// Calls the macro `$m` with every custom op type (how the op table makes each one an
        /// `Op`).
        macro_rules! with_custom_op_types {
            ($m:ident) => {
                $m!($($ty),*);
            };
        }
        pub(crate) use with_custom_op_types;

        impl OpFamily for CustomOp {
            fn name(&self) -> &'static str {
                match *self {
                    $(CustomOp::$variant(ref o) => o.name()),*
                }
            }
            fn arity(&self) -> (usize, usize) {
                match *self {
                    $(CustomOp::$variant(ref o) => o.arity()),*
                }
            }
            fn infer(
                &self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode,
            ) -> MetaResult<Inferred> {
                match *self {
                    $(CustomOp::$variant(ref o) => o.infer(shapes, dtypes, mode)),*
                }
            }
            fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
                match *self {
                    $(CustomOp::$variant(ref o) => o.local(at).map(CustomOp::$variant)),*
                }
            }
            fn view_of(&self) -> Option<ViewOf> {
                match *self {
                    $(CustomOp::$variant(ref o) => o.view_of()),*
                }
            }
            fn differentiable(&self, output: usize) -> bool {
                match *self {
                    $(CustomOp::$variant(ref o) => o.differentiable(output)),*
                }
            }
            fn saves(&self, needs: &[bool]) -> Saves {
                match *self {
                    $(CustomOp::$variant(ref o) => o.saves(needs)),*
                }
            }
            fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
                match *self {
                    $(CustomOp::$variant(ref o) => o.backward(g)),*
                }
            }
        }

        impl<B: CustomKernels> RunKernels<B> for CustomOp {
            fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
                match *self {
                    $(CustomOp::$variant(ref o) => o.run(b, x, out)),*
                }
            }
        }
    };
}

custom_ops! {
    // module::Variant(Type): KernelTrait,
    fused_elementwise::FusedElementwise(FusedElementwise): FusedElementwiseKernels,
}
