//! A backward rule that adds an input's gradient so far into its own (`Grad::take_partial`: a
//! linear layer's input gradient as the C operand of its product, a LayerNorm's as its
//! backward kernel's residual gradient) gives the gradients of the add it saves: an input
//! shared by three linear layers (the Q, K and V projections) and a LayerNorm with learned
//! parameters, with other consumers before and after them and an input used twice by one op, in f64, local
//! and on meshes (data- and tensor-parallel layouts, 2 ranks and 2x2), against the sum of
//! each consumer's gradient from its own backward pass.

mod common;

use std::time::Duration;

use common::{assert_vals_close, boxed_from_b, ordered_placement, vals};
use oxiflow_ops::linear::linear;
use oxiflow_ops::linear::Activation;
use oxiflow_tensor::{run_ranks, DType, NdSbp, Sbp, Tensor};

const F: DType = DType::F64;

/// The parameters: three (w, b) pairs of [8, 8] and [8], and a readout per output.
fn params() -> Vec<Tensor> {
    (0..3)
        .flat_map(|i| {
            [
                Tensor::randn([8, 8], 10 + i, F),
                Tensor::randn([8], 20 + i, F),
                Tensor::randn([4, 6, 8], 30 + i, F),
            ]
        })
        .collect()
}

/// The loss of `x` through consumer `which` (all when None): a LayerNorm, x*x, the three
/// linears, then x itself again.
fn loss(x: &Tensor, p: &[Tensor], which: Option<usize>) -> Tensor {
    let on = |i: usize| which.is_none_or(|w| w == i);
    let mut terms = Vec::new();
    if on(5) {
        let w = Tensor::randn([8], 40, F).requires_grad_(true);
        let b = Tensor::randn([8], 41, F).requires_grad_(true);
        let (w, b) = match x.placement() {
            Some(p) => {
                let all_b = NdSbp::broadcast(p.ndim());
                (
                    w.to_global(p, all_b.clone()).unwrap(),
                    b.to_global(p, all_b).unwrap(),
                )
            }
            None => (w, b),
        };
        let y = x.layer_norm(&w, &b, 1e-5).unwrap();
        terms.push(y.mul(&p[2]).unwrap().sum_all().unwrap());
    }
    if on(0) {
        terms.push(x.mul(x).unwrap().sum_all().unwrap());
    }
    for i in 0..3 {
        if on(i + 1) {
            let y = linear(x, &p[3 * i], Some(&p[3 * i + 1]), Activation::None).unwrap();
            terms.push(y.mul(&p[3 * i + 2]).unwrap().sum_all().unwrap());
        }
    }
    if on(4) {
        terms.push(x.mul_scalar(3.0).unwrap().sum_all().unwrap());
    }
    terms.into_iter().reduce(|a, b| a.add(&b).unwrap()).unwrap()
}

/// x's gradient through every consumer at once, and the sum of each consumer's own.
fn grads(x: &Tensor, p: &[Tensor]) -> (Vec<f64>, Vec<f64>) {
    let fresh = || x.detach().requires_grad_(true);
    let joint = fresh();
    loss(&joint, p, None).backward().unwrap();
    let joint = vals(&joint.grad().unwrap());
    let mut sum = vec![0.0; joint.len()];
    for which in 0..6 {
        let xi = fresh();
        loss(&xi, p, Some(which)).backward().unwrap();
        for (s, g) in sum.iter_mut().zip(vals(&xi.grad().unwrap())) {
            *s += g;
        }
    }
    (joint, sum)
}

#[test]
fn a_shared_input_s_gradient_equals_the_sum_of_its_consumers_gradients() {
    let x = Tensor::randn([4, 6, 8], 1, F);
    let (joint, sum) = grads(&x, &params());
    assert_vals_close(&joint, &sum, "local");
    // Meshes: x split on the batch (data parallel) or broadcast with the weights split on
    // their output features (tensor parallel: x's gradient partial), on 2 ranks and 2x2.
    let cases: [(&[usize], NdSbp, [NdSbp; 3]); 3] = [
        (
            &[2],
            NdSbp::new([Sbp::S(0)]),
            [
                NdSbp::new([Sbp::B]),
                NdSbp::new([Sbp::B]),
                NdSbp::new([Sbp::S(0)]),
            ],
        ),
        (
            &[2],
            NdSbp::new([Sbp::B]),
            [
                NdSbp::new([Sbp::S(1)]),
                NdSbp::new([Sbp::S(0)]),
                NdSbp::new([Sbp::S(2)]),
            ],
        ),
        (
            &[2, 2],
            NdSbp::new([Sbp::S(0), Sbp::B]),
            [
                NdSbp::new([Sbp::B, Sbp::S(1)]),
                NdSbp::new([Sbp::B, Sbp::S(0)]),
                NdSbp::new([Sbp::S(0), Sbp::S(2)]),
            ],
        ),
    ];
    for (mesh, sx, [sw, sb, sr]) in cases {
        let ranks: usize = mesh.iter().product();
        let got = run_ranks(ranks, Duration::from_secs(30), |_| {
            let pl = ordered_placement(mesh);
            let g = |t: &Tensor, s: &NdSbp| boxed_from_b(t, &pl, s);
            let p: Vec<Tensor> = params()
                .iter()
                .enumerate()
                .map(|(i, t)| g(t, [&sw, &sb, &sr][i % 3]))
                .collect();
            grads(&g(&Tensor::randn([4, 6, 8], 1, F), &sx), &p)
        });
        for (j, s) in got {
            assert_vals_close(&j, &s, &format!("{mesh:?} x {sx:?} w {sw:?}"));
            assert_vals_close(
                &j,
                &sum,
                &format!("{mesh:?} x {sx:?} w {sw:?} against local"),
            );
        }
    }
}
