//! The flag part of the hostile catalogue of `train`: every flag of the command line (and of
//! `train prepare`) against each mode (a GPT that trains, the MLP, `--explain`, a GPT that only
//! generates, `prepare`), each as a real process. A flag either acts (the run succeeds and the
//! configuration it prints holds the flag's key) or is refused naming it (a non-zero exit before
//! training); the table below says which, and a flag missing from it fails the test, so a new
//! flag cannot be silently ignored in some mode.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::CommandFactory;

use super::{run_limited, Ended, CASE_LIMIT};
use crate::common::{argv, succeed_in};

/// What a flag does in a mode.
#[derive(Clone, Copy, Debug)]
pub enum Does {
    /// The run succeeds and uses it.
    A,
    /// Refused, naming the flag.
    R,
    /// Refused, naming this.
    Rw(&'static str),
}
use Does::{Rw, A, R};

/// The modes, in the order of the table's columns.
pub const MODES: [&str; 5] = ["gpt", "mlp", "explain", "generate-only", "prepare"];

/// (flag, value ("": a switch; `{txt}` `{bin}` `{val}` `{ck}` `{job}` `{model}` `{hf}` are
/// filled in),
/// companions, what it does in each mode).
type Row = (
    &'static str,
    &'static str,
    &'static [&'static str],
    [Does; 5],
);

