//! CPU boxing reads a tensor's storage in place: random transitions (1-d and 2-d meshes,
//! uneven and empty shards, P) through `to_global` give the reference value and leave the
//! input's pieces untouched; a transition that keeps the piece returns the same storage.

mod common;

use std::time::Duration;

use common::{assert_close, nd_sbp, placement};
use ndarray::ArrayD;
use oxiflow_tensor::{
    run_ranks, CpuArray, DType, DeviceType, NdSbp, Placement, Sbp, Storage, Tensor,
};
use proptest::prelude::*;

/// The host data address of a tensor's local piece.
fn host_ptr(t: &Tensor) -> *const f32 {
    match t.storage() {
        Some(Storage::Cpu(CpuArray::F32(a))) => a.as_ptr(),
        other => panic!("expected an f32 host piece, got {other:?}"),
    }
}

/// The local piece's values, bit for bit.
fn piece_bits(t: &Tensor) -> Vec<u32> {
    let a: ArrayD<f32> = t.to_local().to_ndarray().unwrap();
    a.iter().map(|v| v.to_bits()).collect()
}

struct Case {
    mesh: Vec<usize>,
    perm: u64,
    shape: Vec<usize>,
    in_seed: u64,
    out_seed: u64,
}

fn run_case(c: &Case) {
    let p: Placement = placement(&c.mesh, c.perm);
    let in_nd: NdSbp = nd_sbp(p.ndim(), c.shape.len(), c.in_seed, true);
    let out_nd: NdSbp = nd_sbp(p.ndim(), c.shape.len(), c.out_seed, true);
    let what = format!("{:?} on {p}: {in_nd} -> {out_nd}", c.shape);
    run_ranks(p.num_ranks(), Duration::from_secs(10), |rank| {
        let layout = oxiflow_tensor::GlobalLayout::new(c.shape.clone(), &p, in_nd.clone()).unwrap();
        let local_shape = layout.local_shape(rank).unwrap();
        // Pieces differ along S and P axes and are equal copies along B axes.
        let coord = p.coord_of(rank).unwrap();
        let seed = coord.iter().zip(in_nd.iter()).fold(7u64, |acc, (&c, s)| {
            acc * 16 + if s.is_broadcast() { 0 } else { c as u64 + 1 }
        });
        let mine = Tensor::randn(local_shape, seed, DType::F32);
        let x = mine.to_global_checked(&p, in_nd.clone()).unwrap();
        let before = piece_bits(&x);
        let want: ArrayD<f32> = x.to_ndarray().unwrap();
        let y = x.to_global(&p, out_nd.clone()).unwrap();
        let got: ArrayD<f32> = y.to_ndarray().unwrap();
        assert_close(&got, &want, &format!("rank {rank}: {what}"));
        assert_eq!(
            piece_bits(&x),
            before,
            "rank {rank}: boxing wrote into its input's piece: {what}"
        );
        assert_eq!(
            piece_bits(&mine),
            before,
            "rank {rank}: boxing wrote into the local tensor's storage: {what}"
        );
    });
}

fn mesh_strategy() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        (1usize..=5).prop_map(|n| vec![n]),
        prop::sample::select(vec![vec![2, 2], vec![2, 3], vec![3, 2], vec![1, 3]]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 64, ..ProptestConfig::default() })]
    #[test]
    fn boxing_matches_reference_and_keeps_input(
        mesh in mesh_strategy(),
        perm in any::<u64>(),
        shape in prop::collection::vec(0usize..=7, 1..=2),
        in_seed in any::<u64>(),
        out_seed in any::<u64>(),
    ) {
        run_case(&Case { mesh, perm, shape, in_seed, out_seed });
    }
}

#[test]
fn unchanged_piece_is_the_same_storage() {
    // On one rank S(0) -> B keeps every element where it is.
    let p = Placement::new(DeviceType::Cpu, vec![1], vec![0]).unwrap();
    run_ranks(1, Duration::from_secs(10), |_| {
        let x = Tensor::randn(vec![6, 5], 3, DType::F32)
            .to_global_checked(&p, Sbp::S(0))
            .unwrap();
        let y = x.to_global(&p, Sbp::B).unwrap();
        assert_eq!(y.nd_sbp().map(|s| s.to_string()), Some("B".into()));
        assert_eq!(host_ptr(&x), host_ptr(&y), "S(0) -> B on one rank copied");
    });
}

#[test]
fn changed_piece_is_new_storage() {
    // B -> S(0) on two ranks slices: each rank's output is new memory, the input unchanged.
    let p = Placement::new(DeviceType::Cpu, vec![2], vec![0, 1]).unwrap();
    run_ranks(2, Duration::from_secs(10), |_| {
        let x = Tensor::randn(vec![4, 3], 5, DType::F32)
            .to_global_checked(&p, Sbp::B)
            .unwrap();
        let before = piece_bits(&x);
        let y = x.to_global(&p, Sbp::S(0)).unwrap();
        assert_ne!(host_ptr(&x), host_ptr(&y));
        assert_eq!(piece_bits(&x), before);
    });
}
