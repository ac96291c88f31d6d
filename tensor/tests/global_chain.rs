//! Property test: random chains of 1-5 ops on global tensors with random shapes (even and
//! uneven), placements (1-d up to 8 ranks, 2-d meshes, permuted ranks, a rank outside) and input
//! nd-SBPs (incl. P), run on in-process ranks, gathered, and compared with the same chain on
//! whole local arrays.

mod common;

use std::time::Duration;

use common::{assert_close, nd_sbp, placement};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Placement, Tensor, UnaryOp};
use proptest::prelude::*;

/// One step of a chain; operands and attributes come from `param` and the current shape, so
/// every rank (and the reference) builds the same op.
fn apply(x: &Tensor, id: u8, param: u64, make: &dyn Fn(&[usize], u64) -> Tensor) -> Tensor {
    let shape = x.shape().dims().to_vec();
    let nd = shape.len();
    let d = (param % nd as u64) as usize;
    let di = d as isize;
    let as_2d = |t: &Tensor| -> Tensor {
        let s = t.shape().dims().to_vec();
        let last = s[s.len() - 1];
        t.reshape([s.iter().product::<usize>() / last.max(1), last])
            .unwrap()
    };
    // Integer ids in 0..n from a float operand (sigmoid in (0, 1), scaled, truncated).
    let ids = |s: &[usize], n: usize, param: u64| -> Tensor {
        make(s, param)
            .sigmoid()
            .unwrap()
            .scale(n as f64 - 0.01)
            .unwrap()
            .cast(DType::I64)
            .unwrap()
    };
    match id % 27 {
        0 => x.relu().unwrap(),
        1 => x.gelu().unwrap(),
        2 => x.tanh().unwrap().scale(1.5).unwrap(),
        3 => x.sigmoid().unwrap().neg().unwrap(),
        4 => x.add(&make(&shape, param)).unwrap(),
        5 => {
            // Broadcast a trailing-dims operand.
            let tail = &shape[d..];
            x.mul(&make(tail, param)).unwrap()
        }
        6 if nd > 1 => x.sum(&[di], param.is_multiple_of(2)).unwrap(),
        7 if nd > 1 => x.mean(&[di], param % 2 == 1).unwrap(),
        8 if nd > 1 => x.max(&[di], param.is_multiple_of(2)).unwrap(),
        9 => x.softmax(di).unwrap(),
        10 => x.log_softmax(di).unwrap(),
        11 if nd > 1 => x.transpose(0, -1).unwrap(),
        12 if nd > 1 => {
            let mut s = shape.clone();
            let last = s.pop().unwrap();
            let l = s.len() - 1;
            s[l] *= last;
            x.reshape(s).unwrap()
        }
        13 if shape[d] > 1 => {
            let start = (param / 7) as usize % shape[d];
            let len = 1 + (param / 61) as usize % (shape[d] - start);
            x.narrow(di, start, len).unwrap()
        }
        14 => Tensor::concat(&[x, &make(&shape, param)], di).unwrap(),
        15 => {
            let n = 1 + (param % 5) as usize;
            let w = make(&[shape[nd - 1], n], param);
            x.matmul(&w).unwrap()
        }
        16 => {
            let h = shape[nd - 1];
            x.layer_norm(&make(&[h], param), &make(&[h], param + 1), 0.1)
                .unwrap()
        }
        // Re-box to another nd-SBP (the identity on the value).
        17 => match x.placement().cloned() {
            Some(p) => x.to_global(&p, nd_sbp(p.ndim(), nd, param, true)).unwrap(),
            None => x.clone(),
        },
        18 => make(&shape, param)
            .unary_backward(UnaryOp::Gelu, x)
            .unwrap(),
        19 => Tensor::softmax_backward(&x.softmax(di).unwrap(), &make(&shape, param), di).unwrap(),
        20 if d > 0 => x.sum_to_shape(shape[d..].to_vec()).unwrap(),
        21 => {
            let l = as_2d(x);
            let (n, c) = (l.shape().dim(0), l.shape().dim(1));
            l.cross_entropy(&ids(&[n], c, param)).unwrap()
        }
        22 => {
            let lead = &shape[..nd - 1];
            let i = ids(if lead.is_empty() { &shape } else { lead }, 5, param);
            Tensor::embedding(&i, &make(&[5, 3], param)).unwrap()
        }
        23 if nd > 1 => {
            let i = ids(&shape[..nd - 1], 4, param);
            Tensor::embedding_backward(&i, x, 4).unwrap()
        }
        24 => {
            let h = shape[nd - 1];
            Tensor::layer_norm_backward(x, &make(&[h], param), &make(&shape, param + 1), 0.1)
                .unwrap()
        }
        25 => {
            let l = as_2d(x);
            let (n, c) = (l.shape().dim(0), l.shape().dim(1));
            Tensor::cross_entropy_backward(&l, &ids(&[n], c, param), &make(&[n], param + 3))
                .unwrap()
        }
        26 => {
            // A run of the flattened elements (a view where the backend shares memory).
            let n: usize = shape.iter().product();
            let start = (param / 7) as usize % n.max(1);
            let len = (param / 61) as usize % (n - start.min(n) + 1);
            x.reshape([n]).unwrap().elements(start, len).unwrap()
        }
        _ if nd == 3 => x.bmm(&make(&[shape[0], shape[2], 2], param)).unwrap(),
        _ => x.unary(UnaryOp::Abs).unwrap(),
    }
}

struct Case {
    mesh: Vec<usize>,
    perm: u64,
    extra_rank: bool,
    shape: Vec<usize>,
    sbp_seed: u64,
    ops: Vec<(u8, u64)>,
}

