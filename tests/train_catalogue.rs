//! The hostile-input catalogue of `train`: flag values (negative, zero, NaN, infinite, huge,
//! empty, unknown), combinations the chosen model does not use, sizes that cannot fit in
//! memory, outputs and data that are not regular files or sit in trees that cannot be written,
//! job files with unknown keys and launch environments with garbage. Each case is a real
//! process that must end before training (no step line) with a non-zero exit code and a
//! message naming the flag, value or variable, without panic, abort or backtrace text, in a
//! few seconds. Most run as one `train` process (the checks do not depend on the rank); a few
//! run under `oflaunch --nproc-per-node 2`, where every rank must refuse alike.

mod catalogue_damages;
mod catalogue_files;
mod catalogue_flags;
mod common;

use common::argv;

use std::io::Read;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The longest a case may take.
const CASE_LIMIT: Duration = Duration::from_secs(5);

/// One hostile case: `train ARGS` under `ENV` (beside PATH only), the fragment the error must
/// name.
struct Case {
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    want: String,
}

fn case(args: &[&str], want: &str) -> Case {
    Case {
        args: args.iter().map(|a| a.to_string()).collect(),
        env: Vec::new(),
        want: want.into(),
    }
}

fn mlp(args: &[&str], want: &str) -> Case {
    let mut all = vec!["--model", "mlp"];
    all.extend_from_slice(args);
    case(&all, want)
}

