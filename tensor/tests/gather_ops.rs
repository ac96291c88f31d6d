//! min, gather, index_select, scatter_add and index_add: kernels against direct formulas,
//! gradients against finite differences, and global layouts (1-d and 2-d meshes, uneven
//! splits, the addressed dim split, P inputs) against one rank.

mod common;

use common::{
    assert_each_op_matches_fd, boxed_from_b, nd_sbp, on_ranks, placed, randn_leaf, ranks_match,
    small_meshes_either_way, vals, weighted_sum, whole,
};
use oxiflow_tensor::{DType, NdSbp, Tensor};
use proptest::prelude::*;

const F: DType = DType::F64;

/// `n` integers in `0..hi` from `seed`.
fn ints(seed: u64, n: usize, hi: usize) -> Vec<i64> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % hi.max(1) as u64) as i64
        })
        .collect()
}

fn index(data: Vec<i64>, shape: Vec<usize>) -> Tensor {
    Tensor::from_vec(data, shape).unwrap()
}

#[test]
fn min_matches_the_formula_and_routes_the_gradient_to_the_minima() {
    let x = Tensor::from_vec(vec![3.0, -1.0, 2.0, 5.0, 4.0, 4.0], [2, 3])
        .unwrap()
        .requires_grad_(true);
    assert_eq!(vals(&x.min(&[1], false).unwrap()), [-1.0, 4.0]);
    assert_eq!(vals(&x.min(&[0], true).unwrap()), [3.0, -1.0, 2.0]);
    let i = x.cast(DType::I64).unwrap().min(&[0, 1], false).unwrap();
    assert_eq!(
        i.to_ndarray::<i64>().unwrap().into_raw_vec_and_offset().0,
        [-1]
    );
    x.min(&[1], false)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // The tie at row 1 shares the gradient.
    assert_eq!(vals(&x.grad().unwrap()), [0.0, 1.0, 0.0, 0.0, 0.5, 0.5]);
    assert!(x.min(&[2], false).is_err());
}

#[test]
fn reads_and_scatters_match_the_formulas() {
    let x = Tensor::randn([3, 4], 1, F);
    let xv = vals(&x);
    // gather along dim 1: out[i][j] = x[i][idx[i][j]].
    let idx = ints(2, 6, 4);
    let g = vals(&x.gather(1, &index(idx.clone(), vec![3, 2])).unwrap());
    for i in 0..3 {
        for j in 0..2 {
            assert_eq!(g[i * 2 + j], xv[i * 4 + idx[i * 2 + j] as usize]);
        }
    }
    // gather along dim 0: out[i][j] = x[idx[i][j]][j].
    let idx0 = ints(3, 8, 3);
    let g0 = vals(&x.gather(0, &index(idx0.clone(), vec![2, 4])).unwrap());
    for i in 0..2 {
        for j in 0..4 {
            assert_eq!(g0[i * 4 + j], xv[idx0[i * 4 + j] as usize * 4 + j]);
        }
    }
    // index_select along dim 1 with repeats.
    let ids = vec![3i64, 0, 3];
    let s = x.index_select(-1, &index(ids.clone(), vec![3])).unwrap();
    assert_eq!(s.shape().dims(), [3, 3]);
    let sv = vals(&s);
    for i in 0..3 {
        for (j, &c) in ids.iter().enumerate() {
            assert_eq!(sv[i * 3 + j], xv[i * 4 + c as usize]);
        }
    }
    // scatter_add and index_add accumulate repeated indices.
    let src = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [2, 2]).unwrap();
    let sc = Tensor::scatter_add(&index(vec![1, 1, 0, 2], vec![2, 2]), &src, 1, 3).unwrap();
    assert_eq!(vals(&sc), [0.0, 3.0, 0.0, 3.0, 0.0, 4.0]);
    let ia = Tensor::index_add(&index(vec![2, 2], vec![2]), &src, 0, 3).unwrap();
    assert_eq!(vals(&ia), [0.0, 0.0, 0.0, 0.0, 4.0, 6.0]);
    // Typed errors: out-of-range indices, float indices, mismatched shapes.
    assert!(x
        .gather(1, &index(vec![4, 0, 0, 0, 0, 0], vec![3, 2]))
        .is_err());
    assert!(x
        .gather(1, &index(vec![-1, 0, 0, 0, 0, 0], vec![3, 2]))
        .is_err());
    assert!(x.gather(1, &Tensor::zeros([3, 2], F)).is_err());
    assert!(x.gather(1, &index(vec![0; 4], vec![2, 2])).is_err());
    assert!(x.index_select(0, &index(vec![0; 4], vec![2, 2])).is_err());
    assert!(x.index_select(0, &index(vec![3], vec![1])).is_err());
}

