//! Bad input to `train` is refused before training starts, on every rank alike, with nothing
//! written: an unknown job-file key or table (named), a shard with the wrong magic, a truncated
//! shard, an id at or beyond the vocabulary (file and byte offset named), a glob that matches
//! nothing, `--clip-grad` 0 or negative and `--warmup-steps` beyond `--steps` (also as job-file
//! values). Each case runs under oflaunch (2 ranks) with `--metrics`, `--plot` and `--save`
//! set, and as ranks 0 and 1 started alone without a rendezvous: the same message from both
//! shows the check needs no communication.

mod common;

use std::path::{Path, PathBuf};

use common::{binaries, curve, launch, rank_alone};

fn tmp(name: &str) -> PathBuf {
    common::scratch_dir("badinput", name)
}

/// An llm.c shard with `magic`, a header count of `count` and `ids`.
fn llmc(path: &Path, magic: i32, count: i32, ids: &[u16]) {
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[magic, 1, count]);
    let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    bytes.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn bad_input_is_refused_before_training_on_every_rank_and_nothing_is_written() {
    let dir = tmp("cases");
    let d = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let good: Vec<u16> = (0..2000u16).map(|i| i % 200).collect();
    llmc(&dir.join("magic.bin"), 1234, 2000, &good);
    llmc(&dir.join("short.bin"), 20240520, 2000, &good[..500]);
    let mut bad = good.clone();
    bad[5] = 300;
    llmc(&dir.join("vocab.bin"), 20240520, 2000, &bad);
    std::fs::write(dir.join("key.toml"), "[optim]\nlr = 0.01\nlrr = 0.1\n").unwrap();
    std::fs::write(dir.join("table.toml"), "[optimizer]\nlr = 0.01\n").unwrap();
    std::fs::write(dir.join("clip.toml"), "[optim]\nclip-grad = 0.0\n").unwrap();
    std::fs::write(
        dir.join("warm.toml"),
        "[optim]\nwarmup-steps = 30\n[run]\nsteps = 20\n",
    )
    .unwrap();
    let cases: Vec<(Vec<String>, String, i32)> = vec![
        (
            vec!["--config".into(), d("key.toml")],
            "unknown field `lrr`".into(),
            2,
        ),
        (
            vec!["--config".into(), d("table.toml")],
            "unknown field `optimizer`".into(),
            2,
        ),
        (
            vec![
                "--data".into(),
                d("magic.bin"),
                "--shard-format".into(),
                "llmc".into(),
            ],
            format!(
                "{} at byte 0: the llm.c header's magic (bytes 0..4) is 1234",
                d("magic.bin")
            ),
            1,
        ),
        (
            vec!["--data".into(), d("short.bin")],
            format!(
                "{} at byte 8: the llm.c header's token count (bytes 8..12) is 2000",
                d("short.bin")
            ),
            1,
        ),
        (
            vec!["--data".into(), d("vocab.bin")],
            format!(
                "{} at byte 1034: token 5 is id 300, not below the vocabulary size 256",
                d("vocab.bin")
            ),
            1,
        ),
        (
            vec!["--data".into(), d("none_*.bin")],
            "no file matches".into(),
            1,
        ),
        (
            vec!["--clip-grad".into(), "0".into()],
            "--clip-grad".into(),
            2,
        ),
        (
            vec!["--clip-grad".into(), "-1".into()],
            "--clip-grad".into(),
            2,
        ),
        (
            vec!["--config".into(), d("clip.toml")],
            "invalid value for --clip-grad: 0 is not a finite number above 0".into(),
            2,
        ),
        (
            vec![
                "--warmup-steps".into(),
                "50".into(),
                "--steps".into(),
                "10".into(),
            ],
            "--warmup-steps 50 is beyond --steps 10".into(),
            2,
        ),
        (
            vec!["--config".into(), d("warm.toml")],
            "--warmup-steps 30 is beyond --steps 20".into(),
            2,
        ),
    ];
    let (_, train) = binaries();
    let outputs = ["m.jsonl", "loss.png", "ckpt", "ckpt.config.toml"];
    for (args, want, code) in &cases {
        let mut all: Vec<String> = args.clone();
        for (flag, name) in [
            ("--metrics", "m.jsonl"),
            ("--plot", "loss.png"),
            ("--save", "ckpt"),
        ] {
            all.push(flag.into());
            all.push(d(name));
        }
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        let out = launch(2, &refs);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(want.as_str()), "{args:?}: {stderr}");
        assert!(curve(&stdout).is_empty(), "{args:?} trained: {stdout}");
        for o in outputs {
            assert!(!dir.join(o).exists(), "{args:?} wrote {o}");
        }
        // Ranks 0 and 1 alone (no rendezvous to reach): the same refusal, the same status.
        let alone: Vec<(Option<i32>, String)> = ["0", "1"]
            .iter()
            .map(|rank| {
                let o = rank_alone(train, &refs, rank);
                (
                    o.status.code(),
                    String::from_utf8_lossy(&o.stderr).into_owned(),
                )
            })
            .collect();
        assert_eq!(alone[0], alone[1], "{args:?}: ranks disagree");
        assert_eq!(alone[0].0, Some(*code), "{args:?}: {}", alone[0].1);
        assert!(
            alone[0].1.contains(want.as_str()),
            "{args:?}: {}",
            alone[0].1
        );
        eprintln!("{args:?}: {}", alone[0].1.lines().next().unwrap_or(""));
        for o in outputs {
            assert!(!dir.join(o).exists(), "{args:?} wrote {o}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
