//! where, masked_fill, triu/tril and rotary: kernels against direct formulas, gradients
//! against finite differences, and global layouts (1-d and 2-d meshes, uneven splits, a split
//! of the rows, columns or sequence, P inputs where linear) against one rank.

mod common;

use common::{
    assert_each_op_matches_fd, boxed_from_b, nd_sbp, on_ranks, placed, randn_leaf, ranks_match,
    small_meshes_either_way, vals, weighted_sum, whole,
};
use oxiflow_tensor::{DType, NdSbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

fn t(v: Vec<f64>, shape: Vec<usize>) -> Tensor {
    Tensor::from_vec(v, shape).unwrap()
}

#[test]
fn where_and_masked_fill_match_the_formulas() {
    let a = t(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], vec![2, 3]);
    let b = t(vec![-1.0], vec![1]);
    let cond = Tensor::from_vec(vec![1i64, 0, 7], [3]).unwrap();
    assert_eq!(
        vals(&Tensor::where_cond(&cond, &a, &b).unwrap()),
        [1.0, -1.0, 3.0, 4.0, -1.0, 6.0]
    );
    let fcond = t(vec![0.0, 0.5], vec![2, 1]);
    assert_eq!(
        vals(&Tensor::where_cond(&fcond, &a, &b).unwrap()),
        [-1.0, -1.0, -1.0, 4.0, 5.0, 6.0]
    );
    assert_eq!(
        vals(&a.masked_fill(&cond, f64::NEG_INFINITY).unwrap()),
        [
            f64::NEG_INFINITY,
            2.0,
            f64::NEG_INFINITY,
            f64::NEG_INFINITY,
            5.0,
            f64::NEG_INFINITY
        ]
    );
    let ai = a.cast(DType::I64).unwrap();
    let filled = ai.masked_fill(&fcond, 9.0).unwrap();
    assert_eq!(
        filled
            .to_ndarray::<i64>()
            .unwrap()
            .into_raw_vec_and_offset()
            .0,
        [1, 2, 3, 9, 9, 9]
    );
    // Typed errors: values of two dtypes, shapes that do not broadcast.
    assert!(Tensor::where_cond(&cond, &a, &ai).is_err());
    assert!(Tensor::where_cond(&t(vec![1.0; 2], vec![2]), &a, &b).is_err());
    assert!(b.masked_fill(&cond, 0.0).is_err());
}

#[test]
fn triangles_match_the_formula() {
    let x = Tensor::randn([2, 3, 4], 1, F);
    let xv = vals(&x);
    for k in [-1i64, 0, 2, i64::MIN, i64::MAX] {
        let (u, l) = (vals(&x.triu(k).unwrap()), vals(&x.tril(k).unwrap()));
        for (i, &v) in xv.iter().enumerate() {
            let (r, c) = ((i / 4 % 3) as i128, (i % 4) as i128);
            let keep_u = c - r >= k as i128;
            assert_eq!(u[i], if keep_u { v } else { 0.0 }, "triu k={k} [{i}]");
            assert_eq!(
                l[i],
                if c - r <= k as i128 { v } else { 0.0 },
                "tril k={k} [{i}]"
            );
        }
    }
    assert!(t(vec![1.0; 3], vec![3]).triu(0).is_err());
}

/// The rotary formula on [T, D] rows at positions 0..T.
fn rotary_ref(x: &[f64], t_len: usize, d: usize, base: f64) -> Vec<f64> {
    let h = d / 2;
    let mut y = vec![0.0; x.len()];
    for p in 0..t_len {
        for i in 0..h {
            let a = p as f64 * base.powf(-2.0 * i as f64 / d as f64);
            let (u, v) = (x[p * d + i], x[p * d + i + h]);
            y[p * d + i] = u * a.cos() - v * a.sin();
            y[p * d + i + h] = u * a.sin() + v * a.cos();
        }
    }
    y
}

#[test]
fn rotary_matches_the_formula() {
    let x = Tensor::randn([5, 6], 2, F);
    let y = vals(&x.rotary(0, 100.0).unwrap());
    for (a, b) in y.iter().zip(rotary_ref(&vals(&x), 5, 6, 100.0)) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    // [T, heads, D] with the sequence on dim 0 equals each head rotated alone.
    let x3 = Tensor::randn([4, 2, 4], 3, F);
    let y3 = vals(&x3.rotary(0, 10.0).unwrap());
    let xv = vals(&x3);
    for head in 0..2 {
        let rows: Vec<f64> = (0..4)
            .flat_map(|p| xv[p * 8 + head * 4..p * 8 + head * 4 + 4].to_vec())
            .collect();
        let want = rotary_ref(&rows, 4, 4, 10.0);
        for p in 0..4 {
            for j in 0..4 {
                assert!((y3[p * 8 + head * 4 + j] - want[p * 4 + j]).abs() < 1e-12);
            }
        }
    }
    let f32y = x
        .cast(DType::F32)
        .unwrap()
        .rotary(0, 100.0)
        .unwrap()
        .cast(F)
        .unwrap();
    for (a, b) in vals(&f32y).iter().zip(&y) {
        assert!((a - b).abs() < 1e-5 * (1.0 + b.abs()));
    }
    // From a later first position: the rows of a longer rotation, in f64 and in 16 bits.
    let long = Tensor::randn([8, 6], 4, F);
    let tail = long.narrow(0, 3, 5).unwrap();
    let whole = vals(&long.rotary(0, 100.0).unwrap().narrow(0, 3, 5).unwrap());
    for dt in [F, DType::BF16, DType::F16] {
        let got = tail.cast(dt).unwrap().rotary_from(0, 100.0, 3).unwrap();
        let got = vals(&got.cast(F).unwrap());
        let tol = if dt == F { 1e-12 } else { 1e-2 };
        for (a, b) in got.iter().zip(&whole) {
            assert!((a - b).abs() < tol * (1.0 + b.abs()), "{dt}: {a} vs {b}");
        }
    }
    assert!(
        x.rotary(1, 100.0).is_err(),
        "the sequence dim cannot be the rotated dim"
    );
    assert!(
        Tensor::randn([3, 5], 1, F).rotary(0, 100.0).is_err(),
        "odd last dim"
    );
    assert!(x.rotary(0, -1.0).is_err());
    assert!(x.rotary(0, f64::NAN).is_err());
    assert!(x.cast(DType::I64).unwrap().rotary(0, 100.0).is_err());
}

