//! `train --vocab-multiple` under `oflaunch` with real processes (CPU/TCP backend), on a
//! pre-tokenized corpus of 90 token ids (not a multiple of 64): the padded model (a table of
//! 128 rows, 32 per rank under TP4, the last shard only padding) trains on the unpadded
//! model's loss curve on 1 rank, TP2 (vocabulary-parallel), TP4, DP2 and PP2 in f64 (1e-9
//! relative) and on 1 rank in f32 (1e-5); the model line names the padded table; a checkpoint
//! of another padding is refused before training with both shapes and the flag that loads it,
//! which then does; a prompt id beyond the vocabulary is refused before training.

mod common;

use std::path::{Path, PathBuf};

use common::{assert_close, curve, launch, max_rel, ok, TINY_GPT};

const VOCAB: u32 = 90;

/// A pre-tokenized corpus of `VOCAB` ids with structure to learn (a walk with repeats).
fn corpus(dir: &Path) -> PathBuf {
    let mut bytes = b"OXFTOK16".to_vec();
    bytes.extend_from_slice(&VOCAB.to_le_bytes());
    let mut s: u64 = 17;
    let mut id: u32 = 0;
    for i in 0..6000u32 {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        id = if i % 8 == 0 {
            ((s >> 33) % u64::from(VOCAB)) as u32
        } else {
            (id * 7 + 3) % VOCAB
        };
        bytes.extend_from_slice(&(id as u16).to_le_bytes());
    }
    let p = dir.join("tokens.tok");
    std::fs::write(&p, bytes).unwrap();
    p
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-vocab-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `train` of the tiny GPT on `data` with `args` on `nproc` ranks: its output.
fn run(nproc: usize, data: &Path, args: &[&str]) -> String {
    let mut all = TINY_GPT.to_vec();
    all.extend_from_slice(&["--data", data.to_str().unwrap()]);
    all.extend_from_slice(args);
    ok(launch(nproc, &all))
}

#[test]
fn a_padded_vocabulary_trains_on_the_unpadded_curve_in_every_layout() {
    let dir = temp_dir("curves");
    let data = corpus(&dir);
    for (dtype, tolerance, layouts) in [
        (
            "f64",
            1e-9,
            &[
                (1, &[][..]),
                (2, &["--tp", "2"][..]),
                (4, &["--tp", "4"][..]),
                (2, &["--dp", "2"][..]),
                (2, &["--pp", "2", "--micro-batches", "2"][..]),
            ][..],
        ),
        ("f32", 1e-5, &[(1, &[][..])][..]),
    ] {
        let common = ["--steps", "25", "--seed", "4", "--dtype", dtype];
        let plain_out = run(
            1,
            &data,
            &[&common[..], &["--vocab-multiple", "1"]].concat(),
        );
        assert!(
            plain_out.contains("vocab 90 (table 90 rows)"),
            "{plain_out}"
        );
        let plain = curve(&plain_out);
        assert_eq!(plain.len(), 25);
        assert!(
            plain[24].1 < plain[0].1 - 0.5,
            "{dtype}: training makes progress: {plain:?}"
        );
        for &(n, layout) in layouts {
            // The default multiple, 64: 128 rows.
            let out = run(n, &data, &[&common[..], layout].concat());
            assert!(
                out.contains("vocab 90 (table 128 rows)") && out.contains("vocab-multiple=64"),
                "{out}"
            );
            let c = curve(&out);
            assert_close(format_args!("{dtype} {layout:?}"), &plain, &c, tolerance);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_of_another_padding_is_refused_by_shape_and_resumes_with_its_multiple() {
    let dir = temp_dir("resume");
    let data = corpus(&dir);
    let ckpt = dir.join("ckpt");
    let ck = ckpt.to_str().unwrap();
    let base = ["--seed", "2", "--dtype", "f64"];
    let full = curve(&run(1, &data, &[&base[..], &["--steps", "12"]].concat()));
    run(
        1,
        &data,
        &[&base[..], &["--steps", "8", "--save", ck]].concat(),
    );
    let resume = |multiple: &str, extra: &[&str]| {
        let mut all = TINY_GPT.to_vec();
        all.extend_from_slice(&base);
        all.extend_from_slice(&["--data", data.to_str().unwrap(), "--steps", "12"]);
        all.extend_from_slice(&["--resume", ck, "--vocab-multiple", multiple]);
        all.extend_from_slice(extra);
        launch(if extra.is_empty() { 1 } else { 2 }, &all)
    };
    let out = resume("1", &["--tp", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a [90, 32] table loaded [128, 32]");
    assert!(
        err.contains("wte.weight is [128, 32]")
            && err.contains("[90, 32]")
            && err.contains("--vocab-multiple 128 loads it"),
        "{err}"
    );
    assert!(
        curve(&String::from_utf8_lossy(&out.stdout)).is_empty(),
        "refused before training"
    );
    // The multiple the message names gives the saved table and continues the curve.
    let tail = curve(&ok(resume("128", &[])));
    let diff = max_rel(&full[8..], &tail);
    assert!(diff <= 1e-9, "resumed curve differs by {diff:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_prompt_beyond_the_vocabulary_is_refused_before_training() {
    let dir = temp_dir("prompt");
    let data = corpus(&dir);
    // 'h' is byte 104, beyond 90 ids but inside the 128-row table. (TINY_GPT up to its
    // --gen-tokens 0.)
    let d = data.to_str().unwrap();
    let args = [
        &TINY_GPT[..10],
        &["--data", d, "--steps", "3", "--generate", "The "],
    ]
    .concat();
    let out = launch(1, &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("token 104 is not below the vocabulary size 90"),
        "{err}"
    );
    assert!(curve(&String::from_utf8_lossy(&out.stdout)).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