/// sum(op(x) * r) for one of the four ops, a scalar whose gradient reaches every output.
fn loss(which: usize, x: &Tensor, idx: &Tensor, r: &Tensor) -> Tensor {
    let y = match which {
        0 => x.gather(1, idx).unwrap(),
        1 => x.index_select(0, idx).unwrap(),
        2 => Tensor::scatter_add(idx, x, 1, 5).unwrap(),
        _ => Tensor::index_add(idx, x, 0, 4).unwrap(),
    };
    weighted_sum(&y, r)
}

#[test]
fn gradients_match_finite_differences() {
    let cases: [(Vec<usize>, Tensor, Vec<usize>); 4] = [
        (vec![3, 4], index(ints(4, 6, 4), vec![3, 2]), vec![3, 2]),
        (vec![3, 4], index(vec![2, 0, 2, 1], vec![4]), vec![4, 4]),
        (vec![2, 3], index(ints(5, 6, 5), vec![2, 3]), vec![2, 5]),
        (vec![3, 2], index(vec![1, 3, 1], vec![3]), vec![4, 2]),
    ];
    let rs: Vec<Tensor> = cases
        .iter()
        .map(|(_, _, ys)| Tensor::randn(ys.clone(), 7, F))
        .collect();
    assert_each_op_matches_fd(
        cases
            .iter()
            .map(|(xs, _, _)| Tensor::randn(xs.clone(), 6, F)),
        |which, x| loss(which, x, &cases[which].1, &rs[which]),
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn global_layouts_equal_one_rank(
        rows in 1usize..6,
        cols in 1usize..7,
        k in 1usize..5,
        dim in 0usize..2,
        p in placed(small_meshes_either_way()),
        x_seed: u64,
        i_seed: u64,
    ) {
        let xs = nd_sbp(p.ndim(), 2, x_seed, true);
        let is = nd_sbp(p.ndim(), 2, i_seed, false);
        let ids_sbp = nd_sbp(p.ndim(), 1, i_seed >> 7, false);
        let (extent, ishape) = if dim == 0 { (rows, vec![k, cols]) } else { (cols, vec![rows, k]) };
        let gidx = ints(i_seed, k * ishape[1 - dim], extent);
        let sel = ints(i_seed ^ 1, k, extent);
        let r_g = Tensor::randn(ishape.clone(), 13, F);
        let mut sel_shape = vec![rows, cols];
        sel_shape[dim] = k;
        let r_s = Tensor::randn(sel_shape.clone(), 14, F);
        let r_m = Tensor::randn([cols], 15, F);
        // The one-rank reference: values and x's gradient of gather, index_select and min.
        let x = Tensor::randn([rows, cols], 11, F).requires_grad_(true);
        let gi = index(gidx.clone(), ishape.clone());
        let si = index(sel.clone(), vec![k]);
        let y_g = x.gather(dim as isize, &gi).unwrap();
        let y_s = x.index_select(dim as isize, &si).unwrap();
        let y_m = x.min(&[0], false).unwrap();
        let total = |g: &Tensor, s: &Tensor, m: &Tensor, rg: &Tensor, rs: &Tensor, rm: &Tensor| {
            g.mul(rg).unwrap().sum_all().unwrap()
                .add(&s.mul(rs).unwrap().sum_all().unwrap()).unwrap()
                .add(&m.mul(rm).unwrap().sum_all().unwrap()).unwrap()
        };
        total(&y_g, &y_s, &y_m, &r_g, &r_s, &r_m).backward().unwrap();
        let want: Vec<Vec<f64>> =
            vec![vals(&y_g), vals(&y_s), vals(&y_m), vals(&x.grad().unwrap())];
        let got = on_ranks(&p, |_| {
            let b = NdSbp::broadcast(p.ndim());
            let x = randn_leaf([rows, cols], 11, &p, xs.clone());
            let gi = boxed_from_b(&index(gidx.clone(), ishape.clone()), &p, &is);
            let si = boxed_from_b(&index(sel.clone(), vec![k]), &p, &ids_sbp);
            let rg = Tensor::randn_global(ishape.clone(), 13, F, &p, b.clone()).unwrap();
            let rs = Tensor::randn_global(sel_shape.clone(), 14, F, &p, b.clone()).unwrap();
            let rm = Tensor::randn_global([cols], 15, F, &p, b.clone()).unwrap();
            let y_g = x.gather(dim as isize, &gi).unwrap();
            let y_s = x.index_select(dim as isize, &si).unwrap();
            let y_m = x.min(&[0], false).unwrap();
            total(&y_g, &y_s, &y_m, &rg, &rs, &rm).backward().unwrap();
            let all = |t: &Tensor| whole(t, &p);
            vec![all(&y_g), all(&y_s), all(&y_m), all(&x.grad().unwrap())]
        });
        prop_assert_eq!(ranks_match(&got, &want), Ok(()));
    }
}
