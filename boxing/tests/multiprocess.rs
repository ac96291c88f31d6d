//! A smaller sample of the boxing check on real processes (TCP backend): the test binary starts
//! itself as 4 worker processes; each boxes a seeded list of cases (1-d, 2-d and across
//! placements) and writes its target pieces to a directory; the parent reassembles and compares.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use oxiflow_boxing::{execute, BoxingPlanner, HostPiece};
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::init_world;
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Sbp, Shape};

const WORLD: usize = 4;

fn gen_cases(seed: u64) -> Vec<Case> {
    let mut rng = SplitMix(seed);
    let mut out = Vec::new();
    let sbps = [Sbp::S(0), Sbp::S(1), Sbp::B, Sbp::P];
    let shape = Shape::from([3 + rng.below(6) as usize, 1 + rng.below(6) as usize]);
    let global = random_global(&shape, &mut rng);
    let p1 = cpu(&[4], &[0, 1, 2, 3]);
    let p2 = cpu(&[2, 2], &[3, 1, 0, 2]);
    let p3 = cpu(&[3], &[1, 2, 3]);
    let p4 = cpu(&[1], &[0]);
    let l = |pl: &oxiflow_placement::Placement, nd: NdSbp| {
        GlobalLayout::new(shape.clone(), pl, nd).unwrap()
    };
    for a in sbps {
        for b in sbps {
            out.push((l(&p1, a.into()), l(&p1, b.into())));
        }
    }
    for _ in 0..12 {
        let pick = |rng: &mut SplitMix| sbps[rng.below(4) as usize];
        let a = NdSbp::new([pick(&mut rng), pick(&mut rng)]);
        let b = NdSbp::new([pick(&mut rng), pick(&mut rng)]);
        out.push((l(&p2, a), l(&p2, b)));
    }
    out.push((
        l(&p2, NdSbp::new([Sbp::S(0), Sbp::P])),
        l(&p3, Sbp::S(1).into()),
    ));
    out.push((
        l(&p3, Sbp::Partial(ReduceOp::Max).into()),
        l(&p4, Sbp::B.into()),
    ));
    out.push((
        l(&p4, Sbp::B.into()),
        l(&p2, NdSbp::new([Sbp::S(1), Sbp::S(0)])),
    ));
    out.push((l(&p1, Sbp::S(0).into()), l(&p3, Sbp::P.into())));
    out.into_iter()
        .enumerate()
        .map(|(i, (from, to))| Case {
            from,
            to,
            dtype: dtype_of(seed.wrapping_add(i as u64)),
            global: global.clone(),
            seed: seed ^ i as u64,
            force: None,
        })
        .collect()
}

fn write_piece(dir: &Path, case: usize, rank: usize, p: &HostPiece) {
    let bytes: Vec<u8> = from_host(p).iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(dir.join(format!("c{case}_r{rank}")), bytes).unwrap();
}

fn read_piece(dir: &Path, case: usize, rank: usize, layout: &GlobalLayout) -> Option<HostPiece> {
    let bytes = std::fs::read(dir.join(format!("c{case}_r{rank}"))).ok()?;
    let v: Vec<f64> = bytes
        .chunks(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Some(to_host(
        layout.local_shape(rank)?,
        v,
        oxiflow_dtype::DType::F64,
    ))
}

/// The worker side: runs only inside a spawned process.
#[test]
fn worker_entry() {
    let Ok(dir) = std::env::var("OXF_BOX_DIR") else {
        return;
    };
    let seed: u64 = std::env::var("OXF_BOX_SEED").unwrap().parse().unwrap();
    let env = LaunchEnv::from_env().unwrap();
    let comm = init_world(&env).unwrap();
    let me = env.rank;
    let planner = BoxingPlanner::new();
    for (i, c) in gen_cases(seed).iter().enumerate() {
        let pieces = make_pieces(&c.from, &c.global, c.dtype, &mut SplitMix(c.seed));
        let plan = planner.plan(&c.from, &c.to, c.dtype).unwrap();
        let out = execute(&plan, &comm, pieces.get(&me).cloned()).unwrap();
        if let Some(p) = out {
            write_piece(Path::new(&dir), i, me, &p);
        }
    }
}

#[test]
fn real_processes_box_correctly() {
    for seed in [3u64, 1234] {
        let dir = std::env::temp_dir().join(format!("oxf_boxing_mp_{}_{seed}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = generate_token().unwrap();
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), token.clone()).unwrap();
        let port = server.local_addr().port();
        let exe = std::env::current_exe().unwrap();
        let children: Vec<_> = (0..WORLD)
            .map(|r| {
                Command::new(&exe)
                    .args(["worker_entry", "--exact", "--nocapture", "--test-threads=1"])
                    .env("OXF_BOX_DIR", &dir)
                    .env("OXF_BOX_SEED", seed.to_string())
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", WORLD.to_string())
                    .env("LOCAL_RANK", r.to_string())
                    .env("LOCAL_WORLD_SIZE", WORLD.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("OXIFLOW_TOKEN", &token)
                    .env("OXIFLOW_TIMEOUT", "60")
                    .env("OXIFLOW_BACKEND", "cpu")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (r, c) in children.into_iter().enumerate() {
            let o = c.wait_with_output().unwrap();
            assert!(
                o.status.success(),
                "rank {r}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        drop(server);
        for (i, c) in gen_cases(seed).iter().enumerate() {
            let mut pieces = BTreeMap::new();
            for &r in c.to.placement().ranks() {
                if let Some(p) = read_piece(&dir, i, r, &c.to) {
                    pieces.insert(r, p);
                }
            }
            assert_eq!(
                pieces.len(),
                c.to.placement().num_ranks(),
                "case {i}: missing target pieces"
            );
            let got = reassemble(&c.to, &pieces)
                .unwrap_or_else(|e| panic!("case {i} {} -> {}: {e}", c.from, c.to));
            assert_eq!(got, c.global, "case {i} {} -> {}", c.from, c.to);
        }
        let files = std::fs::read_dir(&dir).unwrap().count();
        println!(
            "seed {seed}: {} cases, {files} target pieces from {WORLD} processes",
            gen_cases(seed).len()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
