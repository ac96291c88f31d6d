//! The bad-input catalogue: hostile or nonsensical input through the API (on 4 in-process
//! ranks, every rank must get the same error), checkpoint files, the `train` and `oflaunch`
//! command lines and the launch environment of a worker started without oflaunch. Every case
//! must end in a typed error or a clean exit with a message naming the problem: no panic, no
//! abort, no hang (the whole catalogue runs in seconds).

mod catalogue_damages;
mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use catalogue_damages::{ckpt_dir, damages, saved};
use oxiflow::checkpoint;
use oxiflow::prelude::*;
use oxiflow::run_ranks;

type Case = (
    &'static str,
    &'static str,
    fn() -> Result<(), oxiflow::Error>,
);

fn p4() -> Placement {
    Placement::range(DeviceType::Cpu, 4).unwrap()
}

fn m(n: u64, k: u64) -> Result<Tensor, oxiflow::Error> {
    Ok(Tensor::randn_global(
        [n as usize, k as usize],
        n + k,
        DType::F32,
        &p4(),
        Sbp::S(0),
    )?)
}

fn api_cases() -> Vec<Case> {
    vec![
        ("zeros_global [MAX, 2]", "overflow", || {
            Tensor::zeros_global([usize::MAX, 2], DType::F32, &p4(), Sbp::S(0))?;
            Ok(())
        }),
        ("ones_global [2^62] f64", "overflow", || {
            Tensor::ones_global([1usize << 62], DType::F64, &p4(), Sbp::B)?;
            Ok(())
        }),
        ("full_global [0, MAX, 4]", "overflow", || {
            Tensor::full_global([0, usize::MAX, 4], 1.0, DType::F32, &p4(), Sbp::B)?;
            Ok(())
        }),
        ("rand_global [2^40, 2^40]", "overflow", || {
            Tensor::rand_global([1usize << 40, 1 << 40], 1, DType::F32, &p4(), Sbp::S(1))?;
            Ok(())
        }),
        ("randn_global [MAX] i64", "overflow", || {
            Tensor::randn_global([usize::MAX], 1, DType::I64, &p4(), Sbp::S(0))?;
            Ok(())
        }),
        ("arange_global 1e30 elements", "2^53", || {
            Tensor::arange_global(0.0, 1e30, 1.0, DType::F32, &p4(), Sbp::S(0))?;
            Ok(())
        }),
        ("arange to infinity", "bad range", || {
            Tensor::arange(0.0, f64::INFINITY, 1.0, DType::F32)?;
            Ok(())
        }),
        ("arange step 0", "bad range", || {
            Tensor::arange(0.0, 1.0, 0.0, DType::F32)?;
            Ok(())
        }),
        ("arange NaN start", "bad range", || {
            Tensor::arange(f64::NAN, 1.0, 1.0, DType::F32)?;
            Ok(())
        }),
        ("arange step 1e-300", "2^53", || {
            Tensor::arange(0.0, 1.0, 1e-300, DType::F64)?;
            Ok(())
        }),
        ("arange 1e15 f64 (8 PB)", "cannot allocate", || {
            Tensor::arange(0.0, 1e15, 1.0, DType::F64)?;
            Ok(())
        }),
        ("add [8,3] + [8,5]", "[8, 5]", || {
            m(8, 3)?.add(&m(8, 5)?)?;
            Ok(())
        }),
        ("matmul [8,3] @ [8,3]", "matmul", || {
            m(8, 3)?.matmul(&m(8, 3)?)?;
            Ok(())
        }),
        (
            "matmul_t_acc with a [8,4] accumulator for [8,8]",
            "accumulator",
            || {
                m(8, 3)?.matmul_t_acc(&m(8, 3)?, false, true, &m(8, 4)?)?;
                Ok(())
            },
        ),
        (
            "matmul_t_acc with its accumulator on other ranks",
            "cpu:[2, 3]",
            || {
                let a = Placement::new_1d(DeviceType::Cpu, [0, 1])?;
                let b = Placement::new_1d(DeviceType::Cpu, [2, 3])?;
                let x = Tensor::ones_global([4, 4], DType::F32, &a, Sbp::S(0))?;
                let acc = Tensor::ones_global([4, 4], DType::F32, &b, Sbp::B)?;
                x.matmul_t_acc(&x, false, true, &acc)?;
                Ok(())
            },
        ),
        ("mul across placements", "cpu:[2, 3]", || {
            let a = Placement::new_1d(DeviceType::Cpu, [0, 1])?;
            let b = Placement::new_1d(DeviceType::Cpu, [2, 3])?;
            let x = Tensor::ones_global([4, 4], DType::F32, &a, Sbp::S(0))?;
            x.mul(&Tensor::ones_global([4, 4], DType::F32, &b, Sbp::B)?)?;
            Ok(())
        }),
        ("S(2) of a 2-d tensor", "S(2)", || {
            Tensor::randn_global([4, 4], 1, DType::F32, &p4(), Sbp::S(2))?;
            Ok(())
        }),
        ("2 SBPs on a 1-d placement", "S(0), B", || {
            let nd = NdSbp::new([Sbp::S(0), Sbp::B]);
            Tensor::randn_global([4, 4], 1, DType::F32, &p4(), nd)?;
            Ok(())
        }),
        ("reshape [8,3] -> [5,5]", "reshape", || {
            m(8, 3)?.reshape([5, 5])?;
            Ok(())
        }),
        ("sum over dim 5", "sum", || {
            m(8, 3)?.sum(&[5], false)?;
            Ok(())
        }),
        ("transpose dim 7", "transpose", || {
            m(8, 3)?.transpose(0, 7)?;
            Ok(())
        }),
        ("narrow past the end", "narrow", || {
            m(8, 3)?.narrow(1, 2, 5)?;
            Ok(())
        }),
        ("permute of the wrong length", "permute", || {
            m(8, 3)?.permute(&[0])?;
            Ok(())
        }),
        ("concat of nothing", "concat", || {
            Tensor::concat(&[], 0)?;
            Ok(())
        }),
        ("softmax dim 9", "softmax", || {
            m(8, 3)?.softmax(9)?;
            Ok(())
        }),
        ("embedding with float ids", "embedding", || {
            Tensor::embedding(&m(8, 3)?, &m(8, 3)?)?;
            Ok(())
        }),
        ("cross_entropy with float labels", "cross_entropy", || {
            m(8, 3)?.cross_entropy(&m(8, 3)?)?;
            Ok(())
        }),
        ("to_global outside the world", "world of 4 ranks", || {
            let p8 = Placement::range(DeviceType::Cpu, 8)?;
            m(8, 3)?.to_global(&p8, Sbp::B)?;
            Ok(())
        }),
        ("zeros_global outside the world", "world of 4 ranks", || {
            let far = Placement::new_1d(DeviceType::Cpu, [0, 9])?;
            Tensor::zeros_global([4], DType::F32, &far, Sbp::B)?;
            Ok(())
        }),
        ("placement with a duplicate rank", "rank 1", || {
            Placement::new_1d(DeviceType::Cpu, [0, 1, 1])?;
            Ok(())
        }),
        ("placement of a wrong mesh", "[2, 2]", || {
            Placement::new(DeviceType::Cpu, vec![2, 2], vec![0, 1, 2])?;
            Ok(())
        }),
        ("ragged placement text", "cpu:[[0, 1], [2]]", || {
            "cpu:[[0, 1], [2]]".parse::<Placement>()?;
            Ok(())
        }),
        ("SBP text S(x)", "S(x)", || {
            "S(x)".parse::<Sbp>()?;
            Ok(())
        }),
    ]
}

