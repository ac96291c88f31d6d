//! TCP backend with real processes on loopback: this test binary re-runs itself as the ranks
//! (the `worker_entry` test, selected by `OXF_MP_ROLE=worker`), with the launch contract's
//! variables set and the rendezvous store served by the test process. Random collective
//! sequences must match the reference; a rank that dies or never arrives must be named.

mod multiprocess_common;
mod process_world;

use std::process::Output;
use std::time::{Duration, Instant};

use multiprocess_common::{run_rank, Case, DTYPES};
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::{init_world, CommError, DType, ReduceOp};
use process_world::{assert_all_ok, run_worker, var, World};
use proptest::prelude::*;

/// What a worker does once connected (chosen by `OXF_MP_MODE`).
fn worker() -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let victim: usize = var("OXF_MP_VICTIM").parse().unwrap_or(usize::MAX);
    let comm = init_world(&env);
    let mode = var("OXF_MP_MODE");
    if mode == "absent-bootstrap" {
        // The victim was never started: everyone must fail naming it.
        return match comm {
            Err(CommError::Timeout { missing, .. }) if missing.contains(&victim) => Ok(()),
            other => Err(format!(
                "expected a bootstrap timeout naming {victim}, got {:?}",
                other.err()
            )),
        };
    }
    let comm = comm.map_err(|e| format!("init_world: {e}"))?;
    match mode.as_str() {
        "case" => {
            let case = Case::from_vars(env.world_size);
            run_rank(&comm, &case)
        }
        "early" => {
            // Member 0 receives everything; rank 1 finishes its part (posting or sending its
            // piece) and exits at once, while rank 2 arrives late. Rank 1 leaving is no failure.
            let n = 4096;
            let counts = [n, 0, 0];
            let send: Vec<f32> = (0..n).map(|i| (i % 7) as f32 + env.rank as f32).collect();
            let send: Vec<u8> = send.iter().flat_map(|v| v.to_ne_bytes()).collect();
            let mut recv = vec![0u8; if env.rank == 0 { n * 4 } else { 0 }];
            if env.rank == 2 {
                std::thread::sleep(Duration::from_millis(400));
            }
            comm.reduce_scatter_v(
                DType::F32,
                (&send[..]).into(),
                (&mut recv[..]).into(),
                &counts,
                ReduceOp::Sum,
            )
            .map_err(|e| format!("rank {}: {e}", env.rank))?;
            if env.rank == 0 {
                let want: Vec<u8> = (0..n)
                    .flat_map(|i| (3.0 * (i % 7) as f32 + 3.0).to_ne_bytes())
                    .collect();
                if recv != want {
                    return Err("rank 0: wrong reduce-scatter result".into());
                }
            }
            Ok(())
        }
        "die" | "absent" => {
            // A first collective succeeds; then the victim exits (or stalls) mid-job.
            let mut b = vec![1u8; 1 << 20];
            comm.all_reduce(DType::I64, (&mut b[..]).into(), ReduceOp::Max)
                .map_err(|e| e.to_string())?;
            if env.rank == victim {
                if mode == "die" {
                    std::process::exit(0);
                }
                std::thread::sleep(env.timeout * 3);
                return Ok(());
            }
            let start = Instant::now();
            let mut big = vec![0u8; 8 << 20];
            let r = comm.all_reduce(DType::F32, (&mut big[..]).into(), ReduceOp::Sum);
            let took = start.elapsed();
            // Stay alive a moment so this rank's own exit is not what the others observe
            // (a failing rank closing its sockets is a second, later fault).
            std::thread::sleep(Duration::from_millis(1500));
            match r {
                Err(CommError::PeerLost { rank, .. }) if rank == victim && mode == "die" => Ok(()),
                Err(CommError::Timeout { missing, .. })
                    if missing == vec![victim] && took < env.timeout * 2 =>
                {
                    Ok(())
                }
                other => Err(format!(
                    "rank {}: expected an error naming {victim}, got {other:?} after {took:?}",
                    env.rank
                )),
            }
        }
        m => Err(format!("unknown mode {m:?}")),
    }
}