fn with_env(mut c: Case, env: &[(&'static str, &str)]) -> Case {
    c.env = env.iter().map(|(k, v)| (*k, v.to_string())).collect();
    c
}

/// What a finished process left.
struct Ended {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Runs `cmd` to its end, killing it after `limit` (then `code` is None and `took` >= limit).
fn run_limited(mut cmd: Command, limit: Duration) -> Ended {
    let start = Instant::now();
    let mut child = common::spawn_piped(&mut cmd).expect("start the program");
    let pipe = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = pipe(Box::new(child.stdout.take().unwrap()));
    let err = pipe(Box::new(child.stderr.take().unwrap()));
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    Ended {
        code,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        took: start.elapsed(),
    }
}

/// Why `e` is not a clean refusal naming `want` before training, if it is not.
fn not_refused(e: &Ended, want: &str) -> Option<String> {
    let forbidden = [
        "panicked",
        "abort",
        "Abort",
        "backtrace",
        "RUST_BACKTRACE",
        "memory allocation of",
    ];
    if e.code.is_none() {
        return Some(format!("no exit within {CASE_LIMIT:?} (killed or hung)"));
    }
    if e.code == Some(0) {
        return Some("exit code 0".into());
    }
    if !e.stderr.contains(want) {
        return Some(format!("stderr does not name {want:?}"));
    }
    if let Some(f) = forbidden.iter().find(|f| e.stderr.contains(*f)) {
        return Some(format!("stderr holds {f:?}"));
    }
    if let Some(name) = internal_name(&e.stderr) {
        return Some(format!("stderr leaks the internal name {name:?}"));
    }
    if !common::curve(&e.stdout).is_empty() || e.stdout.contains("final loss") {
        return Some("it trained".into());
    }
    if e.took > CASE_LIMIT {
        return Some(format!("took {:?}", e.took));
    }
    None
}

/// The first `Type::name` in `text` (an internal name a user message must not show).
fn internal_name(text: &str) -> Option<&str> {
    let at = text.find("::")?;
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let start = text[..at].rfind(|c| !word(c)).map_or(0, |i| i + 1);
    let end = text[at + 2..]
        .find(|c| !word(c))
        .map_or(text.len(), |i| at + 2 + i);
    (start < at && end > at + 2).then(|| &text[start..end])
}

/// A scratch folder with the hostile files the cases name.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!(
            "oxiflow-train-catalogue-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("notckpt")).unwrap();
        std::fs::write(d.join("notckpt/keep.txt"), b"data").unwrap();
        std::fs::write(d.join("notes.txt"), b"notes").unwrap();
        std::fs::create_dir_all(d.join("dir.bin")).unwrap();
        std::fs::create_dir_all(d.join("ck.config.toml")).unwrap();
        std::fs::write(d.join("other.old"), b"not ours").unwrap();
        for fifo in ["fifo", "fifo.bin", "fifo.svg", "fifo.toml", "fifo.jsonl"] {
            let st = Command::new("mkfifo").arg(d.join(fifo)).status().unwrap();
            assert!(st.success(), "mkfifo");
        }
        let ids: Vec<u8> = (0..4000u16).flat_map(|i| (i % 200).to_le_bytes()).collect();
        std::fs::write(d.join("ok.bin"), ids).unwrap();
        let job = |name: &str, text: &str| std::fs::write(d.join(name), text).unwrap();
        job("key.toml", "[optim]\nlr = 0.01\nlrr = 0.1\n");
        job("table.toml", "[optimizer]\nlr = 0.01\n");
        job("type.toml", "[optim]\nlr = \"fast\"\n");
        job("mlp-gpt.toml", "[model]\nmodel = \"mlp\"\nlayers = 3\n");
        job("nan.toml", "[optim]\nlr = nan\n");
        job("inf.toml", "[optim]\nclip-grad = inf\n");
        job("neg.toml", "[data]\nbatch-size = -4\n");
        job("gen.toml", "[generate]\ngen-tokens = 1000000000000000\n");
        job("broken.toml", "[model\nlayers = 2\n");
        job("empty.toml", "[run]\nsave = \"\"\n");
        Scratch(d)
    }
    fn p(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The single-process cases (the checks are the same on every rank).
fn cases(s: &Scratch) -> Vec<Case> {
    let p = |n: &str| s.p(n);
    let mut v = vec![
        // Checkpoint targets, refused before step 1.
        mlp(&["--save", &p("notes.txt")], "not a directory"),
        mlp(&["--save", &p("notckpt")], "not an oxiflow checkpoint"),
        mlp(&["--save", "/proc/self/ckpt"], "cannot be written"),
        mlp(
            &["--save", &p("notes.txt/ckpt")],
            "notes.txt is not a folder",
        ),
        mlp(&["--save", "/proc/self/missing/ckpt"], "cannot be written"),
        mlp(&["--save", &p("fifo")], "not a directory"),
        mlp(&["--save", &p("ck")], "ck.config.toml"),
        mlp(&["--save", &p("other")], "other.old"),
        mlp(&["--save", ""], "--save"),
        mlp(&["--config", &p("empty.toml")], "--save: an empty path"),
        // Outputs.
        mlp(&["--metrics", &p("fifo.jsonl")], "not a regular file"),
        mlp(&["--metrics", &p("notckpt")], "not a regular file"),
        mlp(&["--metrics", "/proc/self/m.jsonl"], "cannot be written"),
        mlp(&["--plot", &p("fifo.svg")], "not a regular file"),
        mlp(&["--plot", &p("loss.jpg")], "--plot"),
        mlp(&["--metrics", ""], "--metrics"),
        // Data: regular files only, never opened when they are not.
        case(&["--data", &p("fifo")], "not a regular file"),
        case(&["--data", &p("notckpt")], "not a regular file"),
        case(&["--data", &p("fifo.bin")], "not a regular file"),
        case(&["--data", &p("dir.bin")], "not a regular file"),
        case(&["--data", "/dev/zero"], "not a regular file"),
        case(&["--data", &p("none.txt")], "none.txt"),
        case(&["--data", ""], "--data: an empty path"),
        case(
            &["--data", &p("ok.bin"), "--val-data", &p("fifo.bin")],
            "not a regular file",
        ),
        case(&["--val-data", &p("ok.bin")], "--val-data"),
        // Tokenizers: regular files only, never opened when they are not.
        case(&["--tokenizer", &p("fifo")], "not a regular file"),
        case(&["--tokenizer", &p("notes.txt")], "--tokenizer"),
        case(&["--tokenizer", ""], "--tokenizer"),
        // Job files.
        case(&["--config", &p("fifo.toml")], "not a regular file"),
        case(&["--config", &p("notckpt")], "not a regular file"),
        case(&["--config", &p("none.toml")], "none.toml"),
        case(&["--config", &p("key.toml")], "unknown field `lrr`"),
        case(&["--config", &p("table.toml")], "unknown field `optimizer`"),
        case(&["--config", &p("type.toml")], "invalid type"),
        case(&["--config", &p("mlp-gpt.toml")], "--layers (model.layers)"),
        case(&["--config", &p("nan.toml")], "--lr"),
        case(&["--config", &p("inf.toml")], "--clip-grad"),
        case(&["--config", &p("neg.toml")], "batch-size"),
        case(&["--config", &p("gen.toml")], "--gen-tokens"),
        case(&["--config", &p("broken.toml")], "broken.toml"),
        // Sizes that cannot fit, refused before anything big is allocated.
        case(&["--batch-size", "100000000"], "--batch-size 100000000"),
        case(&["--layers", "100000"], "--layers 100000"),
        case(&["--width", "1000000"], "--width 1000000"),
        case(&["--seq-len", "100000000"], "--seq-len 100000000"),
        case(
            &["--vocab-multiple", "100000000000"],
            "--vocab-multiple 100000000000",
        ),
        case(
            &["--vocab-multiple", "18446744073709551615"],
            "--vocab-multiple",
        ),
        mlp(&["--hidden", "10000000000"], "--hidden 10000000000"),
        mlp(&["--batch-size", "1000000000"], "--batch-size 1000000000"),
        mlp(&["--features", "10000000000"], "--features 10000000000"),
        mlp(&["--classes", "10000000000"], "--classes 10000000000"),
        case(&["--heads", "1000000"], "--heads 1000000"),
        mlp(&["--batch-size", "18446744073709551615"], "--batch-size"),
        case(&["--steps", "99999999999999999999"], "--steps"),
        // Generation length.
        case(&["--gen-tokens", "1e15"], "--gen-tokens"),
        case(&["--gen-tokens", "1000000000000000"], "--gen-tokens"),
        case(&["--gen-tokens", "-1"], "--gen-tokens"),
        // Flags the chosen job does not use: refused, not ignored.
        mlp(&["--data", &p("ok.bin")], "--data (data.data)"),
        mlp(&["--zero", "1"], "--zero (parallel.zero)"),
        mlp(&["--recompute", "full"], "--recompute (parallel.recompute)"),
        mlp(&["--layers", "3"], "--layers (model.layers)"),
        mlp(
            &["--vocab-multiple", "64"],
            "--vocab-multiple (model.vocab-multiple)",
        ),
        mlp(&["--generate", "hi"], "--generate (generate.generate)"),
        mlp(&["--dropout", "0.1"], "--dropout (model.dropout)"),
        mlp(&["--tokenizer", "gpt2"], "--tokenizer (data.tokenizer)"),
        mlp(&["--sp"], "--sp (parallel.sp)"),
        mlp(&["--pp", "1"], "--pp (parallel.pp)"),
        case(&["--hidden", "32"], "--hidden (model.hidden)"),
        case(&["--momentum", "0.5"], "--momentum (optim.momentum)"),
        case(&["--min-lr", "0.001"], "--min-lr (optim.min-lr)"),
        case(
            &["--reduce-dtype", "bf16", "--bucket-mb", "0"],
            "--reduce-dtype (optim.reduce-dtype)",
        ),
        case(&["--peak-tflops", "10"], "--peak-tflops (run.peak-tflops)"),
        case(&["--schedule", "gpipe"], "--schedule (parallel.schedule)"),
        case(
            &["--temperature", "0.5", "--gen-tokens", "0"],
            "--temperature (generate.temperature)",
        ),
        case(
            &["--shard-format", "llmc"],
            "--shard-format (data.shard-format)",
        ),
        case(&["--optimizer", "sgd"], "--optimizer sgd"),
        // Messages say what was given and what to do (and name no internal type).
        case(
            &["--data", &p("notes.txt")],
            "hold no window of 65 tokens (64 and the one after them)",
        ),
        case(
            &["--pp", "2", "--layers", "1"],
            "1 layers cannot fill 2 stages",
        ),
        case(
            &argv("--pp 2 --micro-batches 3 --schedule interleaved"),
            "the pipeline of --pp 2 --micro-batches 3 --schedule interleaved",
        ),
        case(
            &["--heads", "4", "--tp", "3"],
            "--heads 4 is not a multiple of --tp 3",
        ),
        // Combinations.
        case(&["--explain", "--save", &p("x")], "--explain"),
        mlp(&["--save-every", "5"], "--save-every needs --save"),
        mlp(
            &["--allow-resume-mismatch"],
            "--allow-resume-mismatch needs --resume",
        ),
        mlp(&["--resume", "auto"], "--resume auto needs --save"),
        mlp(&["--resume", &p("nothing")], "no complete checkpoint"),
        mlp(&["--resume", &p("notes.txt")], "notes.txt"),
        mlp(&["--resume", ""], "--resume"),
        mlp(
            &["--warmup-steps", "50", "--steps", "10"],
            "--warmup-steps 50",
        ),
        mlp(
            &["--lr-schedule", "cosine", "--min-lr", "1", "--lr", "0.1"],
            "--min-lr 1 is above --lr 0.1",
        ),
        mlp(&["--grad-accum", "3"], "--grad-accum 3"),
        mlp(&["--tp", "3"], "--tp 3"),
        mlp(&["--dp", "1000000"], "--dp 1000000"),
        mlp(
            &["--precision", "tf32"],
            "--precision tf32 needs --device cuda",
        ),
        mlp(&["--device", "cuda"], "--device cuda needs a GPU"),
        // Unknown words.
        case(&["--model", "transformer"], "--model"),
        case(&["--dtype", "f8"], "--dtype"),
        case(&["--precision", "fp8"], "--precision"),
        case(&["--optimizer", "adam"], "--optimizer"),
        case(&["--device", "tpu"], "--device"),
        case(&["--on-nonfinite", "ignore"], "--on-nonfinite"),
        case(&["--model", ""], "--model"),
        case(&["--no-such-flag"], "--no-such-flag"),
    ];
    // Every numeric flag: negative, zero, NaN, infinite and empty where they are wrong.
    let numbers: &[(&str, &[&str])] = &[
        ("--lr", &["nan", "inf", "-1", "0", "1e999", ""]),
        ("--steps", &["0", "-1", "nan"]),
        ("--batch-size", &["0", "-5", ""]),
        ("--hidden", &["0"]),
        ("--features", &["0"]),
        ("--classes", &["1", "0"]),
        ("--tp", &["0"]),
        ("--dp", &["0", "-2"]),
        ("--momentum", &["1", "-0.5", "nan"]),
        ("--weight-decay", &["-1", "inf", "nan"]),
        ("--min-lr", &["-1", "nan"]),
        ("--clip-grad", &["0", "-1", "nan", "inf"]),
        ("--grad-accum", &["0"]),
        ("--log-every", &["0"]),
        ("--eval-every", &["0"]),
        ("--warmup-steps", &["-1"]),
        ("--seed", &["-1", "nan"]),
        ("--loss-spike-factor", &["1", "0.5", "nan", "inf", "-3"]),
    ];
    for (flag, values) in numbers {
        for value in *values {
            v.push(mlp(&[flag, value], flag));
        }
    }
    let gpt_numbers: &[(&str, &[&str])] = &[
        ("--layers", &["0", "-1"]),
        ("--heads", &["0"]),
        ("--width", &["0"]),
        ("--seq-len", &["0"]),
        ("--vocab-multiple", &["0", "-1", "1.5"]),
        ("--dropout", &["1", "-0.1", "nan", "inf"]),
        ("--pp", &["0"]),
        ("--micro-batches", &["0"]),
        ("--virtual-stages", &["0"]),
        ("--zero", &["4", "-1"]),
        ("--temperature", &["-1", "nan", "inf"]),
        ("--gen-tokens", &["nan"]),
    ];
    for (flag, values) in gpt_numbers {
        for value in *values {
            v.push(case(&[flag, value], flag));
        }
    }
    // Launch environments with garbage (a worker that wrongly accepted one would wait at the
    // rendezvous: OXIFLOW_TIMEOUT keeps that short).
    let two = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("OXIFLOW_TIMEOUT", "2"),
    ];
    let envs: Vec<(Vec<(&'static str, &str)>, &str)> = vec![
        (vec![("RANK", "abc"), ("WORLD_SIZE", "2")], "RANK"),
        (vec![("RANK", "5"), ("WORLD_SIZE", "2")], "RANK"),
        (vec![("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
        (vec![("RANK", "0"), ("WORLD_SIZE", "-1")], "WORLD_SIZE"),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "99999999999999999999")],
            "WORLD_SIZE",
        ),
        (vec![("RANK", ""), ("WORLD_SIZE", "")], "RANK"),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "x")],
            "LOCAL_RANK",
        ),
        (vec![("OXIFLOW_TIMEOUT", "nan")], "OXIFLOW_TIMEOUT"),
        (vec![("OXIFLOW_TIMEOUT", "-1")], "OXIFLOW_TIMEOUT"),
        (vec![("OXIFLOW_BACKEND", "gpu")], "OXIFLOW_BACKEND"),
        (vec![("OXIFLOW_SHM", "maybe")], "OXIFLOW_SHM"),
        (vec![("OXIFLOW_DEVICE", "-1")], "OXIFLOW_DEVICE"),
        (vec![("OXIFLOW_PROGRESS", "maybe")], "OXIFLOW_PROGRESS"),
        (
            vec![("OXIFLOW_TRACE_DIR", "/proc/self/trace")],
            "OXIFLOW_TRACE_DIR",
        ),
        (
            vec![("OXIFLOW_FLIGHT_DIR", "/dev/null/flight")],
            "OXIFLOW_FLIGHT_DIR",
        ),
    ];
    for (env, want) in envs {
        v.push(with_env(mlp(&["--steps", "2"], want), &env));
    }
    let mut port = two.to_vec();
    port[3] = ("MASTER_PORT", "99999");
    v.push(with_env(mlp(&["--steps", "2"], "MASTER_PORT"), &port));
    let mut token = two.to_vec();
    token.push(("OXIFLOW_TOKEN", "has space"));
    v.push(with_env(mlp(&["--steps", "2"], "OXIFLOW_TOKEN"), &token));
    v
}

