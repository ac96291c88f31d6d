//! Both data planes of the CPU backend with real processes: same-host ranks over shared memory
//! (the default), TCP only (`OXIFLOW_SHM=0`), and a mixed world where one rank opts out (its
//! groups fall back to TCP while the others keep shared memory). Workers check which plane is
//! mapped (/proc/self/maps) and run random collective cases against the reference; afterwards
//! no segment of these workers may be left in /dev/shm.

mod multiprocess_common;
mod process_world;

use std::process::Output;

use multiprocess_common::{run_rank, Case, DTYPES};
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::init_world;
use process_world::{assert_all_ok, run_worker, var, World};

fn mapped_segments() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("/dev/shm/oxiflow-"))
        .count()
}

fn worker() -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let comm = init_world(&env).map_err(|e| format!("init_world: {e}"))?;
    let want: usize = var("OXF_SHM_EXPECT_MAPS").parse().unwrap();
    let got = mapped_segments();
    if got != want {
        return Err(format!(
            "rank {}: {got} shared segments mapped, expected {want}",
            env.rank
        ));
    }
    let case = Case::from_vars(env.world_size);
    run_rank(&comm, &case)
}

/// Starts `world` ranks; `shm_off` lists ranks started with OXIFLOW_SHM=0, `maps[r]` the
/// number of segments rank r must have mapped.
fn spawn(
    world: usize,
    shm_off: &[usize],
    maps: &[usize],
    seed: u64,
    max: usize,
    pids: &mut Vec<u32>,
) -> Vec<(usize, Output)> {
    let procs = World::new(world);
    let children = (0..world)
        .map(|r| {
            let mut c = procs.rank("shm_worker_entry", r, "30");
            c.env("OXF_SHM_ROLE", "worker")
                .env("OXIFLOW_SHM", if shm_off.contains(&r) { "0" } else { "1" })
                .env("OXF_SHM_EXPECT_MAPS", maps[r].to_string())
                .env("OXF_MP_SEED", seed.to_string())
                .env("OXF_MP_DTYPE", (seed % DTYPES as u64).to_string())
                .env("OXF_MP_STEPS", "14")
                .env("OXF_MP_MAX", max.to_string());
            let child = c.spawn().unwrap();
            pids.push(child.id());
            (r, child)
        })
        .collect();
    procs.wait(children)
}

/// Segments in /dev/shm created by one of `pids` (a segment's header holds its creator's pid
/// at byte 24), so that jobs of other tests or test runs on this host are not counted.
fn leftovers(pids: &[u32]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("oxiflow-"))
                .filter(|e| {
                    let mut h = [0u8; 32];
                    std::fs::File::open(e.path())
                        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut h))
                        .is_ok()
                        && pids
                            .contains(&(u64::from_le_bytes(h[24..32].try_into().unwrap()) as u32))
                })
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn shm_worker_entry() {
    run_worker("OXF_SHM_ROLE", worker);
}

/// One test, so the scenarios run one after the other and the /dev/shm check sees them all.
#[test]
fn shm_and_tcp_planes_match_the_reference_and_leave_nothing() {
    let mut pids = Vec::new();
    // Shared memory (default): every rank maps all segments of its world.
    for (seed, world) in [(1u64, 2usize), (2, 3), (3, 4), (4, 5)] {
        let outs = spawn(world, &[], &vec![world; world], seed, 3000, &mut pids);
        assert_all_ok(&outs, &format!("shm seed {seed} world {world}"));
    }
    // Large pieces: many rounds through the two slots.
    let outs = spawn(3, &[], &[3; 3], 11, 1_500_000, &mut pids);
    assert_all_ok(&outs, "shm large pieces");
    // TCP only.
    for (seed, world) in [(5u64, 2usize), (6, 4)] {
        let outs = spawn(world, &[0, 1, 2, 3], &[0; 4], seed, 3000, &mut pids);
        assert_all_ok(&outs, &format!("tcp seed {seed} world {world}"));
    }
    // Mixed: rank 1 opts out; 0, 2, 3 share memory, groups with rank 1 go over TCP.
    for seed in [7u64, 8] {
        let outs = spawn(4, &[1], &[3, 0, 3, 3], seed, 3000, &mut pids);
        assert_all_ok(&outs, &format!("mixed seed {seed}"));
    }
    let after = leftovers(&pids);
    assert!(after.is_empty(), "segments left in /dev/shm: {after:?}");
}
