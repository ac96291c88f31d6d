//! `Tensor::start_read` against `to_vec`: a global value on any layout of 1-d and 2-d meshes
//! (uneven splits, P pieces, empty pieces) reads whole on every rank of the placement, the
//! same as `to_vec`; a local tensor reads itself; an element type other than the tensor's,
//! and a rank outside the placement, are typed errors before any communication.

use std::time::Duration;

use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Placement, Sbp, Tensor, TensorError};
use proptest::prelude::*;

fn sbp(code: usize) -> Sbp {
    match code {
        0 => Sbp::S(0),
        1 => Sbp::S(1),
        2 => Sbp::B,
        _ => Sbp::P,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn a_started_read_equals_to_vec_on_every_layout(
        rows in 0usize..7,
        cols in 1usize..5,
        two_d: bool,
        codes in proptest::collection::vec(0usize..4, 2),
        seed in 0u64..1000,
    ) {
        let got = run_ranks(4, Duration::from_secs(30), |_| {
            let p = if two_d {
                Placement::new(DeviceType::Cpu, vec![2, 2], vec![0, 1, 2, 3]).unwrap()
            } else {
                Placement::new_1d(DeviceType::Cpu, [0, 1, 2, 3]).unwrap()
            };
            let nd = NdSbp::new((0..p.ndim()).map(|a| sbp(codes[a])));
            let t = Tensor::randn_global([rows, cols], seed, DType::F64, &p, nd).unwrap();
            let pending = t.start_read::<f64>().unwrap();
            (pending.wait().unwrap(), t.to_vec::<f64>().unwrap())
        });
        for (read, whole) in &got {
            prop_assert_eq!(read, whole);
            prop_assert_eq!(read.len(), rows * cols);
        }
        prop_assert!(got.iter().all(|(r, _)| r == &got[0].0));
    }
}

#[test]
fn local_reads_and_refusals() {
    let t = Tensor::from_vec(vec![1i64, 2, 3], [3]).unwrap();
    assert_eq!(
        t.start_read::<i64>().unwrap().wait().unwrap(),
        vec![1, 2, 3]
    );
    assert!(matches!(
        t.start_read::<f64>(),
        Err(TensorError::DType {
            op: "start_read",
            ..
        })
    ));
    // Rank 2 is outside the placement: refused without communicating.
    let got = run_ranks(3, Duration::from_secs(30), |rank| {
        let p = Placement::new_1d(DeviceType::Cpu, [0, 1]).unwrap();
        let x = Tensor::from_vec(vec![1.0f64, 2.0], [2]).unwrap();
        let g = x.to_global(&p, NdSbp::new([Sbp::B]));
        match g {
            Ok(g) => match g.start_read::<f64>() {
                Ok(r) => Ok(r.wait().unwrap()),
                Err(e) => Err((rank, e.to_string())),
            },
            Err(e) => Err((rank, e.to_string())),
        }
    });
    assert_eq!(got[0], Ok(vec![1.0, 2.0]));
    assert_eq!(got[1], Ok(vec![1.0, 2.0]));
    assert!(got[2].is_err(), "{:?}", got[2]);
}
