//! `all_to_all_v_strided` against a sequential reference: random sub-groups and layouts (zero
//! -length blocks, uneven counts, runs short and long, pieces spanning several slot rounds,
//! members mixing it with plain `all_to_all_v`) on the in-process backend and on real
//! processes of the CPU backend over shared memory and over TCP only. The binary re-runs
//! itself as the ranks (`worker_entry`, selected by `OXF_SA_ROLE=worker`).

mod multiprocess_common;
mod process_world;

use std::process::Output;
use std::time::Duration;

use multiprocess_common::{decode, dtype_of, encode, Rng, DTYPES};
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::{
    init_world, Buf, BufMut, CommError, DType, InProcessWorld, SharedComm, StridedBlock,
};
use process_world::{assert_all_ok, run_worker, var, World};
use proptest::prelude::*;

/// One strided all-to-all: `layouts[i][j]` is member i's block for member j, inside a send
/// buffer of `lens[i]` elements; members in `plain` pack and call `all_to_all_v` instead.
#[derive(Clone, Debug)]
struct Step {
    group: Vec<usize>,
    layouts: Vec<Vec<StridedBlock>>,
    lens: Vec<usize>,
    plain: Vec<bool>,
}

fn block(rng: &mut Rng, big: bool, at: usize) -> StridedBlock {
    if rng.below(5) == 0 {
        // Empty, with arbitrary offset and stride (they must be ignored).
        let k = rng.below(50);
        let (run_len, runs) = if rng.below(2) == 0 { (0, k) } else { (k, 0) };
        return StridedBlock {
            offset: rng.below(1000),
            run_len,
            stride: rng.below(100),
            runs,
        };
    }
    let (run_len, runs) = if big {
        // Runs short (staged through the slots) or long (read in place), many rounds' worth.
        match rng.below(3) {
            0 => (1 + rng.below(40), 2000 + rng.below(6000)),
            1 => (17_000 + rng.below(3000), 2 + rng.below(8)),
            _ => (100 + rng.below(400), 200 + rng.below(600)),
        }
    } else {
        (1 + rng.below(40), 1 + rng.below(30))
    };
    StridedBlock {
        offset: at + rng.below(5),
        run_len,
        stride: run_len + rng.below(3) * rng.below(20),
        runs,
    }
}

fn generate(seed: u64, world: usize, nsteps: usize, big: bool) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    (0..nsteps)
        .map(|s| {
            let mut group: Vec<usize> = (0..world).collect();
            for i in (1..world).rev() {
                let j = rng.below(i + 1);
                group.swap(i, j);
            }
            if rng.below(2) == 0 {
                group.truncate(1 + rng.below(world));
            }
            let n = group.len();
            let big = big && s == 0;
            let mut layouts = Vec::new();
            let mut lens = Vec::new();
            for _ in 0..n {
                let mut at = 0;
                let mut row = Vec::new();
                for _ in 0..n {
                    let b = block(&mut rng, big, at);
                    if b.count() > 0 {
                        // Blocks interleave when they share a stride; keep them apart here.
                        at = b.offset + (b.runs - 1) * b.stride + b.run_len;
                    }
                    row.push(b);
                }
                lens.push(at + rng.below(7));
                layouts.push(row);
            }
            let plain = (0..n).map(|_| rng.below(4) == 0).collect();
            Step {
                group,
                layouts,
                lens,
                plain,
            }
        })
        .collect()
}

/// Send element k of world rank r at step s.
fn val(r: usize, s: usize, k: usize) -> f64 {
    (((r * 7 + s * 13 + k * 3) % 23) as i64 - 11) as f64
}

/// The elements of `b` in run order, from rank r's step-s buffer.
fn elems(r: usize, s: usize, b: &StridedBlock) -> Vec<f64> {
    let mut out = Vec::with_capacity(b.count());
    for i in 0..b.runs {
        for e in 0..b.run_len {
            out.push(val(r, s, b.offset + i * b.stride + e));
        }
    }
    if b.count() == 0 {
        out.clear();
    }
    out
}

fn run_steps(world: &SharedComm, dt: DType, steps: &[Step]) -> Result<(), String> {
    let me = world.rank();
    for (s, st) in steps.iter().enumerate() {
        let Some(m) = st.group.iter().position(|&r| r == me) else {
            continue;
        };
        let comm = world
            .sub_group(&st.group)
            .map_err(|e| format!("step {s}: {e}"))?;
        let n = st.group.len();
        let send_v: Vec<f64> = (0..st.lens[m]).map(|k| val(me, s, k)).collect();
        let send = encode(dt, &send_v);
        let rc: Vec<usize> = (0..n).map(|i| st.layouts[i][m].count()).collect();
        let mut recv = vec![0u8; rc.iter().sum::<usize>() * dt.size()];
        let r = if st.plain[m] {
            let packed: Vec<f64> = st.layouts[m].iter().flat_map(|b| elems(me, s, b)).collect();
            let sc: Vec<usize> = st.layouts[m].iter().map(StridedBlock::count).collect();
            let p = encode(dt, &packed);
            comm.all_to_all_v(dt, Buf::Host(&p), &sc, BufMut::Host(&mut recv), &rc)
        } else {
            comm.all_to_all_v_strided(
                dt,
                Buf::Host(&send),
                &st.layouts[m],
                BufMut::Host(&mut recv),
                &rc,
            )
        };
        r.map_err(|e| format!("rank {me} step {s}: {e}"))?;
        let want: Vec<f64> = (0..n)
            .flat_map(|i| elems(st.group[i], s, &st.layouts[i][m]))
            .collect();
        let got = decode(dt, &recv);
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            return Err(format!(
                "rank {me} step {s} {:?}: {} elements received, {} expected, first difference at {at:?}",
                st.group,
                got.len(),
                want.len()
            ));
        }
    }
    Ok(())
}

