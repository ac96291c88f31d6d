//! Device worlds' seats at rendezvous, without a GPU: the launch path's decision
//! (`DeviceSeat::for_rank`, given a probe's device count or why NCCL is missing) and the join
//! (`join_world_seated`) on real stores with one thread per rank. Two ranks of a host on one
//! GPU (a pipeline's stages, a mesh larger than the GPUs bound round-robin), a rank bound past
//! the visible GPUs, and NCCL missing refuse the job on every rank, each with a
//! `CommError::Mismatch` naming the job's refusal, before any rank leaves the join.

use std::time::{Duration, Instant};

use oxiflow_collectives::rendezvous::{
    generate_token, join_world_seated, DeviceSeat, StoreClient, StoreServer,
};
use oxiflow_collectives::CommError;

const T: Duration = Duration::from_secs(20);

/// Joins `seats.len()` ranks (rank r taking `seats[r]`) on a fresh store; each rank's result.
fn join(seats: Vec<DeviceSeat>) -> Vec<Result<(), CommError>> {
    let token = generate_token().unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), token.clone()).unwrap();
    let addr = server.local_addr().to_string();
    let world = seats.len();
    let handles: Vec<_> = seats
        .into_iter()
        .enumerate()
        .map(|(rank, seat)| {
            let (addr, token) = (addr.clone(), token.clone());
            std::thread::spawn(move || {
                let store = StoreClient::connect(&addr, &token, T).unwrap();
                let who = format!("thread of rank {rank}");
                join_world_seated(&store, rank, world, &who, T, Some(&seat))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Every rank failed with a `Mismatch` containing each of `want`, within a few seconds.
fn all_refused(results: &[Result<(), CommError>], want: &[&str]) {
    for (rank, r) in results.iter().enumerate() {
        match r {
            Err(e @ CommError::Mismatch { .. }) => {
                let text = e.to_string();
                for w in want {
                    assert!(text.contains(w), "rank {rank}: no {w:?} in {text}");
                }
            }
            other => panic!("rank {rank}: {other:?}, not a refusal"),
        }
    }
}

/// The seats of `ranks` ranks of one host bound to `ordinal(r)`, with `visible` from the probe.
fn seats(
    ranks: usize,
    ordinal: impl Fn(usize) -> usize,
    visible: Result<usize, String>,
) -> Vec<DeviceSeat> {
    (0..ranks)
        .map(|r| DeviceSeat::for_rank("host-a".into(), ordinal(r), visible.clone(), ranks))
        .collect()
}

#[test]
fn seats_follow_the_probe() {
    let seat = DeviceSeat::for_rank("h".into(), 1, Ok(2), 2);
    assert_eq!(seat.device, Ok(1));
    let past = DeviceSeat::for_rank("h".into(), 2, Ok(2), 4)
        .device
        .unwrap_err();
    assert!(past.contains("bound to CUDA device 2 but 2 device(s) are visible (4 local ranks)"));
    let missing = DeviceSeat::for_rank("h".into(), 0, Err("no libnccl.so.2".into()), 2);
    assert_eq!(
        missing.device,
        Err("NCCL is unavailable (no libnccl.so.2)".to_string())
    );
}

#[test]
fn one_rank_per_gpu_joins() {
    let t = Instant::now();
    for r in join(seats(2, |r| r, Ok(2))) {
        r.unwrap();
    }
    // The same ordinals on two hosts are two GPUs.
    let two_hosts = (0..2)
        .map(|r| DeviceSeat::for_rank(format!("host-{r}"), 0, Ok(1), 1))
        .collect();
    for r in join(two_hosts) {
        r.unwrap();
    }
    assert!(t.elapsed() < T);
}

#[test]
fn pipeline_stages_on_one_gpu_are_refused_on_every_rank() {
    let t = Instant::now();
    let results = join(seats(2, |_| 0, Ok(2)));
    all_refused(&results, &["both use CUDA device 0", "one GPU per rank"]);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn a_mesh_larger_than_the_gpus_is_refused_on_every_rank() {
    // A [pp 2, dp 2] mesh of 4 ranks on a host with 2 GPUs, bound round-robin (as oflaunch
    // binds), and the same 4 ranks bound one per ordinal.
    let results = join(seats(4, |r| r % 2, Ok(2)));
    all_refused(&results, &["both use CUDA device", "one GPU per rank"]);
    let results = join(seats(4, |r| r, Ok(2)));
    all_refused(
        &results,
        &[
            "but 2 device(s) are visible (4 local ranks)",
            "one GPU per rank",
        ],
    );
}

#[test]
fn a_device_world_without_nccl_is_refused_on_every_rank() {
    let results = join(seats(3, |r| r, Err("libnccl.so.2: not found".into())));
    all_refused(
        &results,
        &["cannot join: NCCL is unavailable (libnccl.so.2: not found)"],
    );
    // One rank without NCCL among ranks that have it: the others are refused too.
    let mut mixed = seats(3, |r| r, Ok(3));
    mixed[2] = DeviceSeat::for_rank("host-a".into(), 2, Err("no libnccl".into()), 3);
    all_refused(
        &join(mixed),
        &["rank 2 (thread of rank 2) cannot join: NCCL is unavailable"],
    );
}
