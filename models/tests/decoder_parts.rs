//! The decoder family's parts against direct computations in f64: the rotary embedding's table
//! form equals the fused op (values and gradients) and is consistent across start positions
//! (what a decoding step uses); repeating key/value heads for grouped-query attention copies
//! head `j / group` and its backward sums each head's copies; llama3 and linear scaling of the
//! rotary frequencies as transformers defines them.

use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{repeat_heads, Arch, Positions, Rope, RopeScaling};
use oxiflow_tensor::Tensor;

fn values(n: usize, seed: u64) -> Tensor {
    Tensor::try_randn([n], seed, DType::F64).unwrap()
}

fn rope(scaling: RopeScaling) -> Rope {
    let arch = Arch {
        positions: Positions::Rotary {
            theta: 500.0,
            scaling,
        },
        ..Arch::gpt2()
    };
    Rope::new(&arch, 8).unwrap()
}

fn close(a: &Tensor, b: &Tensor, tol: f64) {
    let (a, b) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(worst <= tol, "differ by {worst:e}");
}

#[test]
fn the_table_form_equals_the_fused_rotary_op_with_gradients() {
    let (b, t, h, d) = (2, 7, 3, 8);
    let x = values(b * t * h * d, 1).reshape([b, t, h, d]).unwrap();
    let w = values(b * t * h * d, 2).reshape([b, t, h, d]).unwrap();
    let run = |r: &Rope| {
        let x = x.detach().requires_grad_(true);
        let y = r.apply(&x, 0).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        (y.detach(), x.grad().unwrap())
    };
    // A linear scaling by 1 keeps the frequencies but takes the table form.
    let (fused, g_fused) = run(&rope(RopeScaling::None));
    let (table, g_table) = run(&rope(RopeScaling::Linear { factor: 1.0 }));
    close(&fused, &table, 1e-14);
    close(&g_fused, &g_table, 1e-14);
}

#[test]
fn a_later_start_rotates_as_those_positions_of_a_window_from_zero() {
    let (t, h, d) = (9, 2, 8);
    let x = values(t * h * d, 3).reshape([1, t, h, d]).unwrap();
    for scaling in [
        RopeScaling::None,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 16,
        },
    ] {
        let r = rope(scaling);
        let whole = r.apply(&x, 0).unwrap().narrow(1, 4, 5).unwrap();
        let tail = r.apply(&x.narrow(1, 4, 5).unwrap(), 4).unwrap();
        close(&whole, &tail, 1e-14);
    }
}

#[test]
fn repeated_heads_copy_each_group_and_sum_their_gradients() {
    let (b, t, g, d, group) = (2, 3, 2, 4, 3);
    let x = values(b * t * g * d, 4)
        .reshape([b, t, g, d])
        .unwrap()
        .requires_grad_(true);
    let y = repeat_heads(&x, group, &x).unwrap();
    assert_eq!(y.shape().dims(), &[b, t, g * group, d]);
    let (xv, yv) = (x.to_vec::<f64>().unwrap(), y.to_vec::<f64>().unwrap());
    let w = values(b * t * g * group * d, 5);
    let wv = w.to_vec::<f64>().unwrap();
    let at = |bt: usize, head: usize, k: usize, heads: usize| (bt * heads + head) * d + k;
    let mut want = vec![0.0; xv.len()];
    for bt in 0..b * t {
        for j in 0..g * group {
            for k in 0..d {
                assert_eq!(yv[at(bt, j, k, g * group)], xv[at(bt, j / group, k, g)]);
                want[at(bt, j / group, k, g)] += wv[at(bt, j, k, g * group)];
            }
        }
    }
    y.mul(&w.reshape([b, t, g * group, d]).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let got = x.grad().unwrap().to_vec::<f64>().unwrap();
    for (a, e) in got.iter().zip(&want) {
        assert!((a - e).abs() < 1e-14, "{got:?} vs {want:?}");
    }
}

#[test]
fn scaled_frequencies_follow_transformers_formulas() {
    let f = |i: usize| 1.0 / 10000f64.powf(2.0 * i as f64 / 8.0);
    assert_eq!(RopeScaling::Linear { factor: 2.0 }.apply(f(1)), f(1) / 2.0);
    let l3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_positions: 16,
    };
    // Wavelengths 2 pi / f: 6.28 (between 16 / 4 and 16 / 1: blended), 62.8 and up (beyond
    // 16: divided by the factor).
    let smooth = (16.0 / (2.0 * std::f64::consts::PI / f(0)) - 1.0) / 3.0;
    let blended = (1.0 - smooth) * f(0) / 8.0 + smooth * f(0);
    assert!((l3.apply(f(0)) - blended).abs() < 1e-16);
    assert_eq!(l3.apply(f(1)), f(1) / 8.0);
    // A wavelength below 16 / 4 is kept.
    assert_eq!(l3.apply(2.0), 2.0);
}