fn in_process(seed: u64, world: usize, dt: DType, big: bool) -> Result<(), String> {
    let steps = generate(seed, world, 6, big);
    let hs: Vec<_> = InProcessWorld::new(world, Duration::from_secs(10))
        .into_iter()
        .map(|c| {
            let steps = steps.clone();
            std::thread::spawn(move || run_steps(&c, dt, &steps))
        })
        .collect();
    let errs: Vec<String> = hs
        .into_iter()
        .filter_map(|h| match h.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some("rank thread panicked".to_string()),
        })
        .collect();
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; "))
    }
}

#[test]
fn worker_entry() {
    run_worker("OXF_SA_ROLE", || {
        let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
        let comm = init_world(&env).map_err(|e| format!("init_world: {e}"))?;
        let steps = generate(
            var("OXF_SA_SEED").parse().unwrap(),
            env.world_size,
            6,
            var("OXF_SA_BIG") == "1",
        );
        run_steps(
            &comm,
            dtype_of(var("OXF_SA_DTYPE").parse().unwrap()),
            &steps,
        )
    });
}

fn spawn_world(world: usize, shm: bool, seed: u64, dt: usize, big: bool) -> Vec<(usize, Output)> {
    let procs = World::new(world);
    let children = (0..world)
        .map(|r| {
            let c = procs
                .rank("worker_entry", r, "30")
                .env("OXF_SA_ROLE", "worker")
                .env("OXF_SA_SEED", seed.to_string())
                .env("OXF_SA_DTYPE", dt.to_string())
                .env("OXF_SA_BIG", if big { "1" } else { "0" })
                .env("OXIFLOW_SHM", if shm { "1" } else { "0" })
                .spawn()
                .unwrap();
            (r, c)
        })
        .collect();
    procs.wait(children)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn in_process_matches_reference(seed in any::<u64>(), world in 1usize..=5, dt in 0usize..DTYPES) {
        in_process(seed, world, dtype_of(dt), false).map_err(TestCaseError::fail)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3))]
    #[test]
    fn in_process_large_blocks(seed in any::<u64>(), world in 2usize..=4) {
        in_process(seed, world, DType::F32, true).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn processes_over_shared_memory(seed in any::<u64>(), world in 1usize..=4, dt in 0usize..DTYPES, big in any::<bool>()) {
        let outs = spawn_world(world, true, seed, dt, big);
        assert_all_ok(&outs, &format!("shm seed {seed} world {world} dtype {dt} big {big}"));
    }

    #[test]
    fn processes_over_tcp(seed in any::<u64>(), world in 1usize..=4, dt in 0usize..DTYPES, big in any::<bool>()) {
        let outs = spawn_world(world, false, seed, dt, big);
        assert_all_ok(&outs, &format!("tcp seed {seed} world {world} dtype {dt} big {big}"));
    }
}

/// Blocks that leave the send buffer, or the wrong number of them, fail before communicating
/// on every backend, naming the block.
#[test]
fn bad_layouts_are_typed_errors() {
    let comms = InProcessWorld::new(1, Duration::from_secs(5));
    let c = &comms[0];
    let send = vec![0u8; 40];
    let mut recv = vec![0u8; 40];
    // A strided all-to-all of f32 on the one-member communicator.
    let strided = |send: &[u8], layout: &[StridedBlock], recv: &mut [u8], counts: &[usize]| {
        c.all_to_all_v_strided(
            DType::F32,
            Buf::Host(send),
            layout,
            BufMut::Host(recv),
            counts,
        )
    };
    let past = [StridedBlock {
        offset: 1,
        run_len: 3,
        stride: 5,
        runs: 2,
    }];
    let e = strided(&send[..32], &past, &mut recv[..24], &[6]).unwrap_err();
    assert!(matches!(e, CommError::BufferSize { .. }), "{e}");
    assert!(e.to_string().contains("member 0"), "{e}");
    let two = [StridedBlock::contiguous(0, 1); 2];
    let e = strided(&send, &two, &mut recv[..4], &[1]).unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    let huge = [StridedBlock {
        offset: 0,
        run_len: usize::MAX / 2,
        stride: 1,
        runs: 4,
    }];
    let e = strided(&send, &huge, &mut recv, &[10]).unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    // A valid strided send to itself.
    let vals: Vec<u8> = (0..10u32).flat_map(|v| (v as f32).to_ne_bytes()).collect();
    let ok = [StridedBlock {
        offset: 1,
        run_len: 2,
        stride: 4,
        runs: 2,
    }];
    strided(&vals, &ok, &mut recv[..16], &[4]).unwrap();
    let got: Vec<f32> = recv[..16]
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, vec![1.0, 2.0, 5.0, 6.0]);
}
