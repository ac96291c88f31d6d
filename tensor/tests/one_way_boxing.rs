//! `to_global` between disjoint placements (pipeline stages) is one-way: the sending ranks
//! return without waiting for the receivers, which may receive later and in several rounds;
//! the received values are the sent ones, for a change of SBP and of mesh shape too.

use std::time::{Duration, Instant};

use oxiflow_placement::DeviceType;
use oxiflow_tensor::{run_ranks, DType, NdSbp, Placement, Sbp, Tensor};

const TIMEOUT: Duration = Duration::from_secs(30);
/// How long the receivers sleep before their first receive.
const LATE: Duration = Duration::from_millis(400);

#[test]
fn senders_do_not_wait_for_late_receivers() {
    let src = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
    let dst = Placement::new_1d(DeviceType::Cpu, vec![2, 3, 4, 5])
        .unwrap()
        .reshaped([2, 2])
        .unwrap();
    let shape = [4, 6];
    let rounds = 3u64;
    let got = run_ranks(6, TIMEOUT, |rank| {
        let mut out = Vec::new();
        let start = Instant::now();
        if rank >= 2 {
            std::thread::sleep(LATE);
        }
        for seed in 0..rounds {
            let x = Tensor::randn_global(shape, seed, DType::F64, &src, Sbp::S(0)).unwrap();
            let y = x.to_global(&dst, NdSbp::new([Sbp::S(1), Sbp::B])).unwrap();
            if rank >= 2 {
                out.push(y.to_ndarray::<f64>().unwrap());
            }
        }
        (start.elapsed(), out)
    });
    for (rank, (elapsed, values)) in got.iter().enumerate() {
        if rank < 2 {
            assert!(
                *elapsed < LATE / 2,
                "sender {rank} waited {elapsed:?} for receivers that came after {LATE:?}"
            );
            continue;
        }
        assert!(*elapsed >= LATE);
        for (seed, v) in values.iter().enumerate() {
            let want = Tensor::randn(shape, seed as u64, DType::F64)
                .to_ndarray::<f64>()
                .unwrap();
            assert_eq!(v, &want, "rank {rank} round {seed}");
        }
    }
}
