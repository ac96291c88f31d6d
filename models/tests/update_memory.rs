//! Who holds a parameter's memory, as an optimizer asks before writing an update over it
//! (`Parameter::leaf_memory_free_for`, `Parameter::copy_memory_free`): the parameter's own
//! handles and the caller's update view do not count; a clone of the value, a detached view, a
//! value the parameter was set from, a pending prefetch's leaf, a held compute copy and an
//! autograd graph's saved tensors do. A live loss does not pin the leaf (graphs hold leaves
//! weakly), and a leaf nobody holds gets no gradient, without an error.

use oxiflow_dtype::DType;
use oxiflow_models::nn::Parameter;
use oxiflow_tensor::Tensor;

fn param() -> Parameter {
    Parameter::new("w", &Tensor::randn([4, 3], 1, DType::F32))
}

#[test]
fn the_parameters_own_handles_and_the_update_view_do_not_count() {
    let p = param();
    let view = p.value();
    assert!(p.leaf_memory_free_for(&view));
    let clone = p.value();
    assert!(!p.leaf_memory_free_for(&view), "a clone of the value");
    drop(clone);
    assert!(p.leaf_memory_free_for(&view));
    let detached = view.detach();
    assert!(
        !p.leaf_memory_free_for(&view),
        "a tensor over the same piece"
    );
    drop(detached);
    // A view of its own memory (a shard, say) counts alone.
    let own = Tensor::randn([4, 3], 2, DType::F32);
    assert!(p.leaf_memory_free_for(&own));
    let other = own.clone();
    assert!(!p.leaf_memory_free_for(&own));
    drop(other);
    // A value the parameter was set from shares its piece.
    let t = Tensor::randn([4, 3], 3, DType::F32);
    p.set_value(&t).unwrap();
    assert!(
        !p.leaf_memory_free_for(&p.value()),
        "the caller still holds t"
    );
    drop(t);
    assert!(p.leaf_memory_free_for(&p.value()));
}

#[test]
fn a_compute_copy_is_free_only_while_the_parameter_alone_holds_it() {
    let p = param();
    p.set_compute_dtype(Some(DType::BF16));
    assert!(p.copy_memory_free().is_none(), "no copy yet");
    let made = p.ensure_compute_copy().unwrap().unwrap();
    assert!(p.copy_memory_free().is_none(), "the caller holds the copy");
    drop(made);
    let copy = p
        .copy_memory_free()
        .expect("the copy is the parameter's alone");
    drop(copy);
    // The copy pair's leaf handle is the parameter's own.
    assert!(p.leaf_memory_free_for(&p.value()));
    // A forward pass's saved copy pins it until the backward pass releases it.
    // x's gradient needs the weight: the product saves the copy's view.
    let x = Tensor::randn([2, 4], 4, DType::BF16).requires_grad_(true);
    let loss = x.matmul(&p.compute().unwrap()).unwrap().sum_all().unwrap();
    assert!(
        p.copy_memory_free().is_none(),
        "saved for the backward pass"
    );
    loss.backward().unwrap();
    assert!(
        p.copy_memory_free().is_some(),
        "released by the backward pass"
    );
    assert!(
        p.leaf_memory_free_for(&p.value()),
        "the live loss's graph holds the leaf weakly"
    );
    assert!(p.grad().is_some());
    drop(loss);
}

#[test]
fn a_leaf_nobody_holds_gets_no_gradient_and_no_error() {
    let w = Tensor::randn([3, 2], 5, DType::F64).requires_grad_(true);
    let x = Tensor::randn([4, 3], 6, DType::F64).requires_grad_(true);
    let y = x.matmul(&w).unwrap().sum_all().unwrap();
    drop(w);
    y.backward().unwrap();
    assert!(x.grad().is_some(), "the held leaf's gradient is there");
}
