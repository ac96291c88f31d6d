//! The one precision policy: [`MixedPrecision`] names the dtype of the master weights (and
//! the optimizer's state and gradients), the dtype layers compute in, the dtype gradients move
//! in between ranks, and how f32 matrix products run ([`MatmulPrecision`]); it is validated
//! once, when it is made, so every holder of one holds a combination the engine runs.
//!
//! ```
//! use oxiflow_dtype::{DType, MatmulPrecision, MixedPrecision};
//! let p = MixedPrecision::new(DType::F32, DType::BF16, DType::F32, MatmulPrecision::F32)?;
//! assert!(p.is_mixed());
//! assert!(MixedPrecision::new(DType::F32, DType::F64, DType::F32, MatmulPrecision::F32).is_err());
//! # Ok::<(), oxiflow_dtype::PrecisionError>(())
//! ```

use std::fmt;

use crate::DType;

/// How f32 matrix products run (products of other dtypes run as they are).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MatmulPrecision {
    /// f32 inputs, f32 accumulation (equal to the CPU up to summation order).
    #[default]
    F32,
    /// f32 inputs and outputs on TF32 tensor cores (inputs rounded to 10 mantissa bits).
    Tf32,
    /// Inputs rounded to bf16 (nearest even), f32 accumulation and output.
    Bf16,
}

impl MatmulPrecision {
    /// Every matmul precision.
    pub const ALL: [MatmulPrecision; 3] = [
        MatmulPrecision::F32,
        MatmulPrecision::Tf32,
        MatmulPrecision::Bf16,
    ];

    /// The name errors, logs and explain output use (`"tf32"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            MatmulPrecision::F32 => "f32",
            MatmulPrecision::Tf32 => "tf32",
            MatmulPrecision::Bf16 => "bf16",
        }
    }
}

named_by_as_str!(MatmulPrecision, UnknownMatmulPrecision);

/// A matmul precision name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown matmul precision {name:?} (known: f32, tf32, bf16)")]
pub struct UnknownMatmulPrecision {
    pub name: String,
}

/// A combination of dtypes [`MixedPrecision::new`] refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "precision policy (param {param}, compute {compute}, reduce {reduce}, matmul {matmul}) \
     refused: {reason}"
)]
pub struct PrecisionError {
    pub param: DType,
    pub compute: DType,
    pub reduce: DType,
    pub matmul: MatmulPrecision,
    pub reason: &'static str,
}

/// The precision policy of a model and its optimizer (FSDP2's `MixedPrecisionPolicy`).
/// Fields are read through the methods; a value exists only for a combination
/// [`MixedPrecision::new`] accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MixedPrecision {
    param: DType,
    compute: DType,
    reduce: DType,
    matmul: MatmulPrecision,
}

impl MixedPrecision {
    /// The policy, or a typed error naming the combination and the rule it breaks:
    /// - `param` (master weights, their gradients and the optimizer's state) is f32 or f64;
    /// - `compute` is a float no wider than `param`, and not f16 (which needs loss scaling);
    /// - `reduce` is a float dtype;
    /// - `matmul` other than f32 only where layers compute in f32 (it is about f32 products).
    pub fn new(
        param: DType,
        compute: DType,
        reduce: DType,
        matmul: MatmulPrecision,
    ) -> Result<MixedPrecision, PrecisionError> {
        let refuse = |reason| PrecisionError {
            param,
            compute,
            reduce,
            matmul,
            reason,
        };
        if !matches!(param, DType::F32 | DType::F64) {
            return Err(refuse(
                "the master weights (param) are f32 or f64: the optimizer updates them",
            ));
        }
        if !compute.is_float() {
            return Err(refuse("layers compute in a float dtype"));
        }
        if compute == DType::F16 {
            return Err(refuse(
                "f16 compute needs loss scaling, which the optimizer does not do (use bf16)",
            ));
        }
        if compute.size() > param.size() {
            return Err(refuse(
                "layers compute in a dtype no wider than the master weights",
            ));
        }
        if !reduce.is_float() {
            return Err(refuse("gradients move in a float dtype"));
        }
        if matmul != MatmulPrecision::F32 && compute != DType::F32 {
            return Err(refuse(
                "a matmul precision other than f32 is about f32 products: layers must compute \
                 in f32",
            ));
        }
        Ok(MixedPrecision {
            param,
            compute,
            reduce,
            matmul,
        })
    }

    /// Everything in `dtype` (f32 or f64), f32 products exact.
    pub fn full(dtype: DType) -> Result<MixedPrecision, PrecisionError> {
        MixedPrecision::new(dtype, dtype, dtype, MatmulPrecision::F32)
    }