pub const FLAGS: &[Row] = &[
    ("--config", "{job}", &[], [A, A, A, A, R]),
    ("--model", "{model}", &[], [A, A, A, A, R]),
    ("--layers", "1", &[], [A, R, A, A, R]),
    ("--heads", "2", &[], [A, R, A, A, R]),
    ("--width", "16", &[], [A, R, A, A, R]),
    ("--seq-len", "8", &[], [A, R, A, A, R]),
    ("--vocab-multiple", "64", &[], [A, R, A, A, R]),
    ("--dropout", "0.1", &[], [A, R, A, R, R]),
    ("--hidden", "32", &[], [R, A, R, R, R]),
    ("--features", "8", &[], [R, A, R, R, R]),
    ("--classes", "3", &[], [R, A, R, R, R]),
    ("--dtype", "f64", &[], [A, A, A, Rw("dtype"), R]),
    ("--seed", "0", &[], [A, A, A, A, R]),
    ("--dp", "1", &[], [A, A, A, A, R]),
    ("--tp", "1", &[], [A, A, A, A, R]),
    ("--pp", "1", &[], [A, R, A, A, R]),
    ("--sp", "", &[], [A, R, A, A, R]),
    ("--cp", "1", &[], [A, R, A, A, R]),
    ("--ep", "1", &[], [A, R, A, A, R]),
    ("--cp-attention", "alltoall", &[], [A, R, A, A, R]),
    ("--micro-batches", "2", &[], [A, R, A, A, R]),
    (
        "--schedule",
        "gpipe",
        &["--micro-batches", "2"],
        [A, R, A, A, R],
    ),
    ("--virtual-stages", "2", &[], [R, R, R, R, R]),
    ("--zero", "1", &[], [A, R, A, A, R]),
    ("--recompute", "full", &[], [A, R, A, R, R]),
    ("--device", "cpu", &[], [A, A, A, A, R]),
    ("--backend", "cpu", &[], [A, A, A, A, R]),
    ("--precision", "f32", &[], [A, A, A, A, R]),
    ("--data", "{txt}", &[], [A, R, A, A, R]),
    ("--val-data", "{val}", &["--data", "{bin}"], [A, R, R, R, R]),
    ("--tokenizer", "bytes", &[], [A, R, A, A, A]),
    (
        "--shard-format",
        "raw",
        &["--data", "{bin}"],
        [A, R, A, A, R],
    ),
    ("--batch-size", "4", &[], [A, A, A, R, R]),
    ("--optimizer", "adamw", &[], [A, A, A, A, R]),
    ("--lr", "0.01", &[], [A, A, A, R, R]),
    ("--lr-schedule", "cosine", &[], [A, A, A, R, R]),
    ("--warmup-steps", "1", &[], [A, A, A, R, R]),
    (
        "--min-lr",
        "0.001",
        &["--lr-schedule", "cosine"],
        [A, A, A, R, R],
    ),
    ("--weight-decay", "0.1", &[], [A, A, A, R, R]),
    ("--momentum", "0.5", &[], [R, A, R, R, R]),
    ("--clip-grad", "1", &[], [A, A, A, R, R]),
    ("--grad-accum", "2", &[], [A, A, A, R, R]),
    ("--bucket-mb", "1", &[], [A, A, A, R, R]),
    ("--reduce-dtype", "bf16", &[], [A, R, A, R, R]),
    ("--steps", "3", &[], [A, A, A, A, R]),
    ("--log-every", "1", &[], [A, A, R, R, R]),
    ("--eval-every", "1", &[], [A, A, R, R, R]),
    ("--save", "s", &[], [A, A, Rw("--explain"), R, R]),
    (
        "--save-every",
        "1",
        &["--save", "s"],
        [A, A, Rw("--explain"), R, R],
    ),
    (
        "--save-gathered",
        "",
        &["--save", "s"],
        [A, A, Rw("--explain"), R, R],
    ),
    (
        "--resume",
        "{ck}",
        &["--steps", "4"],
        [A, A, Rw("--explain"), A, R],
    ),
    (
        "--allow-resume-mismatch",
        "",
        &["--resume", "{ck}", "--steps", "4"],
        [A, A, Rw("--explain"), A, R],
    ),
    ("--metrics", "m.jsonl", &[], [A, A, R, R, R]),
    ("--plot", "p.svg", &[], [A, A, R, R, R]),
    (
        "--overwrite",
        "",
        &["--metrics", "m.jsonl"],
        [A, A, R, R, R],
    ),
    (
        "--peak-tflops",
        "1",
        &["--metrics", "m.jsonl"],
        [A, A, R, R, R],
    ),
    ("--on-nonfinite", "skip", &[], [A, A, A, R, R]),
    ("--loss-spike-factor", "5", &[], [A, A, A, R, R]),
    ("--explain", "", &[], [A, A, A, Rw("--explain"), R]),
    ("--compile", "", &[], [A, A, A, R, R]),
    ("--generate", "hi", &[], [A, R, R, A, R]),
    ("--gen-tokens", "4", &[], [A, R, R, A, R]),
    ("--gen-warmup", "1", &[], [A, R, R, A, R]),
    ("--temperature", "0.5", &[], [A, R, R, A, R]),
    ("--prompt-ids", "5,17", &[], [A, R, R, A, R]),
    ("--top-k", "3", &[], [A, R, R, A, R]),
    ("--top-p", "0.9", &[], [A, R, R, A, R]),
    // A Llama's flags (every mode here builds a GPT or the MLP), and Hugging Face models.
    ("--kv-heads", "1", &[], [R, R, R, R, R]),
    ("--ffn-width", "32", &[], [R, R, R, R, R]),
    ("--rope-theta", "10000", &[], [R, R, R, R, R]),
    ("--norm-eps", "0.00001", &[], [R, R, R, R, R]),
    ("--tie-embeddings", "", &[], [R, R, R, R, R]),
    (
        "--from-hf",
        "{hf}",
        &[],
        [Rw("--from-hf"), R, Rw("--from-hf"), Rw("--from-hf"), R],
    ),
    ("--eval-only", "", &[], [Rw("--eval-only"), R, R, A, R]),
    ("--save-hf", "hf-out", &[], [A, R, R, A, R]),
    // LoRA: the generating mode's checkpoint holds no adapters.
    ("--lora-rank", "2", &[], [A, R, A, Rw("lora_A"), R]),
    (
        "--lora-alpha",
        "4",
        &["--lora-rank", "2"],
        [A, R, A, Rw("lora_A"), R],
    ),
    (
        "--lora-targets",
        "c_fc",
        &["--lora-rank", "2"],
        [A, R, A, Rw("lora_A"), R],
    ),
    (
        "--lora-dropout",
        "0",
        &["--lora-rank", "2"],
        [A, R, A, Rw("lora_A"), R],
    ),
    (
        "--merge-lora",
        "",
        &["--lora-rank", "2", "--save-hf", "hf-out"],
        [A, R, R, Rw("lora_A"), R],
    ),
    // `train prepare`'s own flags.
    ("--out", "out/q", &[], [R, R, R, R, A]),
    ("--format", "raw", &[], [R, R, R, R, A]),
    ("--shard-tokens", "1000", &[], [R, R, R, R, A]),
];

