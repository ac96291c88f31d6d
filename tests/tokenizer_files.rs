//! Hugging Face tokenizer.json files end to end, with real processes: `train prepare` with the
//! fixture whose ids exceed 16 bits writes llm.c's Llama 3 shards (u32 ids) holding exactly the
//! ids Python's `tokenizers` package gives (tests/fixtures/tokenizers/reference.json), after its
//! end-of-text token; `train` reads them back under oflaunch (2 ranks) and samples through the
//! tokenizer; `prepare` and `train` both default to the byte tokenizer and say so (and
//! `prepare` names shards an earlier run left behind its last one); a checkpoint
//! records a tokenizer file by its hash, so a copy elsewhere resumes and another file is
//! refused.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{argv, curve, launch, ok};
use serde_json::Value;

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("tokfiles", name)
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `train ARGS` in `dir`: (exit code, stdout, stderr).
fn train(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let (_, train) = common::binaries();
    let out = Command::new(train)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const SMALL: &str = "--layers 1 --width 16 --heads 2 --seq-len 8 --batch-size 4 --log-every 1";

#[test]
fn prepare_writes_u32_shards_of_the_python_ids_that_train_reads() {
    let d = tmp("wide");
    let wide = fixtures().join("wide");
    let sample = fixtures().join("sample.txt");
    let (code, out, err) = train(
        &d,
        &["prepare", "--out", "w", "--tokenizer", s(&wide), s(&sample)],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("llmc shards of u32 ids (llm.c's Llama 3 header: magic 20240801, version 7)")
            && out.contains("vocabulary 70344")
            && out.contains(
                "each document after <|endoftext|> (id 70000, from the added special tokens)"
            ),
        "{out}"
    );
    // The shard: llm.c's Llama 3 header, then the end-of-text id and the package's ids.
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap())
            .unwrap();
    let mut want: Vec<u32> = vec![70_000];
    want.extend(
        reference["wide"]["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32),
    );
    let bytes = std::fs::read(d.join("w_000000.bin")).unwrap();
    let word = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(
        (word(0), word(1), word(2)),
        (20240801, 7, want.len() as i32)
    );
    assert!(bytes[12..1024].iter().all(|&b| b == 0));
    let ids: Vec<u32> = bytes[1024..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(ids, want);
    // Two ranks train on it and sample through the tokenizer.
    let glob = format!("{}/w_*.bin", d.display());
    let mut args = argv(SMALL);
    args.extend([
        "--tokenizer",
        s(&wide),
        "--data",
        &glob,
        "--steps",
        "3",
        "--generate",
        "The license",
        "--gen-tokens",
        "6",
    ]);
    let run = ok(launch(2, &args));
    assert!(
        run.contains("vocab 70344")
            && run.contains(&format!(
                "1 llmc (u32 ids) shards {glob:?} ({} tokens",
                want.len()
            ))
            && run.contains(&format!("tokenizer {}", wide.display())),
        "{run}"
    );
    assert_eq!(curve(&run).len(), 3, "{run}");
    assert!(run.contains("sample (temperature"), "{run}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn prepare_and_train_default_to_bytes_and_say_so() {
    let d = tmp("default");
    let sample = fixtures().join("sample.txt");
    let (code, out, err) = train(&d, &["prepare", "--out", "b", s(&sample)]);
    assert_eq!(code, Some(0), "{out}{err}");
    let size = std::fs::metadata(&sample).unwrap().len();
    assert!(
        out.contains(&format!(
            "-> {size} tokens of tokenizer bytes (vocabulary 256; documents not separated"
        )) && out
            .contains("llmc shards of u16 ids (llm.c's GPT-2 header: magic 20240520, version 1)"),
        "{out}"
    );
    let mut args = argv(SMALL);
    args.extend(argv("--data b_000000.bin --steps 1 --gen-tokens 0"));
    let (code, out, err) = train(&d, &args);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("tokenizer bytes"), "{out}");
    // Both helps give the default.
    for args in [&["prepare", "--help"][..], &["--help"]] {
        let (_, help, _) = train(&d, args);
        let tokenizer = help
            .split("--tokenizer <TOKENIZER>")
            .nth(1)
            .and_then(|t| t.split("\n  -").next())
            .unwrap_or("");
        assert!(tokenizer.contains("[default: bytes]"), "{args:?}: {help}");
    }
    // Fewer shards than an earlier run over the same prefix: the rest are named.
    let (code, out, err) = train(
        &d,
        &["prepare", "--out", "b", "--shard-tokens", "100", s(&sample)],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let shards = size.div_ceil(100);
    let (code, out, err) = train(&d, &["prepare", "--out", "b", s(&sample)]);
    assert!(
        code == Some(0)
            && err.contains(&format!(
                "{} shard(s) from an earlier run remain after the last one written, from \
                 b_000001.bin",
                shards - 1
            )),
        "{out}{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_checkpoint_knows_its_tokenizer_file_by_its_hash() {
    let d = tmp("identity");
    let copy = |from: &str, to: &str| {
        std::fs::create_dir_all(d.join(to)).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            let src = fixtures().join(from).join(f);
            if src.exists() {
                std::fs::copy(src, d.join(to).join(f)).unwrap();
            }
        }
    };
    copy("llama3-style", "a");
    copy("llama3-style", "moved");
    copy("gpt2-style", "other");
    let sample = fixtures().join("sample.txt");
    let text: String = (0..40)
        .map(|_| std::fs::read_to_string(&sample).unwrap())
        .collect();
    std::fs::write(d.join("text.txt"), text).unwrap();
    let base = |tok: &str, steps: &str| {
        let mut v: Vec<String> = argv(SMALL).into_iter().map(String::from).collect();
        v.extend(
            [
                "--data",
                "text.txt",
                "--tokenizer",
                tok,
                "--steps",
                steps,
                "--gen-tokens",
                "0",
            ]
            .map(String::from),
        );
        v
    };
    let run = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        train(&d, &refs)
    };
    let mut first = base("a", "2");
    first.extend(["--save".into(), "ck".into()]);
    let (code, out, err) = run(first);
    assert_eq!(code, Some(0), "{out}{err}");
    // The same file elsewhere is the same tokenizer.
    let mut resumed = base("moved/tokenizer.json", "3");
    resumed.extend(["--resume".into(), "ck".into()]);
    let (code, out, err) = run(resumed);
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(curve(&out).last().map(|c| c.0), Some(3), "{out}");
    // Another file with as many ids is refused, naming the file to pass.
    let mut other = base("other", "3");
    other.extend(["--resume".into(), "ck".into()]);
    let (code, out, err) = run(other);
    let saved = std::fs::canonicalize(d.join("a/tokenizer.json")).unwrap();
    assert!(
        code == Some(1)
            && err.contains("saved with tokenizer sha256:")
            && err.contains(&format!(
                "pass --tokenizer {} or --allow-resume-mismatch",
                saved.display()
            ))
            && !out.contains("step 3"),
        "{out}{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
