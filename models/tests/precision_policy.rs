//! A model given the precision policy (`Module::set_precision`): layers compute in its
//! `compute` dtype over master weights in its `param` dtype; a leaf in another dtype is a typed
//! error naming the parameter, and no parameter changes; a frozen leaf stored in the compute
//! dtype is accepted.

use oxiflow_dtype::{DType, MatmulPrecision, MixedPrecision};
use oxiflow_models::nn::{Module, Parameter};
use oxiflow_tensor::{Tensor, TensorError};

struct Two(Parameter, Parameter);

impl Module for Two {
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.0.clone(), self.1.clone()]
    }
}

fn two(second: DType) -> Two {
    Two(
        Parameter::new("a", &Tensor::randn([4, 3], 1, DType::F32)),
        Parameter::new("b", &Tensor::randn([3], 2, second)),
    )
}

#[test]
fn layers_compute_as_the_policy_says() {
    let m = two(DType::F32);
    m.set_precision(&MixedPrecision::bf16_mixed(DType::F32).unwrap())
        .unwrap();
    for p in m.parameters() {
        assert_eq!(
            (p.compute_dtype(), p.value().dtype()),
            (DType::BF16, DType::F32)
        );
        assert_eq!(p.compute().unwrap().dtype(), DType::BF16);
    }
    m.set_precision(&MixedPrecision::full(DType::F32).unwrap())
        .unwrap();
    for p in m.parameters() {
        assert_eq!(p.compute().unwrap().dtype(), DType::F32);
    }
}

#[test]
fn a_leaf_of_another_dtype_is_refused_and_nothing_changes() {
    let m = two(DType::F64);
    let policy = MixedPrecision::bf16_mixed(DType::F32).unwrap();
    match m.set_precision(&policy) {
        Err(TensorError::DType { op, detail, .. }) => {
            assert_eq!(op, "Parameter::set_precision");
            assert!(
                detail.contains("parameter b is f64") && detail.contains("param f32"),
                "{detail}"
            );
        }
        other => panic!("a f64 leaf under f32 master weights: {other:?}"),
    }
    assert_eq!(
        m.0.compute_dtype(),
        DType::F32,
        "a changed before b was refused"
    );
    let f64_compute_f32 =
        MixedPrecision::new(DType::F64, DType::F32, DType::F64, MatmulPrecision::F32).unwrap();
    assert!(m.set_precision(&f64_compute_f32).is_err(), "a is f32");
}

#[test]
fn a_frozen_leaf_stored_in_the_compute_dtype_is_accepted() {
    let m = two(DType::F32);
    let policy = MixedPrecision::bf16_mixed(DType::F32).unwrap();
    m.1.freeze();
    m.set_precision(&policy).unwrap();
    m.1.store_frozen_in_compute_dtype().unwrap();
    assert_eq!(m.1.value().dtype(), DType::BF16);
    m.set_precision(&policy).unwrap();
    assert_eq!(m.1.compute().unwrap().dtype(), DType::BF16);
}
