//! The file part of the hostile catalogue of `train`: outputs aimed at inputs (the same file
//! by name, `./name`, a hard link, a symlink, a symlinked folder; a checkpoint's own files; one
//! path for two outputs), outputs of other runs, token files with damaged or misleading headers
//! (u16 and u32 ids), tokenizer.json files that cannot be used, resumes onto other data, batch
//! sizes, tokenizers (by name or by a file's hash) or shard sets, and checkpoints whose
//! manifests were edited with their checksum recomputed. Each case runs in a folder holding
//! real inputs (a text corpus, token shards, a job file, checkpoints, the metrics and plot of
//! another run) and must be refused before training, naming the fragment given, with every file
//! of the folder byte-identical afterwards and no file added or removed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use super::catalogue_damages::edit;
use super::{not_refused, run_limited, Ended, CASE_LIMIT};

/// Everything under `dir`: each path with what it is (a file's bytes, a symlink's target, a
/// folder).
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let what = if m.is_symlink() {
                let mut v = b"link ".to_vec();
                v.extend(std::fs::read_link(&p).unwrap().to_string_lossy().bytes());
                v
            } else if m.is_dir() {
                todo.push(p.clone());
                b"folder".to_vec()
            } else if m.is_file() {
                std::fs::read(&p).unwrap()
            } else {
                b"special".to_vec()
            };
            out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), what);
        }
    }
    out
}

