//! The rotary embedding by tables against its composed definition `x cos + rotate_half(x) sin`
//! in f64 (value and the gradient of x through autograd), on one rank and on 1-d and 2-d meshes
//! with x split on the batch, the rows (the tables' rows split alike), the heads, broadcast or
//! partial; bf16 computed wide and rounded once; and the typed errors of tables that do not fit.

mod common;

use std::time::Duration;

use common::{close, nd_sbp_of, vals};

use oxiflow_ops::rotary::rotary_tables;
use oxiflow_placement::Placement;
use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Sbp, Tensor};
use proptest::prelude::*;

/// x `[b, t, h, d]`, tables `[t, 1, d]` of random angles (as a rope's: each half alike), and
/// loss weights like x.
fn operands(b: usize, t: usize, h: usize, d: usize, seed: u64) -> [Tensor; 4] {
    let half = d / 2;
    let angles = Tensor::randn([t, 1, half], seed, DType::F64)
        .to_vec::<f64>()
        .unwrap();
    let table = |f: fn(f64) -> f64| {
        let v: Vec<f64> = angles
            .chunks(half)
            .flat_map(|row| {
                row.iter()
                    .chain(row)
                    .map(|&a| f(3.0 * a))
                    .collect::<Vec<_>>()
            })
            .collect();
        Tensor::from_vec(v, [t, 1, d]).unwrap()
    };
    [
        Tensor::randn([b, t, h, d], seed + 1, DType::F64),
        table(f64::cos),
        table(f64::sin),
        Tensor::randn([b, t, h, d], seed + 2, DType::F64),
    ]
}

/// `x cos + rotate_half(x) sin` by element-wise ops.
fn composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.shape().dim(3) / 2;
    let (x1, x2) = (
        x.narrow(-1, 0, half).unwrap(),
        x.narrow(-1, half, half).unwrap(),
    );
    let rotated = Tensor::concat(&[&x2.neg().unwrap(), &x1], -1).unwrap();
    x.mul(cos).unwrap().add(&rotated.mul(sin).unwrap()).unwrap()
}

/// The value and x's gradient of `sum(f(x, cos, sin) * w)`.
fn outcome(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
    [x, c, s, w]: &[Tensor; 4],
) -> [Vec<f64>; 2] {
    let x = x.detach().requires_grad_(true);
    let y = f(&x, c, s);
    y.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
    [vals(&y), vals(&x.grad().unwrap())]
}

#[test]
fn the_fused_rotation_equals_the_composed_one() {
    for (b, t, h, d) in [(2, 5, 3, 8), (1, 1, 1, 2), (3, 7, 2, 64)] {
        let ops = operands(b, t, h, d, 5);
        let want = outcome(composed, &ops);
        let got = outcome(|x, c, s| rotary_tables(x, c, s).unwrap(), &ops);
        close(&got[0], &want[0], 1e-13, "y");
        close(&got[1], &want[1], 1e-13, "dx");
    }
}

#[test]
fn bf16_rotates_wide_and_rounds_once() {
    let [x, c, s, _] = operands(2, 6, 2, 16, 9);
    let low = |t: &Tensor| t.cast(DType::BF16).unwrap();
    let (xl, cl, sl) = (low(&x), low(&c), low(&s));
    let got = vals(&rotary_tables(&xl, &cl, &sl).unwrap());
    let wide = |t: &Tensor| t.cast(DType::F64).unwrap();
    let want = vals(&composed(&wide(&xl), &wide(&cl), &wide(&sl)));
    // One rounding to bf16 of the exact value: within half an ulp (2^-8 relative).
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= w.abs() * 2f64.powi(-8) + 1e-30,
            "{g} vs {w}"
        );
    }
}

/// The outcome on `mesh` with x laid out as `nd` and the tables whole, read on every rank.
fn on_mesh(mesh: &[usize], nd: &NdSbp, ops: &[Tensor; 4]) -> Vec<[Vec<f64>; 2]> {
    let n: usize = mesh.iter().product();
    let p = Placement::new(DeviceType::Cpu, mesh.to_vec(), (0..n).collect::<Vec<_>>()).unwrap();
    run_ranks(n, Duration::from_secs(30), |_| {
        let b = NdSbp::broadcast(p.ndim());
        let whole = |t: &Tensor| t.to_global(&p, b.clone()).unwrap();
        let x = whole(&ops[0]).to_global(&p, nd.clone()).unwrap();
        let on = [x, whole(&ops[1]), whole(&ops[2]), whole(&ops[3])];
        outcome(|x, c, s| rotary_tables(x, c, s).unwrap(), &on)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 16, ..ProptestConfig::default() })]
    #[test]
    fn every_layout_equals_one_rank(
        two_d in any::<bool>(),
        seed in 0u64..1000,
        (b, t, h, half) in (1usize..4, 1usize..7, 1usize..4, 1usize..5),
    ) {
        let ops = operands(b, t, h, 2 * half, seed);
        let want = outcome(composed, &ops);
        let mesh: Vec<usize> = if two_d { vec![2, 2] } else { vec![3] };
        let choices = [Sbp::S(0), Sbp::S(1), Sbp::S(2), Sbp::B, Sbp::P];
        let nd = nd_sbp_of(mesh.len(), seed, &choices);
        for (rank, got) in on_mesh(&mesh, &nd, &ops).into_iter().enumerate() {
            let what = format!("rank {rank} of {mesh:?} as {nd}, x [{b}, {t}, {h}, {}]", 2 * half);
            close(&got[0], &want[0], 1e-12, &format!("y, {what}"));
            close(&got[1], &want[1], 1e-12, &format!("dx, {what}"));
        }
    }
}

#[test]
fn tables_that_do_not_fit_are_typed_errors() {
    let [x, c, s, _] = operands(1, 4, 2, 8, 3);
    let short = c.narrow(0, 0, 3).unwrap();
    let e = rotary_tables(&x, &short, &short).unwrap_err().to_string();
    assert!(e.contains("do not fit"), "{e}");
    let e = rotary_tables(&x, &c, &s.cast(DType::F32).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("same dtype"), "{e}");
    let odd = Tensor::randn([1, 4, 2, 3], 1, DType::F64);
    let t3 = Tensor::randn([4, 1, 3], 1, DType::F64);
    let e = rotary_tables(&odd, &t3, &t3).unwrap_err().to_string();
    assert!(e.contains("even D"), "{e}");
}