    /// Master weights, gradients and optimizer state in `param`; layers compute with bf16
    /// copies of the parameters.
    pub fn bf16_mixed(param: DType) -> Result<MixedPrecision, PrecisionError> {
        MixedPrecision::new(param, DType::BF16, param, MatmulPrecision::F32)
    }

    /// This policy with gradients moving as `reduce`.
    pub fn with_reduce(self, reduce: DType) -> Result<MixedPrecision, PrecisionError> {
        MixedPrecision::new(self.param, self.compute, reduce, self.matmul)
    }

    /// This policy with f32 products run as `matmul`.
    pub fn with_matmul(self, matmul: MatmulPrecision) -> Result<MixedPrecision, PrecisionError> {
        MixedPrecision::new(self.param, self.compute, self.reduce, matmul)
    }

    /// The dtype of the master weights, their gradients and the optimizer's state.
    pub const fn param(&self) -> DType {
        self.param
    }
    /// The dtype layers compute in (parameters' compute copies and activations).
    pub const fn compute(&self) -> DType {
        self.compute
    }
    /// The dtype gradients move in between ranks.
    pub const fn reduce(&self) -> DType {
        self.reduce
    }
    /// How f32 matrix products run.
    pub const fn matmul(&self) -> MatmulPrecision {
        self.matmul
    }
    /// Whether layers compute in another dtype than the master weights'.
    pub fn is_mixed(&self) -> bool {
        self.compute != self.param
    }
}

impl fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "param {}, compute {}, reduce {}, matmul {}",
            self.param, self.compute, self.reduce, self.matmul
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dtype() -> impl Strategy<Value = DType> {
        proptest::sample::select(DType::ALL.to_vec())
    }
    fn matmul() -> impl Strategy<Value = MatmulPrecision> {
        proptest::sample::select(MatmulPrecision::ALL.to_vec())
    }

    #[test]
    fn the_named_policies_and_refusals() {
        let mixed = MixedPrecision::bf16_mixed(DType::F32).unwrap();
        assert_eq!(
            (
                mixed.param(),
                mixed.compute(),
                mixed.reduce(),
                mixed.matmul()
            ),
            (DType::F32, DType::BF16, DType::F32, MatmulPrecision::F32)
        );
        assert!(mixed.is_mixed() && !MixedPrecision::full(DType::F64).unwrap().is_mixed());
        let tf32 = MixedPrecision::full(DType::F32)
            .and_then(|p| p.with_matmul(MatmulPrecision::Tf32))
            .unwrap();
        assert_eq!(
            tf32.to_string(),
            "param f32, compute f32, reduce f32, matmul tf32"
        );
        let e = MixedPrecision::full(DType::F64)
            .and_then(|p| p.with_matmul(MatmulPrecision::Tf32))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "precision policy (param f64, compute f64, reduce f64, matmul tf32) refused: a \
             matmul precision other than f32 is about f32 products: layers must compute in f32"
        );
        assert!(MixedPrecision::full(DType::BF16).is_err());
        assert!(mixed.with_reduce(DType::I64).is_err());
        assert_eq!(
            mixed.with_reduce(DType::BF16).map(|p| p.reduce()),
            Ok(DType::BF16)
        );
        for m in MatmulPrecision::ALL {
            assert_eq!(m.as_str().parse::<MatmulPrecision>(), Ok(m));
        }
        assert!("fp8".parse::<MatmulPrecision>().is_err());
    }

    proptest! {
        /// A combination is accepted exactly when it keeps every rule, and the value holds the
        /// fields it was made of; a refusal names the whole combination.
        #[test]
        fn accepted_exactly_when_every_rule_holds(
            param in dtype(), compute in dtype(), reduce in dtype(), mm in matmul()
        ) {
            let rules = matches!(param, DType::F32 | DType::F64)
                && compute.is_float()
                && compute != DType::F16
                && compute.size() <= param.size()
                && reduce.is_float()
                && (mm == MatmulPrecision::F32 || compute == DType::F32);
            match MixedPrecision::new(param, compute, reduce, mm) {
                Ok(p) => {
                    prop_assert!(rules);
                    prop_assert_eq!(
                        (p.param(), p.compute(), p.reduce(), p.matmul()),
                        (param, compute, reduce, mm)
                    );
                    prop_assert_eq!(p.is_mixed(), compute != param);
                }
                Err(e) => {
                    prop_assert!(!rules);
                    let want = format!(
                        "(param {param}, compute {compute}, reduce {reduce}, matmul {mm})"
                    );
                    prop_assert!(e.to_string().contains(&want), "{}", e);
                }
            }
        }
    }
}