/// What differs between two snapshots, if anything.
pub fn changes(
    before: &BTreeMap<PathBuf, Vec<u8>>,
    after: &BTreeMap<PathBuf, Vec<u8>>,
) -> Vec<String> {
    let mut v = Vec::new();
    for (p, b) in before {
        match after.get(p) {
            None => v.push(format!("{} was removed", p.display())),
            Some(a) if a != b => v.push(format!("{} was changed", p.display())),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        v.push(format!("{} was created", p.display()));
    }
    v
}

/// The folder of real inputs the cases aim at.
pub struct Inputs(pub PathBuf);

/// A metrics file of another run.
pub const OTHER_RUN: &str = "{\"kind\":\"run\",\"run_id\":\"feedface00000000\",\"from_step\":0}\n";

impl Inputs {
    /// The folder, with a checkpoint `ck` of a 2-step MLP made by `train`.
    pub fn new(tag: &str, train: &Path) -> Inputs {
        let d = std::env::temp_dir().join(format!(
            "oxiflow-catalogue-files-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("sub")).unwrap();
        let text: String = (0..4000)
            .map(|i| format!("line {i} of the corpus\n"))
            .collect();
        std::fs::write(d.join("c.txt"), &text).unwrap();
        std::fs::hard_link(d.join("c.txt"), d.join("hard.txt")).unwrap();
        std::os::unix::fs::symlink(d.join("c.txt"), d.join("link.jsonl")).unwrap();
        std::os::unix::fs::symlink(&d, d.join("sub/up")).unwrap();
        std::fs::write(d.join("s.lock"), &text[..2000]).unwrap();
        std::fs::write(d.join("j.config.toml"), "[run]\nlog-every = 1\n").unwrap();
        std::fs::write(d.join("other.jsonl"), OTHER_RUN).unwrap();
        std::fs::write(d.join("notes.txt"), "my notes\n").unwrap();
        std::fs::write(
            d.join("other.svg"),
            "<svg xmlns=\"http://www.w3.org/2000/svg\"><!-- oxiflow-run feedface00000000 --></svg>\n",
        )
        .unwrap();
        std::fs::write(
            d.join("drawing.svg"),
            "<svg xmlns=\"http://www.w3.org/2000/svg\"/>\n",
        )
        .unwrap();
        let ids: Vec<u16> = (0..4000u16).map(|i| i % 200).collect();
        let le = |ids: &[u16]| -> Vec<u8> { ids.iter().flat_map(|i| i.to_le_bytes()).collect() };
        std::fs::write(d.join("ok.bin"), le(&ids)).unwrap();
        std::fs::write(d.join("val.bin"), le(&ids[..2000])).unwrap();
        token_files(&d, &ids);
        tokenizer_files(&d);
        std::fs::create_dir_all(d.join("set")).unwrap();
        std::fs::write(d.join("set/a.bin"), le(&ids)).unwrap();
        std::fs::write(d.join("set/b.bin"), le(&ids[..3000])).unwrap();
        let run = |args: &[&str]| {
            let out = Command::new(train)
                .args(args)
                .current_dir(&d)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&["--model", "mlp", "--steps", "2", "--save", "ck"]);
        run(&[
            "--data",
            "set/a.bin",
            "--width",
            "32",
            "--layers",
            "1",
            "--seq-len",
            "16",
            "--gen-tokens",
            "0",
            "--steps",
            "2",
            "--save",
            "gck",
        ]);
        run(&[
            "--data",
            "c.txt",
            "--tokenizer",
            "tok",
            "--width",
            "32",
            "--layers",
            "1",
            "--seq-len",
            "16",
            "--gen-tokens",
            "0",
            "--steps",
            "2",
            "--save",
            "tck",
        ]);
        edited_copies(&d);
        Inputs(d)
    }
}

/// llm.c and pre-tokenized files of `ids`: whole, and with damaged headers.
fn token_files(d: &Path, ids: &[u16]) {
    let llmc = |name: &str, magic: i32, version: i32, count: i32| {
        let mut h = vec![0i32; 256];
        (h[0], h[1], h[2]) = (magic, version, count);
        let mut b: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        b.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
        std::fs::write(d.join(name), b).unwrap();
    };
    let n = ids.len() as i32;
    llmc("llmc.bin", 20240520, 1, n);
    llmc("flip.bin", 20240520 ^ (1 << 9), 1, n);
    llmc("version.bin", 20240520, 2, n);
    llmc("count.bin", 20240520, 1, n + 7);
    let pre = |name: &str, magic: &[u8], vocab: u32| {
        let mut b = magic.to_vec();
        b.extend(vocab.to_le_bytes());
        b.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
        std::fs::write(d.join(name), b).unwrap();
    };
    pre("pre.bin", b"OXFTOK16", 256);
    pre("pre50k.bin", b"OXFTOK16", 50257);
    pre("preflip.bin", b"OXFTOJ16", 256);
    pre("pre.txt", b"OXFTOK16", 50257);
    // The same with u32 ids: llm.c's Llama 3 shards (one id above 65535) and OXFTOK32.
    let wide: Vec<u32> = ids.iter().map(|&i| u32::from(i)).chain([70_000]).collect();
    let llmc32 = |name: &str, magic: i32, version: i32, count: i32| {
        let mut h = vec![0i32; 256];
        (h[0], h[1], h[2]) = (magic, version, count);
        let mut b: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        b.extend(wide.iter().flat_map(|i| i.to_le_bytes()));
        std::fs::write(d.join(name), b).unwrap();
    };
    let n = wide.len() as i32;
    llmc32("l3.bin", 20240801, 7, n);
    llmc32("l3flip.bin", 20240801 ^ (1 << 9), 7, n);
    llmc32("l3version.bin", 20240801, 2, n);
    llmc32("l3count.bin", 20240801, 7, n + 7);
    std::fs::create_dir_all(d.join("mix")).unwrap();
    std::fs::copy(d.join("llmc.bin"), d.join("mix/a.bin")).unwrap();
    std::fs::copy(d.join("l3.bin"), d.join("mix/b.bin")).unwrap();
    let pre32 = |name: &str, magic: &[u8], vocab: u32| {
        let mut b = magic.to_vec();
        b.extend(vocab.to_le_bytes());
        b.extend(wide.iter().flat_map(|i| i.to_le_bytes()));
        std::fs::write(d.join(name), b).unwrap();
    };
    pre32("pre32.bin", b"OXFTOK32", 70_344);
    pre32("pre32flip.bin", b"OXFTOK33", 70_344);
}

/// Tokenizer folders from tests/fixtures/tokenizers: `tok` (GPT-2 style), `tok3` (Llama 3
/// style, as many ids), `tokw` (ids above 65535), and `badeos`, whose tokenizer_config.json
/// names an end-of-text token the tokenizer does not hold; tokenizer files that cannot be
/// used: `dropbyte.json` (a byte missing), `empty.json`, `emptytok/tokenizer.json`; a text
/// named like a shard of `prepare --out pq` (`pq_000000.bin`) and a link to it.
fn tokenizer_files(d: &Path) {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers");
    for (from, to) in [
        ("gpt2-style", "tok"),
        ("llama3-style", "tok3"),
        ("wide", "tokw"),
        ("llama3-style", "badeos"),
    ] {
        copy_dir(&fixtures.join(from), &d.join(to));
    }
    std::fs::write(
        d.join("badeos/tokenizer_config.json"),
        "{\"eos_token\": \"<|nope|>\"}\n",
    )
    .unwrap();
    // The GPT-2 style BPE without byte 0's character: it would drop that byte.
    let mut doc: Value =
        serde_json::from_slice(&std::fs::read(d.join("tok/tokenizer.json")).unwrap()).unwrap();
    doc["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .remove("\u{100}");
    std::fs::write(d.join("dropbyte.json"), doc.to_string()).unwrap();
    std::fs::write(d.join("empty.json"), "").unwrap();
    // Text named like a shard of `prepare --out pq`, and a link to it.
    std::fs::write(
        d.join("pq_000000.bin"),
        "a text that prepare must not overwrite\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(d.join("pq_000000.bin"), d.join("pqlink.txt")).unwrap();
    std::fs::create_dir_all(d.join("emptytok")).unwrap();
    std::fs::write(d.join("emptytok/tokenizer.json"), "").unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Copies of the MLP checkpoint `ck` (at step 2, AdamW... SGD with momentum) with manifests
/// edited as a hostile user would, the checksum recomputed.
fn edited_copies(d: &Path) {
    type Edit = fn(&mut Value);
    let edits: [(&str, Edit); 4] = [
        ("ck-step", |m| m["metadata"]["step"] = json!("1")),
        ("ck-datastep", |m| m["metadata"]["step"] = json!("3")),
        ("ck-reset", |m| {
            let tensors = m["tensors"].as_object_mut().unwrap();
            let state: Vec<String> = tensors
                .keys()
                .filter(|k| k.starts_with("optim/"))
                .cloned()
                .collect();
            for k in &state {
                tensors.remove(k);
            }
            m["optimizer"]["empty"] = json!(state);
        }),
        ("ck-swap", |m| {
            let t = m["tensors"].as_object_mut().unwrap();
            let a = t.remove("optim/mlp.fc1.bias/momentum_buffer").unwrap();
            let b = t.remove("optim/mlp.fc2.bias/momentum_buffer").unwrap();
            t.insert("optim/mlp.fc1.bias/momentum_buffer".into(), b);
            t.insert("optim/mlp.fc2.bias/momentum_buffer".into(), a);
        }),
    ];
    for (name, f) in edits {
        copy_dir(&d.join("ck"), &d.join(name));
        edit(&d.join(name), f);
    }
}

impl Drop for Inputs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The GPT of the checkpoints `gck` and `tck` (no sample) with `rest`.
fn tiny(rest: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec![
        "--width",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--gen-tokens",
        "0",
    ];
    v.extend_from_slice(rest);
    v
}

/// The cases: `train ARGS` (in the folder) and the fragment the refusal must name.
pub fn cases() -> Vec<(Vec<&'static str>, &'static str)> {
    vec![
        // An output over an input, however it is named.
        (vec!["--data", "c.txt", "--metrics", "c.txt"], "is --data's"),
        (
            vec!["--data", "c.txt", "--metrics", "./c.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "./c.txt", "--metrics", "sub/../c.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "c.txt", "--metrics", "hard.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "c.txt", "--metrics", "sub/up/c.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "c.txt", "--metrics", "link.jsonl"],
            "is a symlink",
        ),
        (
            vec!["--data", "ok.bin", "--metrics", "ok.bin"],
            "is --data's",
        ),
        (
            vec![
                "--data",
                "ok.bin",
                "--val-data",
                "val.bin",
                "--metrics",
                "val.bin",
            ],
            "is --val-data's",
        ),
        (
            vec!["--config", "j.config.toml", "--metrics", "j.config.toml"],
            "is --config's",
        ),
        (
            vec!["--data", "ok.bin", "--val-data", "./ok.bin"],
            "held-out data must not be trained on",
        ),
        (
            vec!["--data", "set/*.bin", "--val-data", "set/b.bin"],
            "held-out data must not be trained on",
        ),
        (
            vec!["--model", "mlp", "--config", "j.config.toml", "--save", "j"],
            "is --config's",
        ),
        (vec!["--data", "s.lock", "--save", "s"], "is --data's"),
        (
            vec!["--data", "ck/manifest.json", "--save", "ck"],
            "which a save replaces",
        ),
        (
            vec![
                "--model",
                "mlp",
                "--resume",
                "ck",
                "--metrics",
                "ck/manifest.json",
            ],
            "lies inside --resume's",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck", "--plot", "ck/loss.svg"],
            "lies inside --resume's",
        ),
        // Two outputs on one file.
        (
            vec!["--model", "mlp", "--metrics", "m.svg", "--plot", "m.svg"],
            "two outputs never share",
        ),
        (
            vec!["--model", "mlp", "--metrics", "m.svg", "--plot", "./m.svg"],
            "two outputs never share",
        ),
        (
            vec![
                "--model",
                "mlp",
                "--metrics",
                "ck2/m.jsonl",
                "--save",
                "ck2",
            ],
            "two outputs never share",
        ),
        (
            vec![
                "--model",
                "mlp",
                "--metrics",
                "ck2.config.toml",
                "--save",
                "ck2",
            ],
            "two outputs never share",
        ),
        (
            vec!["--model", "mlp", "--save", "ck3", "--metrics", "ck3.lock"],
            "two outputs never share",
        ),
        // Outputs of another run, or no run's.
        (
            vec!["--model", "mlp", "--metrics", "other.jsonl"],
            "holds the records of run feedface00000000",
        ),
        (
            vec!["--model", "mlp", "--metrics", "notes.txt"],
            "names no run",
        ),
        (
            vec!["--model", "mlp", "--plot", "other.svg"],
            "is the plot of run feedface00000000",
        ),
        (
            vec!["--model", "mlp", "--plot", "drawing.svg"],
            "names no run",
        ),
        (
            vec![
                "--model",
                "mlp",
                "--resume",
                "ck",
                "--steps",
                "4",
                "--metrics",
                "other.jsonl",
            ],
            "holds the records of run feedface00000000",
        ),
        // Token files by header: damaged headers named by field, pre-tokenized files never
        // read as ids, raw ids only where nothing else is.
        (
            vec!["--data", "flip.bin"],
            "damaged llm.c header: its magic (bytes 0..4)",
        ),
        (
            vec!["--data", "flip.bin", "--shard-format", "llmc"],
            "the llm.c header's magic (bytes 0..4) is 20241032",
        ),
        (
            vec!["--data", "preflip.bin"],
            "damaged pre-tokenized header: its magic (bytes 0..8)",
        ),
        (vec!["--data", "version.bin"], "version (bytes 4..8) is 2"),
        (
            vec!["--data", "count.bin"],
            "token count (bytes 8..12) is 4007",
        ),
        (
            vec!["--data", "pre50k.bin"],
            "vocabulary size (bytes 8..12) is 50257, more than the bytes tokenizer's 256",
        ),
        (
            vec!["--data", "pre.txt"],
            "vocabulary size (bytes 8..12) is 50257",
        ),
        (
            vec!["--data", "pre.bin", "--shard-format", "raw"],
            "--shard-format (data.shard-format)",
        ),
        (vec!["--data", "pre*.bin"], "not a token shard"),
        (
            vec!["--data", "ok.bin", "--shard-format", "llmc"],
            "magic (bytes 0..4) is 65536",
        ),
        (
            vec!["--data", "llmc.bin", "--shard-format", "raw"],
            "starts with llm.c's magic",
        ),
        (
            vec!["--data", "l3flip.bin"],
            "damaged llm.c header: its magic (bytes 0..4) is 20241313, 1 bit(s) away from \
             llm.c's 20240801",
        ),
        (
            vec!["--data", "l3flip.bin", "--shard-format", "llmc"],
            "the llm.c header's magic (bytes 0..4) is 20241313, neither",
        ),
        (
            vec!["--data", "l3version.bin"],
            "version (bytes 4..8) is 2, not 7",
        ),
        (
            vec!["--data", "l3count.bin"],
            "token count (bytes 8..12) is 4008 (17056 bytes with the header, u32 ids)",
        ),
        (
            vec!["--data", "l3.bin"],
            "at byte 17024: token 4000 is id 70000, not below the vocabulary size 256",
        ),
        (
            vec!["--data", "l3.bin", "--tokenizer", "tok"],
            "token 4000 is id 70000, not below the vocabulary size 600",
        ),
        (
            vec!["--data", "l3.bin", "--shard-format", "raw"],
            "starts with llm.c's magic 20240801",
        ),
        (
            vec!["--data", "mix/*.bin", "--tokenizer", "tokw"],
            "holds u32 ids but the set's first shard",
        ),
        // u16 ids cannot be a tokenizer's whose ids need u32: shards of another tokenizer.
        (
            vec!["--data", "llmc.bin", "--tokenizer", "tokw"],
            "llmc.bin at byte 0: holds u16 ids (llm.c's GPT-2 format, at most 65536 ids) but \
             the tokenizer's vocabulary has 70344 ids",
        ),
        (
            vec!["--data", "ok.bin", "--tokenizer", "tokw"],
            "ok.bin at byte 0: holds u16 ids (nanoGPT's raw format",
        ),
        (
            vec![
                "--data",
                "l3.bin",
                "--val-data",
                "llmc.bin",
                "--tokenizer",
                "tokw",
            ],
            "llmc.bin at byte 0: holds u16 ids",
        ),
        (
            vec!["--data", "pre32.bin"],
            "vocabulary size (bytes 8..12) is 70344, more than the bytes tokenizer's 256",
        ),
        (
            vec!["--data", "pre32.bin", "--tokenizer", "tok"],
            "vocabulary size (bytes 8..12) is 70344, more than the",
        ),
        (
            vec!["--data", "pre32flip.bin"],
            "damaged pre-tokenized header: its magic (bytes 0..8)",
        ),
        // Tokenizer files that cannot be used.
        (
            vec!["--data", "c.txt", "--tokenizer", "nope.json"],
            "--tokenizer nope.json: not bytes or gpt2",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "sub"],
            "a directory without a tokenizer.json",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "notes.txt"],
            "not a tokenizer.json the tokenizers library reads",
        ),
        (
            vec![
                "prepare",
                "--out",
                "pp",
                "--tokenizer",
                "dropbyte.json",
                "c.txt",
            ],
            "tokenizer dropbyte.json: a byte-level BPE without unk_token or byte_fallback whose \
             vocabulary lacks 1 of the 256 byte characters",
        ),
        // An input among the shards prepare writes would be overwritten before it is read.
        (
            vec!["prepare", "--out", "pq", "c.txt", "pq_000000.bin"],
            "prepare pq_000000.bin: is ",
        ),
        (
            vec!["prepare", "--out", "sub/../pq", "c.txt", "pqlink.txt"],
            "pq_000000.bin, a shard name of --out sub/../pq (sub/../pq_NNNNNN.bin)",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "empty.json"],
            "tokenizer empty.json: not a tokenizer.json the tokenizers library reads",
        ),
        (
            vec!["prepare", "--out", "pp", "--tokenizer", "emptytok", "c.txt"],
            "tokenizer emptytok/tokenizer.json: not a tokenizer.json",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "badeos"],
            "its eos_token \"<|nope|>\" is no token",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", ""],
            "empty: give bytes, gpt2",
        ),
        (
            vec![
                "prepare",
                "--out",
                "pp",
                "--format",
                "raw",
                "--tokenizer",
                "tokw",
                "c.txt",
            ],
            "--format raw holds u16 ids",
        ),
        (
            vec![
                "prepare",
                "--out",
                "pp",
                "--tokenizer",
                "notes.txt",
                "c.txt",
            ],
            "--tokenizer notes.txt",
        ),
        // Resumes onto something else than the checkpoint's run.
        (
            tiny(&["--resume", "gck", "--data", "val.bin", "--steps", "4"]),
            "--data file 1 was",
        ),
        (
            tiny(&["--resume", "gck", "--data", "set/*.bin", "--steps", "4"]),
            "but this run reads 2",
        ),
        (
            tiny(&[
                "--resume",
                "gck",
                "--data",
                "set/a.bin",
                "--batch-size",
                "8",
                "--steps",
                "4",
            ]),
            "saved with batch_size 16 but this run has --batch-size 8",
        ),
        (
            tiny(&[
                "--resume",
                "gck",
                "--data",
                "set/a.bin",
                "--tokenizer",
                "gpt2",
                "--steps",
                "4",
            ]),
            "saved with tokenizer bytes but this run has --tokenizer gpt2",
        ),
        (
            tiny(&[
                "--resume",
                "gck",
                "--data",
                "set/a.bin",
                "--tokenizer",
                "tok",
                "--steps",
                "4",
            ]),
            "saved with tokenizer bytes but this run has --tokenizer sha256:",
        ),
        (
            tiny(&[
                "--resume",
                "tck",
                "--data",
                "c.txt",
                "--tokenizer",
                "tok3",
                "--steps",
                "4",
            ]),
            "tok/tokenizer.json but this run has --tokenizer sha256:",
        ),
        (
            vec![
                "--width",
                "32",
                "--layers",
                "1",
                "--seq-len",
                "16",
                "--resume",
                "tck",
                "--tokenizer",
                "tok3",
                "--generate",
                "hi",
            ],
            "tok/tokenizer.json or --allow-resume-mismatch",
        ),
        (
            tiny(&[
                "--resume",
                "gck",
                "--data",
                "set/a.bin",
                "--val-data",
                "set/b.bin",
                "--steps",
                "4",
            ]),
            "saved reading no --val-data file but this run reads",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck", "--batch-size", "32"],
            "batch_size 64",
        ),
        // Manifests edited with their checksum recomputed.
        (
            vec!["--model", "mlp", "--resume", "ck-step"],
            "optimizer.step_count 2 is beyond metadata step 1",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck-datastep"],
            "metadata data.step \"2\" is not its step 3",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck-reset"],
            "optimizer.empty lists",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck-swap"],
            "has shape [4] but its parameter mlp.fc1.bias has [64]",
        ),
    ]
}

/// Runs every case with `train`; returns the failures and the number of cases.
pub fn run_all(train: &Path) -> (Vec<String>, usize) {
    let inputs = Inputs::new("single", train);
    let mut failures = Vec::new();
    let cases = cases();
    for (args, want) in &cases {
        let before = snapshot(&inputs.0);
        let mut cmd = Command::new(train);
        cmd.args(args).current_dir(&inputs.0);
        let e: Ended = run_limited(cmd, CASE_LIMIT * 2);
        let what = format!("train {args:?}");
        if let Some(why) = not_refused(&e, want) {
            failures.push(format!("{what}: {why}\n  stderr: {}", e.stderr.trim_end()));
        }
        let changed = changes(&before, &snapshot(&inputs.0));
        if !changed.is_empty() {
            failures.push(format!("{what}: {}", changed.join(", ")));
        }
        let said = e.stderr.lines().find(|l| l.contains(want)).unwrap_or("");
        eprintln!("{args:?}: {said}");
    }
    (failures, cases.len())
}

/// What `train ARGS` in `dir` printed and exited with.
fn train_in(train: &Path, dir: &Path, args: &[&str]) -> Ended {
    let mut cmd = Command::new(train);
    cmd.args(args).current_dir(dir);
    run_limited(cmd, CASE_LIMIT * 6)
}

/// The run ids of the run records of the metrics file at `path`, with their first steps.
fn runs_of(path: &Path) -> Vec<(String, u64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["kind"] == "run")
        .map(|r| {
            (
                r["run_id"].as_str().unwrap().to_string(),
                r["from_step"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// A run continues its own metrics and plot when it resumes, refuses another run's, and
/// replaces them only with `--overwrite`; the save path of a live job is refused at once.
pub fn own_outputs_and_live_saves(train: &Path) {
    let inputs = Inputs::new("flows", train);
    let d = &inputs.0;
    let first = [
        "--model",
        "mlp",
        "--steps",
        "6",
        "--log-every",
        "2",
        "--save",
        "run",
        "--metrics",
        "m.jsonl",
        "--plot",
        "p.png",
    ];
    let e = train_in(train, d, &first);
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let runs = runs_of(&d.join("m.jsonl"));
    assert_eq!(runs.len(), 1, "{runs:?}");
    let plot = std::fs::read(d.join("p.png")).unwrap();
    // The same command again is another run: refused, nothing changed.
    let before = snapshot(d);
    let e = train_in(train, d, &first);
    assert!(
        not_refused(&e, &format!("holds the records of run {}", runs[0].0)).is_none(),
        "{}",
        e.stderr
    );
    assert!(changes(&before, &snapshot(d)).is_empty());
    // Resuming the run continues both.
    let mut resumed = first.to_vec();
    resumed.extend(["--resume", "run"]);
    resumed[3] = "10";
    let e = train_in(train, d, &resumed);
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let again = runs_of(&d.join("m.jsonl"));
    assert_eq!(again, [runs[0].clone(), (runs[0].0.clone(), 6)]);
    assert_ne!(
        std::fs::read(d.join("p.png")).unwrap(),
        plot,
        "the plot is redrawn"
    );
    // --overwrite replaces them with a new run's.
    let mut fresh = first.to_vec();
    fresh[7] = "run2";
    fresh.push("--overwrite");
    let e = train_in(train, d, &fresh);
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let replaced = runs_of(&d.join("m.jsonl"));
    assert!(
        replaced.len() == 1 && replaced[0].0 != runs[0].0,
        "{replaced:?}"
    );
    // A live job holds its save path: a second job is refused at once, naming its pid.
    let mut long = Command::new(train);
    long.args([
        "--model",
        "mlp",
        "--steps",
        "100000000",
        "--log-every",
        "100000000",
        "--save",
        "held",
    ])
    .current_dir(d)
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    let mut holder = long.spawn().unwrap();
    let lock = d.join("held.job.lock");
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|s| s.contains("pid")) {
        assert!(start.elapsed() < CASE_LIMIT, "the job never took its lock");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let before = snapshot(d);
    let e = train_in(
        train,
        d,
        &["--model", "mlp", "--steps", "3", "--save", "./held"],
    );
    let _ = holder.kill();
    let _ = holder.wait();
    let want = format!("held by a live job (pid {} on host", holder.id());
    assert!(not_refused(&e, &want).is_none(), "{}", e.stderr);
    assert!(
        e.took < CASE_LIMIT,
        "refused at once, not after {:?}",
        e.took
    );
    assert!(changes(&before, &snapshot(d)).is_empty());
}