/// Runs every case on 4 in-process ranks; returns each case's message (the same on all ranks).
fn on_four_ranks(cases: &[Case]) -> Vec<String> {
    let per_rank = run_ranks(4, Duration::from_secs(20), |_| {
        cases
            .iter()
            .map(|(name, _, f)| match catch_unwind(AssertUnwindSafe(f)) {
                Ok(Ok(())) => format!("{name}: no error"),
                Ok(Err(e)) => format!("{e:?}"),
                Err(_) => format!("{name}: PANIC"),
            })
            .collect::<Vec<_>>()
    });
    for (r, msgs) in per_rank.iter().enumerate() {
        assert_eq!(msgs, &per_rank[0], "rank {r} disagrees with rank 0");
    }
    per_rank.into_iter().next().unwrap_or_default()
}

fn check_all(cases: &[Case], msgs: &[String]) {
    for ((name, want, _), msg) in cases.iter().zip(msgs) {
        assert!(
            msg.contains(want) && !msg.contains("PANIC") && !msg.contains("no error"),
            "{name}: expected an error naming {want:?}, got {msg:?}"
        );
    }
}

#[test]
fn api_cases_are_typed_errors_alike_on_every_rank() {
    let cases = api_cases();
    let msgs = on_four_ranks(&cases);
    check_all(&cases, &msgs);
    assert!(cases.len() >= 30, "{}", cases.len());
}

// ---- checkpoint files (the damages are in catalogue_damages) ---------------------------