#[test]
fn worker_entry() {
    if run_worker("OXF_MP_ROLE", worker) {
        return;
    }
    // Not a worker: a world of one process must run a case without any peers.
    let env = LaunchEnv::from_vars(|_| None).unwrap();
    let comm = init_world(&env).unwrap();
    run_rank(&comm, &Case::generate(7, 1, DType::F64, 10, 30)).unwrap();
}

/// Starts `world` ranks (skipping `skip`) with the launch variables and `extra`, and waits.
fn spawn_world(
    world: usize,
    skip: Option<usize>,
    timeout_s: f64,
    extra: &[(&str, String)],
) -> Vec<(usize, Output)> {
    let world_procs = World::new(world);
    let timeout = timeout_s.to_string();
    let children = (0..world)
        .filter(|r| Some(*r) != skip)
        .map(|r| {
            let mut c = world_procs.rank("worker_entry", r, &timeout);
            c.env("OXF_MP_ROLE", "worker");
            for (k, v) in extra {
                c.env(k, v);
            }
            (r, c.spawn().unwrap())
        })
        .collect();
    world_procs.wait(children)
}

/// The variables of mode `case`: `steps` random collectives of at most `max` elements of
/// dtype `dt`, from `seed`.
fn case(seed: u64, dt: usize, steps: usize, max: usize) -> [(&'static str, String); 5] {
    [
        ("OXF_MP_MODE", "case".into()),
        ("OXF_MP_SEED", seed.to_string()),
        ("OXF_MP_DTYPE", dt.to_string()),
        ("OXF_MP_STEPS", steps.to_string()),
        ("OXF_MP_MAX", max.to_string()),
    ]
}

/// The variables of a failure `mode` whose victim is rank `rank`.
fn victim(mode: &str, rank: usize) -> [(&'static str, String); 2] {
    [
        ("OXF_MP_MODE", mode.into()),
        ("OXF_MP_VICTIM", rank.to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]
    #[test]
    fn processes_match_reference(seed in any::<u64>(), world in 1usize..=6, dt in 0usize..DTYPES) {
        let outs = spawn_world(world, None, 30.0, &case(seed, dt, 10, 3000));
        assert_all_ok(&outs, &format!("seed {seed} world {world} dtype {dt}"));
    }
}

#[test]
fn large_pieces_across_processes() {
    // Large counts exercise the reduce-scatter + all-gather path and socket back-pressure.
    let outs = spawn_world(3, None, 60.0, &case(11, 0, 12, 400_000));
    assert_all_ok(&outs, "large pieces");
}

#[test]
fn a_rank_that_finishes_early_is_not_lost() {
    // Rank 1 exits right after its part while rank 0 still waits for rank 2: its closed
    // connection must not be taken for a lost peer (shared memory and TCP planes).
    for shm in ["1", "0"] {
        let outs = spawn_world(
            3,
            None,
            5.0,
            &[("OXF_MP_MODE", "early".into()), ("OXIFLOW_SHM", shm.into())],
        );
        assert_all_ok(&outs, &format!("early exit (OXIFLOW_SHM={shm})"));
    }
}

#[test]
fn a_rank_that_dies_is_named() {
    let start = Instant::now();
    let outs = spawn_world(4, None, 5.0, &victim("die", 2));
    assert_all_ok(&outs, "die");
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_rank_that_stalls_is_named_within_the_timeout() {
    let outs = spawn_world(3, None, 1.5, &victim("absent", 1));
    assert_all_ok(&outs, "absent");
}

#[test]
fn a_rank_that_never_starts_is_named() {
    let start = Instant::now();
    let outs = spawn_world(3, Some(2), 1.5, &victim("absent-bootstrap", 2));
    assert_all_ok(&outs, "absent at bootstrap");
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn worker_failures_reach_the_parent() {
    // Guards the harness itself: a worker that fails must show up as a failed process.
    let outs = spawn_world(2, None, 5.0, &[("OXF_MP_MODE", "no-such-mode".into())]);
    for (r, o) in &outs {
        assert!(!o.status.success(), "rank {r} should have failed");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("unknown mode"),
            "rank {r}"
        );
    }
}
