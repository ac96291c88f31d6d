//! Writing over a tensor's memory, on the host: who holds a tensor's data
//! (`Tensor::data_held_only_by`: clones, tensors over the same piece, extra holds of the piece,
//! a device graph's `BoundPiece`, global tensors and ranks outside their placement).

mod common;

use std::time::Duration;

use oxiflow_tensor::capture::piece_of;
use oxiflow_tensor::{run_ranks, BoundPiece, DType, DeviceType, Placement, Sbp, Tensor};

#[test]
fn data_held_only_by_counts_every_reference() {
    let t = Tensor::randn([3, 4], 1, DType::F32);
    assert!(Tensor::data_held_only_by(&[&t]));
    // Listed twice but held once: some listed reference does not exist.
    assert!(!Tensor::data_held_only_by(&[&t, &t]));
    let c = t.clone();
    assert!(!Tensor::data_held_only_by(&[&t]), "a clone holds it");
    assert!(Tensor::data_held_only_by(&[&t, &c]));
    drop(c);
    let d = t.detach();
    assert!(t.shares_piece(&d));
    assert!(
        !Tensor::data_held_only_by(&[&t]),
        "a detached tensor shares the piece"
    );
    assert!(Tensor::data_held_only_by(&[&t, &d]));
    drop(d);
    let other = Tensor::randn([3, 4], 2, DType::F32);
    assert!(!t.shares_piece(&other));
    assert!(
        !Tensor::data_held_only_by(&[&t, &other]),
        "the listed tensors must be over one piece"
    );
    let extra = piece_of(&t).cloned();
    assert!(
        !Tensor::data_held_only_by(&[&t]),
        "another hold of the piece"
    );
    drop(extra);
    let bound = BoundPiece::new(piece_of(&t).cloned().unwrap());
    let bound_twice = BoundPiece::new(piece_of(&t).cloned().unwrap());
    assert!(
        Tensor::data_held_only_by(&[&t]),
        "a device graph's binding does not count"
    );
    drop(bound);
    assert!(Tensor::data_held_only_by(&[&t]));
    drop(bound_twice);
    assert!(Tensor::data_held_only_by(&[&t]));
    assert!(Tensor::data_held_only_by(&[]));
}

#[test]
fn data_held_only_by_on_global_tensors() {
    let out = run_ranks(2, Duration::from_secs(60), |rank| {
        let pl = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
        let t = Tensor::randn_global([6, 3], 4, DType::F32, &pl, Sbp::S(0)).unwrap();
        let alone = Tensor::data_held_only_by(&[&t]);
        let local = t.to_local();
        let with_local = Tensor::data_held_only_by(&[&t]);
        let both = Tensor::data_held_only_by(&[&t, &local]);
        // A tensor placed on rank 0 only has no piece on rank 1: nothing to write there.
        let only0 = Placement::new_1d(DeviceType::Cpu, vec![0]).unwrap();
        let elsewhere = Tensor::randn_global([2], 5, DType::F32, &only0, Sbp::B).unwrap();
        let held = Tensor::data_held_only_by(&[&elsewhere]);
        Ok::<_, oxiflow_tensor::TensorError>((rank, alone, with_local, both, held))
    });
    for r in out {
        let (rank, alone, with_local, both, held) = r.unwrap();
        assert!(alone && !with_local && both, "rank {rank}");
        assert!(held, "rank {rank}: a tensor of its own or without a piece");
    }
}