#[test]
fn every_hostile_case_is_refused_before_training() {
    let (_, train) = common::binaries();
    let scratch = Scratch::new("single");
    let cases = cases(&scratch);
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut slowest = (Duration::ZERO, String::new());
    for c in &cases {
        let mut cmd = Command::new(train);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .args(&c.args)
            .current_dir(&scratch.0);
        for (k, v) in &c.env {
            cmd.env(k, v);
        }
        let e = run_limited(cmd, CASE_LIMIT * 2);
        let what = format!("train {:?} env {:?}", c.args, c.env);
        if e.took > slowest.0 {
            slowest = (e.took, what.clone());
        }
        if let Some(why) = not_refused(&e, &c.want) {
            failures.push(format!("{what}: {why}\n  stderr: {}", e.stderr.trim_end()));
        }
        let said = e.stderr.lines().find(|l| l.contains(&c.want)).unwrap_or("");
        eprintln!("{:?} {:?}: {said}", c.args, c.env);
    }
    eprintln!(
        "{} hostile cases in {:.2?} (slowest {:.0?}: {})",
        cases.len(),
        start.elapsed(),
        slowest.0,
        slowest.1
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(cases.len() >= 60, "{} cases", cases.len());
    // Nothing was written next to the refused targets.
    for name in ["notes.txt", "notckpt/keep.txt"] {
        assert!(scratch.0.join(name).is_file(), "{name} went away");
    }
    for name in ["ck", "ck.partial", "x", "missing", "loss.jpg"] {
        assert!(!scratch.0.join(name).exists(), "{name} was written");
    }
}

#[test]
fn no_output_writes_over_an_input_or_another_runs_output() {
    let (_, train) = common::binaries();
    let start = Instant::now();
    let (failures, n) = catalogue_files::run_all(train);
    eprintln!("{n} file cases in {:.2?}", start.elapsed());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_flag_acts_or_is_refused_in_every_mode() {
    let (_, train) = common::binaries();
    let start = Instant::now();
    let (failures, n) = catalogue_flags::run_all(train);
    eprintln!("{n} flag x mode cases in {:.2?}", start.elapsed());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_run_continues_only_its_own_outputs_and_a_live_jobs_save_path_is_refused() {
    let (_, train) = common::binaries();
    catalogue_files::own_outputs_and_live_saves(train);
}

/// `train ARGS` under an address-space limit (`ulimit -v`) of `limit` bytes.
fn limited(train: &std::path::Path, args: &[&str], limit: u64) -> Ended {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(train);
    cmd.args(args);
    // SAFETY: between fork and exec the child only calls setrlimit, which is
    // async-signal-safe, with a limit on the stack.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            match libc::setrlimit(libc::RLIMIT_AS, &lim) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    run_limited(cmd, CASE_LIMIT * 6)
}

#[test]
fn memory_limits_are_named_and_a_refused_allocation_is_no_abort() {
    let (_, train) = common::binaries();
    let cases: [(&[&str], u64, &str); 2] = [
        // The estimate reads the address-space limit and names it (as every case must).
        (
            &argv("--batch-size 512 --seq-len 256 --gen-tokens 0"),
            1_500_000_000,
            "address space for this rank",
        ),
        // What the estimate does not count fails on an allocation: one line naming its size
        // and the limit, exit code 1, no abort.
        (
            &["--model", "mlp", "--batch-size", "2000000", "--steps", "2"],
            1_800_000_000,
            "out of host memory: an allocation of",
        ),
    ];
    for (args, limit, want) in cases {
        let e = limited(train, args, limit);
        // Allocating up to the limit takes its time: only the refusal's form is checked.
        let why = not_refused(&e, want).filter(|w| !w.starts_with("took"));
        assert!(
            why.is_none() && e.stderr.contains("RLIMIT_AS (ulimit -v)"),
            "train {args:?} under ulimit -v {}: {why:?} after {:?}: {}",
            limit / 1024,
            e.took,
            e.stderr
        );
        assert_eq!(e.code, Some(1), "{}", e.stderr);
        eprintln!("{args:?}: {}", e.stderr.lines().last().unwrap_or(""));
    }
}

/// Each rank's first stderr line that names `want` (oflaunch prefixes `[rank R] `).
fn rank_lines(stderr: &str, want: &str) -> Vec<(String, String)> {
    let mut seen: Vec<(String, String)> = Vec::new();
    for l in stderr.lines() {
        let Some((rank, rest)) = l.strip_prefix('[').and_then(|l| l.split_once("] ")) else {
            continue;
        };
        if rest.contains(want) && !seen.iter().any(|(r, _)| r == rank) {
            seen.push((rank.to_string(), rest.to_string()));
        }
    }
    seen
}

#[test]
fn under_oflaunch_every_rank_refuses_alike() {
    let (oflaunch, train) = common::binaries();
    let scratch = Scratch::new("launched");
    let p = |n: &str| scratch.p(n);
    let cases = [
        case(&["--batch-size", "100000000"], "--batch-size 100000000"),
        case(&["--layers", "100000", "--dp", "2"], "--layers 100000"),
        mlp(&["--zero", "1", "--layers", "2"], "--zero (parallel.zero)"),
        mlp(&["--save", &p("notes.txt")], "not a directory"),
        case(&["--data", &p("fifo")], "not a regular file"),
        case(&["--tokenizer", &p("notes.txt")], "not a tokenizer.json"),
        mlp(&["--tp", "3"], "--tp 3"),
        mlp(&["--lr", "nan"], "--lr"),
        mlp(&["--metrics", &p("notes.txt")], "names no run"),
        case(&["--virtual-stages", "2"], "--virtual-stages 2 interleaves"),
    ];
    for c in &cases {
        let mut cmd = Command::new(oflaunch);
        cmd.args(["--nproc-per-node", "2", "--backend", "cpu"])
            .arg(train)
            .args(&c.args);
        let e = run_limited(cmd, CASE_LIMIT * 2);
        let what = format!("oflaunch 2 train {:?}", c.args);
        if let Some(why) = not_refused(&e, &c.want) {
            panic!("{what}: {why}\n{}", e.stderr);
        }
        // oflaunch stops the other ranks at the first failure, so a rank may not get to say
        // why; those that do say the same.
        let lines = rank_lines(&e.stderr, &c.want);
        assert!(!lines.is_empty(), "{what}: no rank names {:?}", c.want);
        assert!(
            lines.iter().all(|(_, l)| *l == lines[0].1),
            "{what}: the ranks disagree: {lines:?}"
        );
        // Ranks 0 and 1 started alone (a rendezvous nobody else reaches, given up after 2 s):
        // each refuses before it, alike.
        let alone: Vec<Ended> = ["0", "1"]
            .iter()
            .map(|rank| {
                let mut cmd = Command::new(train);
                cmd.args(&c.args)
                    .env_clear()
                    .env("PATH", std::env::var_os("PATH").unwrap_or_default());
                for (k, v) in [
                    ("RANK", *rank),
                    ("LOCAL_RANK", rank),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                    ("OXIFLOW_BACKEND", "cpu"),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", "1"),
                    ("OXIFLOW_TOKEN", "catalogue"),
                    ("OXIFLOW_TIMEOUT", "2"),
                ] {
                    cmd.env(k, v);
                }
                run_limited(cmd, CASE_LIMIT * 2)
            })
            .collect();
        for (r, a) in alone.iter().enumerate() {
            if let Some(why) = not_refused(a, &c.want) {
                panic!("{what}, rank {r} alone: {why}\n{}", a.stderr);
            }
        }
        assert_eq!(
            without_available(&alone[0].stderr),
            without_available(&alone[1].stderr),
            "{what}: the ranks disagree"
        );
        assert_eq!(alone[0].code, alone[1].code, "{what}: the ranks disagree");
        eprintln!(
            "{what}: {:.0?}, every rank: {}",
            e.took,
            alone[0].stderr.lines().next().unwrap_or("")
        );
    }
}

#[test]
fn explain_explains_one_step_and_exits() {
    let (_, train) = common::binaries();
    for model in ["gpt", "mlp"] {
        let mut cmd = Command::new(train);
        cmd.args(["--model", model, "--explain"]);
        let e = run_limited(cmd, Duration::from_secs(30));
        assert_eq!(e.code, Some(0), "{model}: {}", e.stderr);
        assert!(
            e.stdout.contains("explained step loss"),
            "{model}: {}",
            e.stdout
        );
        assert!(
            common::curve(&e.stdout).is_empty() && !e.stdout.contains("final loss"),
            "{model} --explain trained: {}",
            e.stdout
        );
    }
}

/// `text` with the host's available memory (read by each rank at its own moment, so it may
/// differ between ranks by what other processes did meanwhile) left out.
fn without_available(text: &str) -> String {
    text.lines()
        .map(|l| match (l.find(" but "), l.find(" is available")) {
            (Some(a), Some(b)) if a < b => format!("{}{}", &l[..a], &l[b..]),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}
