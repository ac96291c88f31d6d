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
    match id % 17 {
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
        6 if nd > 1 => x.sum(&[di], param % 2 == 0).unwrap(),
        7 if nd > 1 => x.mean(&[di], param % 2 == 1).unwrap(),
        8 if nd > 1 => x.max(&[di], param % 2 == 0).unwrap(),
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
            x.layer_norm(&make(&[h], param), &make(&[h], param + 1), 1e-5)
                .unwrap()
        }
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
    let results = run_ranks(world, Duration::from_secs(20), |rank| {
        // Each rank's local summand/piece; its shape is what the layout gives this rank.
        let layout = oxiflow_tensor::GlobalLayout::new(c.shape.clone(), &p, in_nd.clone()).unwrap();
        let local_shape = layout
            .local_shape(rank)
            .unwrap_or_else(|| oxiflow_tensor::Shape::new(vec![1; c.shape.len()]));
        let mine = Tensor::randn(local_shape, 1000 + rank as u64, DType::F32);
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
            "rank {rank}: {:?} on {p} input {in_nd} shape {:?} -> out {sbp:?}",
            c.ops, c.shape
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
    #![proptest_config(ProptestConfig::with_cases(64))]
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