#[test]
fn damaged_checkpoints_are_typed_errors_alike_on_every_rank() {
    let damages = damages();
    let dirs: Vec<PathBuf> = damages
        .iter()
        .enumerate()
        .map(|(i, (_, _, damage))| {
            let d = saved(&format!("damage-{i}"));
            damage(&d);
            d
        })
        .collect();
    // Each rank loads `w` into a broadcast layout, so every rank reads every piece.
    let per_rank = run_ranks(4, Duration::from_secs(20), |_| {
        dirs.iter()
            .map(|d| {
                let load = || -> Result<(), oxiflow::Error> {
                    let like = Tensor::zeros_global([4, 3], DType::F32, &p4(), Sbp::B)?;
                    checkpoint::load_tensors(d, &[("w".into(), like)])?;
                    Ok(())
                };
                match catch_unwind(AssertUnwindSafe(load)) {
                    Ok(Ok(())) => "no error".to_string(),
                    Ok(Err(e)) => format!("{e:?}"),
                    Err(_) => "PANIC".to_string(),
                }
            })
            .collect::<Vec<_>>()
    });
    for (r, msgs) in per_rank.iter().enumerate() {
        assert_eq!(msgs, &per_rank[0], "rank {r} disagrees with rank 0");
    }
    for ((name, want, _), msg) in damages.iter().zip(&per_rank[0]) {
        assert!(
            msg.contains(want) && msg.starts_with("checkpoint load"),
            "{name}: expected a checkpoint error naming {want:?}, got {msg:?}"
        );
    }
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

// ---- command lines and the launch environment ----------------------------------------------

/// Runs `program` with only PATH in its environment plus `env`.
fn run_clean(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(program);
    c.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("start the program")
}

/// `run_clean` of `train --model mlp ARGS` (the MLP classifier).
fn run_mlp(train: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut all = vec!["--model", "mlp"];
    all.extend_from_slice(args);
    run_clean(train, &all, env)
}

/// The program failed with `code` and its stderr names `want`, without a panic or a Debug dump.
fn assert_refused(what: &str, out: &Output, code: i32, want: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{what}: {err}");
    assert!(
        err.contains(want),
        "{what}: stderr does not name {want:?}: {err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains(" { op:"),
        "{what}: panic or Debug dump: {err}"
    );
}

/// `run(ARGS)` of each case `(ARGS, want)` fails with `code` and names `want` (see
/// `assert_refused`; `what` names the program).
fn refuses_each(what: &str, run: impl Fn(&[&str]) -> Output, cases: &[(&[&str], &str)], code: i32) {
    for (args, want) in cases {
        assert_refused(&format!("{what} {args:?}"), &run(args), code, want);
    }
}

#[test]
fn train_flags_are_checked() {
    let (_, train) = common::binaries();
    let usage: &[(&[&str], &str)] = &[
        (&["--lr", "nan"], "--lr"),
        (&["--lr", "inf"], "--lr"),
        (&["--lr", "-1"], "--lr"),
        (&["--lr", "0"], "--lr"),
        (&["--momentum", "1.5"], "--momentum"),
        (&["--batch-size", "0"], "--batch-size"),
        (&["--hidden", "0"], "--hidden"),
        (&["--features", "0"], "--features"),
        (&["--classes", "1"], "--classes"),
        (&["--tp", "0"], "--tp"),
        (&["--dp", "0"], "--dp"),
        (&["--steps", "0"], "--steps"),
        (&["--log-every", "0"], "--log-every"),
        (&["--save-every", "0", "--save", "/tmp/x"], "--save-every"),
        (&["--save-every", "5"], "--save"),
        (&["--steps", "-3"], "--steps"),
    ];
    refuses_each("train", |args| run_mlp(train, args, &[]), usage, 2);
    let runtime: &[(&[&str], &str)] = &[
        (&["--tp", "3"], "--tp 3 does not divide the world size 1"),
        (&["--dp", "2"], "must equal the world size 1"),
        (
            &["--precision", "tf32", "--device", "cpu"],
            "--precision tf32",
        ),
        (&["--resume", "/nonexistent/ckpt"], "no complete checkpoint"),
    ];
    refuses_each("train", |args| run_mlp(train, args, &[]), runtime, 1);
}

#[test]
fn train_save_and_resume_refuse_what_does_not_fit() {
    let (_, train) = common::binaries();
    let file = ckpt_dir("save-onto-file");
    std::fs::write(&file, b"notes").unwrap();
    let fs = file.to_str().unwrap();
    let out = run_mlp(train, &["--steps", "2", "--save", fs], &[]);
    assert_refused("--save onto a file", &out, 1, "not a directory");
    assert_eq!(std::fs::read(&file).unwrap(), b"notes");
    let _ = std::fs::remove_file(&file);

    let dir = ckpt_dir("save-onto-dir");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("keep.txt"), b"data").unwrap();
    let ds = dir.to_str().unwrap();
    let out = run_mlp(train, &["--steps", "2", "--save", ds], &[]);
    assert_refused(
        "--save onto a directory",
        &out,
        1,
        "not an oxiflow checkpoint",
    );
    assert_eq!(std::fs::read(dir.join("keep.txt")).unwrap(), b"data");
    let _ = std::fs::remove_dir_all(&dir);

    let ck = ckpt_dir("resume-mismatch");
    let cs = ck.to_str().unwrap();
    let out = run_mlp(train, &["--steps", "3", "--save", cs], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cases: &[(&[&str], &str)] = &[
        (&["--steps", "6", "--resume", cs, "--seed", "5"], "seed 0"),
        (
            &[
                "--steps",
                "6",
                "--resume",
                cs,
                "--optimizer",
                "adamw",
                "--lr",
                "0.01",
            ],
            "optimizer sgd",
        ),
        (&["--steps", "3", "--resume", cs], "not below --steps 3"),
    ];
    refuses_each("train", |args| run_mlp(train, args, &[]), cases, 1);
    // The override resumes a different seed.
    let out = run_mlp(
        train,
        &[
            "--steps",
            "4",
            "--resume",
            cs,
            "--seed",
            "5",
            "--allow-resume-mismatch",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&ck);
}

#[test]
fn oflaunch_flags_are_checked() {
    let (oflaunch, _) = common::binaries();
    let cases: &[(&[&str], &str)] = &[
        (&["--nproc-per-node", "0", "train"], "--nproc-per-node"),
        (&["--nproc-per-node", "abc", "train"], "--nproc-per-node"),
        (
            &["--nproc-per-node", "1", "/nonexistent/prog"],
            "/nonexistent/prog",
        ),
    ];
    refuses_each("oflaunch", |args| run_clean(oflaunch, args, &[]), cases, 2);
}

#[test]
fn a_bad_launch_environment_is_one_clear_line() {
    let (_, train) = common::binaries();
    let two = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v: Vec<(&str, &str)> = two.to_vec();
        v.extend_from_slice(extra);
        v
    };
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (vec![("RANK", "5"), ("WORLD_SIZE", "2")], "RANK"),
        (vec![("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE=0"),
        (vec![("RANK", "abc"), ("WORLD_SIZE", "2")], "RANK"),
        (with(&[("MASTER_PORT", "99999")]), "MASTER_PORT"),
        (with(&[("MASTER_PORT", "abc")]), "MASTER_PORT"),
        (with(&[]), "MASTER_PORT is missing"),
        (
            with(&[("MASTER_PORT", "29500"), ("OXIFLOW_TIMEOUT", "-1")]),
            "OXIFLOW_TIMEOUT",
        ),
        (
            with(&[("MASTER_PORT", "29500"), ("OXIFLOW_BACKEND", "gpu")]),
            "OXIFLOW_BACKEND",
        ),
        (
            with(&[("MASTER_PORT", "29500"), ("OXIFLOW_SHM", "maybe")]),
            "OXIFLOW_SHM",
        ),
        (
            with(&[("MASTER_PORT", "29500"), ("OXIFLOW_DEVICE", "x")]),
            "OXIFLOW_DEVICE",
        ),
        (
            with(&[("MASTER_PORT", "29500"), ("OXIFLOW_TOKEN", "has space")]),
            "OXIFLOW_TOKEN",
        ),
    ];
    for (env, want) in &cases {
        // A case the worker wrongly accepted would wait at rendezvous: 2 s, not 300.
        let mut env = env.clone();
        if !env.iter().any(|(k, _)| *k == "OXIFLOW_TIMEOUT") {
            env.push(("OXIFLOW_TIMEOUT", "2"));
        }
        let out = run_mlp(train, &["--steps", "1"], &env);
        assert_refused(&format!("env {env:?}"), &out, 1, want);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim_end().lines().count(), 1, "env {env:?}: {err}");
    }
}

#[test]
fn an_example_started_without_oflaunch_says_so_in_one_line() {
    let (oflaunch, _) = common::binaries();
    let basics = oflaunch
        .parent()
        .unwrap()
        .join("examples")
        .join("global_tensor_basics");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let st = Command::new(env!("CARGO"))
        .args(["build", "--release", "--example", "global_tensor_basics"])
        .current_dir(root)
        .status()
        .unwrap();
    assert!(st.success());
    let out = run_clean(&basics, &[], &[]);
    assert_refused("global_tensor_basics alone", &out, 1, "needs 2 ranks");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}