/// sum(op(x) * r) for each op, a scalar whose gradient reaches every output element.
fn loss(which: usize, x: &Tensor, other: &Tensor, mask: &Tensor, r: &Tensor) -> Tensor {
    let y = match which {
        0 => Tensor::where_cond(mask, x, other).unwrap(),
        1 => Tensor::where_cond(mask, other, x).unwrap(),
        2 => x.masked_fill(mask, 0.5).unwrap(),
        3 => x.triu(1).unwrap(),
        4 => x.tril(-1).unwrap(),
        _ => x.rotary(0, 50.0).unwrap(),
    };
    weighted_sum(&y, r)
}

#[test]
fn gradients_match_finite_differences() {
    let other = Tensor::randn([3, 4], 8, F);
    let mask = Tensor::from_vec(vec![1i64, 0, 0, 1], [4]).unwrap();
    let r = Tensor::randn([3, 4], 9, F);
    assert_each_op_matches_fd((0..6).map(|_| Tensor::randn([3, 4], 7, F)), |which, x| {
        loss(which, x, &other, &mask, &r)
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn global_layouts_equal_one_rank(
        rows in 1usize..6,
        cols in 1usize..6,
        half in 1usize..3,
        k in -3i64..4,
        start in 0usize..5,
        fill_zero: bool,
        p in placed(small_meshes_either_way()),
        x_seed: u64,
        m_seed: u64,
    ) {
        let d = 2 * half;
        let shape = vec![rows, cols, d];
        let xs = nd_sbp(p.ndim(), 3, x_seed, true);
        let ms = nd_sbp(p.ndim(), 2, m_seed, false);
        let fill = if fill_zero { 0.0 } else { 1.5 };
        let mask_v: Vec<i64> = (0..cols * d).map(|i| (i as u64 * 5 + m_seed).is_multiple_of(3) as i64).collect();
        let seq = (x_seed % 2) as isize;
        let run = |x: &Tensor, other: &Tensor, mask: &Tensor, r: &[Tensor]| -> Vec<Tensor> {
            vec![
                x.masked_fill(mask, fill).unwrap(),
                Tensor::where_cond(mask, other, x).unwrap(),
                x.triu(k).unwrap(),
                x.tril(k).unwrap(),
                x.rotary_from(seq, 10.0, start).unwrap(),
            ]
            .into_iter()
            .zip(r)
            .map(|(y, r)| y.mul(r).unwrap())
            .collect()
        };
        let total = |ys: &[Tensor]| {
            ys.iter().fold(None::<Tensor>, |acc, y| {
                let s = y.sum_all().unwrap();
                Some(match acc { Some(a) => a.add(&s).unwrap(), None => s })
            }).unwrap()
        };
        let x = Tensor::randn(shape.clone(), 11, F).requires_grad_(true);
        let other = Tensor::randn(shape.clone(), 12, F);
        let mask = Tensor::from_vec(mask_v.clone(), [cols, d]).unwrap();
        let r: Vec<Tensor> = (0..5).map(|i| Tensor::randn(shape.clone(), 20 + i, F)).collect();
        let ys = run(&x, &other, &mask, &r);
        total(&ys).backward().unwrap();
        let mut want: Vec<Vec<f64>> = ys.iter().map(vals).collect();
        want.push(vals(&x.grad().unwrap()));
        let got = on_ranks(&p, |_| {
            let b = NdSbp::broadcast(p.ndim());
            let x = randn_leaf(shape.clone(), 11, &p, xs.clone());
            let other = Tensor::randn_global(shape.clone(), 12, F, &p, xs.clone()).unwrap();
            let mask = Tensor::from_vec(mask_v.clone(), [cols, d]).unwrap();
            let mask = boxed_from_b(&mask, &p, &ms);
            let r: Vec<Tensor> = (0..5)
                .map(|i| Tensor::randn_global(shape.clone(), 20 + i, F, &p, b.clone()).unwrap())
                .collect();
            let ys = run(&x, &other, &mask, &r);
            total(&ys).backward().unwrap();
            let all = |t: &Tensor| whole(t, &p);
            let mut got: Vec<Vec<f64>> = ys.iter().map(all).collect();
            got.push(all(&x.grad().unwrap()));
            got
        });
        prop_assert_eq!(ranks_match(&got, &want), Ok(()));
    }
}