fn run_case(c: &Case) {
    let p: Placement = placement(&c.mesh, c.perm);
    let world = p.num_ranks() + usize::from(c.extra_rank);
    let in_nd: NdSbp = nd_sbp(p.ndim(), c.shape.len(), c.sbp_seed, true);
    // Reference: the whole input (the sum of the rank summands for P inputs) and the chain on it.
    let results = run_ranks(world, Duration::from_secs(5), |rank| {
        // Each rank's local summand/piece; its shape is what the layout gives this rank.
        let layout = oxiflow_tensor::GlobalLayout::new(c.shape.clone(), &p, in_nd.clone()).unwrap();
        let local_shape = layout
            .local_shape(rank)
            .unwrap_or_else(|| oxiflow_tensor::Shape::new(vec![1; c.shape.len()]));
        // Pieces differ along S and P axes and are equal copies along B axes.
        let coord = p.coord_of(rank).unwrap_or_default();
        let seed = coord
            .iter()
            .zip(in_nd.iter())
            .fold(1000u64, |acc, (&c, s)| {
                acc * 16 + if s.is_broadcast() { 0 } else { c as u64 + 1 }
            });
        let mine = Tensor::randn(local_shape, seed, DType::F32);
        let x = mine.to_global_checked(&p, in_nd.clone()).unwrap();
        let sbp_seed = c.sbp_seed;
        let make_global = |s: &[usize], param: u64| -> Tensor {
            let nd = nd_sbp(p.ndim(), s.len(), param ^ sbp_seed, false);
            Tensor::randn_global(s.to_vec(), param, DType::F32, &p, nd).unwrap()
        };
        let mut y = x.clone();
        for &(id, param) in &c.ops {
            y = apply(&y, id, param, &make_global);
        }
        if !p.contains(rank) {
            return None;
        }
        let whole_in = x.to_ndarray::<f32>().unwrap();
        let got = y.to_ndarray::<f32>().unwrap();
        Some((whole_in, got, y.nd_sbp().map(|s| s.to_string())))
    });
    let make_local = |s: &[usize], param: u64| Tensor::randn(s.to_vec(), param, DType::F32);
    let mut first = None;
    for (rank, r) in results.into_iter().enumerate() {
        let Some((whole_in, got, sbp)) = r else {
            continue;
        };
        let mut y = Tensor::from_array(whole_in);
        for &(id, param) in &c.ops {
            y = apply(&y, id, param, &make_local);
        }
        let want = y.to_ndarray::<f32>().unwrap();
        let what = format!(
            "rank {rank}: {:?} on {p} input {in_nd} shape {:?} sbp_seed {} -> out {sbp:?}",
            c.ops, c.shape, c.sbp_seed
        );
        assert_close(&got, &want, &what);
        if first.is_none() {
            first = Some(got);
        }
    }
}

fn mesh_strategy() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        (1usize..=8).prop_map(|n| vec![n]),
        prop::sample::select(vec![
            vec![2, 2],
            vec![2, 3],
            vec![3, 2],
            vec![2, 4],
            vec![1, 3],
            vec![4, 2]
        ]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 64, ..ProptestConfig::default() })]
    #[test]
    fn chains_match_single_rank(
        mesh in mesh_strategy(),
        perm in any::<u64>(),
        extra_rank in prop::bool::weighted(0.2),
        shape in prop::collection::vec(1usize..7, 2..=3),
        sbp_seed in any::<u64>(),
        ops in prop::collection::vec((any::<u8>(), any::<u64>()), 1..=5),
    ) {
        run_case(&Case { mesh, perm, extra_rank, shape, sbp_seed, ops });
    }
}

#[test]
fn matmul_s0_by_b_gives_s0_and_reuses_cache() {
    let p = placement(&[2], 0);
    run_ranks(2, Duration::from_secs(10), |_| {
        let a = Tensor::randn_global([5, 4], 1, DType::F32, &p, oxiflow_tensor::Sbp::S(0)).unwrap();
        let b = Tensor::randn_global([4, 3], 2, DType::F32, &p, oxiflow_tensor::Sbp::B).unwrap();
        let c = a.matmul(&b).unwrap();
        assert_eq!(c.nd_sbp().unwrap().to_string(), "S(0)");
        assert_eq!(c.shape().dims(), &[5, 3]);
        let n = a.context().unwrap().dispatch_cache_len();
        let _ = a.matmul(&b).unwrap();
        assert_eq!(a.context().unwrap().dispatch_cache_len(), n);
        let want = Tensor::randn([5, 4], 1, DType::F32)
            .matmul(&Tensor::randn([4, 3], 2, DType::F32))
            .unwrap();
        assert_close(
            &c.to_ndarray::<f32>().unwrap(),
            &want.to_ndarray::<f32>().unwrap(),
            "matmul",
        );
        // sum over the split dim gives P; mean scales by the global count.
        let s = a.sum(&[0], false).unwrap();
        assert_eq!(s.nd_sbp().unwrap().to_string(), "P");
        let m = a.mean(&[0], false).unwrap().to_ndarray::<f32>().unwrap();
        let wm = Tensor::randn([5, 4], 1, DType::F32)
            .mean(&[0], false)
            .unwrap()
            .to_ndarray::<f32>()
            .unwrap();
        assert_close(&m, &wm, "mean");
    });
}

#[test]
fn regression_embedding_then_reshape() {
    for mesh in [vec![2], vec![3]] {
        run_case(&Case {
            mesh,
            perm: 0,
            extra_rank: false,
            shape: vec![2, 2, 5],
            sbp_seed: 0,
            ops: vec![(126, 7145810785902933612), (38, 17526325042091489005)],
        });
    }
}