/// Every long flag of `train` and `train prepare` (but `--help`).
pub fn every_flag() -> Vec<String> {
    let cli = oxiflow::trainer::Cli::command();
    let prepare = cli
        .find_subcommand("prepare")
        .expect("train has a prepare mode")
        .clone();
    let mut v: Vec<String> = cli
        .get_arguments()
        .chain(prepare.get_arguments())
        .filter_map(|a| a.get_long())
        .filter(|l| *l != "help")
        .map(|l| format!("--{l}"))
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The inputs the cases read: a text, a raw shard, a job file, a GPT and an MLP checkpoint.
pub struct Fixture {
    pub dir: PathBuf,
}

impl Fixture {
    pub fn new(train: &Path) -> Fixture {
        let dir =
            std::env::temp_dir().join(format!("oxiflow-catalogue-flags-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let text: String = (0..3000).map(|i| format!("a line {i} of text\n")).collect();
        std::fs::write(dir.join("tiny.txt"), text).unwrap();
        let ids: Vec<u8> = (0..20000u16)
            .flat_map(|i| (i % 250).to_le_bytes())
            .collect();
        std::fs::write(dir.join("tiny.bin"), &ids).unwrap();
        std::fs::write(dir.join("val.bin"), &ids[..8000]).unwrap();
        std::fs::write(dir.join("job.toml"), "[model]\nseed = 0\n").unwrap();
        let f = Fixture { dir };
        let make = |args: &[&str]| {
            succeed_in(train, &f.dir, args);
        };
        let txt = f.p("tiny.txt");
        let mut gpt = vec!["--data", &txt];
        gpt.extend(argv(
            "--layers 1 --width 16 --heads 2 --seq-len 8 --steps 2 --gen-tokens 0 --save gck",
        ));
        make(&gpt);
        make(&["--model", "mlp", "--steps", "2", "--save", "mck"]);
        f
    }

    fn p(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_string()
    }

    /// `s` with the placeholders filled in for `mode`.
    fn fill(&self, s: &str, mode: &str) -> String {
        let model = if mode == "mlp" { "mlp" } else { "gpt" };
        let ck = if mode == "mlp" { "mck" } else { "gck" };
        s.replace("{txt}", &self.p("tiny.txt"))
            .replace("{bin}", &self.p("tiny.bin"))
            .replace("{val}", &self.p("val.bin"))
            .replace("{ck}", &self.p(ck))
            .replace("{job}", &self.p("job.toml"))
            .replace(
                "{hf}",
                concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/llama"),
            )
            .replace("{model}", model)
    }

    /// The command line of `flag value` with `companions` in `mode`.
    pub fn args(&self, mode: &str, flag: &str, value: &str, companions: &[&str]) -> Vec<String> {
        let gpt = argv("--data {txt} --layers 1 --width 16 --heads 2 --seq-len 8");
        let base: Vec<&str> = match mode {
            "gpt" => [&gpt[..], &["--steps", "2"]].concat(),
            "mlp" => vec!["--model", "mlp", "--steps", "2"],
            "explain" => [&gpt[..], &["--explain"]].concat(),
            "generate-only" => [
                &gpt[..],
                &["--resume", "{ck}", "--generate", "hi", "--gen-tokens", "4"],
            ]
            .concat(),
            _ => vec![],
        };
        // (flag, value) pairs, later ones replacing earlier ones of the same flag.
        let mut pairs: Vec<(String, Option<String>)> = Vec::new();
        let mut push = |items: &[&str]| {
            let mut i = 0;
            while i < items.len() {
                let f = items[i].to_string();
                let v = items.get(i + 1).filter(|v| !v.starts_with("--"));
                i += 1 + usize::from(v.is_some());
                let v = v.map(|v| self.fill(v, mode));
                pairs.retain(|(g, _)| *g != f);
                pairs.push((f, v));
            }
        };
        push(&base);
        if mode != "prepare" {
            push(companions);
        }
        match value {
            "" => push(&[flag]),
            v => push(&[flag, v]),
        }
        let mut args: Vec<String> = Vec::new();
        if mode == "prepare" {
            args.extend(["prepare".into(), "--out".into(), "out/p".into()]);
        }
        for (f, v) in pairs {
            if mode == "prepare" && f == "--out" {
                args.retain(|a| a != "--out" && a != "out/p");
            }
            args.push(f);
            args.extend(v);
        }
        if mode == "prepare" {
            args.push(self.p("tiny.txt"));
        }
        args
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Why `e` is not what `does` says for `flag`, if it is not.
fn wrong(e: &Ended, flag: &str, does: Does) -> Option<String> {
    let key = flag.trim_start_matches("--");
    match does {
        A if e.code != Some(0) => Some(format!("refused: {}", e.stderr.trim_end())),
        A => {
            let config: Vec<&str> = e
                .stdout
                .lines()
                .filter(|l| l.starts_with("config ["))
                .collect();
            let printed = config.iter().any(|l| l.contains(&format!(" {key}=")));
            let keyless = argv("--config --out --format --shard-tokens --tokenizer");
            (!printed && !config.is_empty() && !keyless.contains(&flag))
                .then(|| format!("accepted, but its configuration has no {key}: {config:?}"))
        }
        R | Rw(_) => {
            let want = match does {
                Rw(w) => w,
                _ => flag,
            };
            if e.code == Some(0) || e.code.is_none() {
                Some(format!(
                    "not refused (exit {:?}): {}",
                    e.code,
                    e.stderr.trim_end()
                ))
            } else if !e.stderr.contains(want) {
                Some(format!(
                    "refused without naming {want}: {}",
                    e.stderr.trim_end()
                ))
            } else if let Some(name) = super::internal_name(&e.stderr) {
                Some(format!("the refusal leaks the internal name {name:?}"))
            } else if e.stdout.contains("final loss") || e.stderr.contains("panicked") {
                Some("trained or panicked".into())
            } else {
                None
            }
        }
    }
}

/// Runs the table: (failures, cases run).
pub fn run_all(train: &Path) -> (Vec<String>, usize) {
    let mut failures = Vec::new();
    let listed: Vec<&str> = FLAGS.iter().map(|r| r.0).collect();
    for f in every_flag() {
        if !listed.contains(&f.as_str()) {
            failures.push(format!(
                "{f} is not in the flag table: say in tests/catalogue_flags what it does in \
                 each mode (acts or is refused)"
            ));
        }
    }
    let fixture = Fixture::new(train);
    let mut cases = 0;
    for (flag, value, companions, does) in FLAGS {
        for (mode, d) in MODES.iter().zip(does) {
            let cwd = fixture.dir.join(format!("case-{cases}"));
            std::fs::create_dir_all(cwd.join("out")).unwrap();
            let args = fixture.args(mode, flag, value, companions);
            let mut cmd = Command::new(train);
            cmd.args(&args).current_dir(&cwd);
            let e = run_limited(cmd, CASE_LIMIT * 6);
            if let Some(why) = wrong(&e, flag, *d) {
                failures.push(format!("{mode} {flag}: train {args:?}: {why}"));
            }
            cases += 1;
        }
    }
    (failures, cases)
}
