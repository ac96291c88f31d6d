//! Checkpoints: save under one parallel layout and resume under another (the continued loss
//! curve equals an uninterrupted run), gathered saves, and crash safety at every save stage.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use common::classifier_values as values;
use oxiflow::checkpoint::{self, SaveOptions, SaveStage};
use oxiflow::run_ranks;
use oxiflow::trainer::tasks::mlp::{
    classifier as new_classifier, ClassifierConfig as TrainConfig, OptimizerKind,
};

const TIMEOUT: Duration = Duration::from_secs(60);

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-ckpt-{}-{name}", std::process::id()));
    for s in ["", ".old", ".partial"] {
        let mut p = d.as_os_str().to_owned();
        p.push(s);
        let _ = std::fs::remove_dir_all(PathBuf::from(p));
    }
    d
}

fn cfg(mesh: Option<(usize, usize)>, opt: OptimizerKind) -> TrainConfig {
    let lr = if opt == OptimizerKind::AdamW {
        0.01
    } else {
        0.05
    };
    TrainConfig {
        mesh,
        seed: 11,
        optimizer: opt,
        lr,
        ..TrainConfig::default()
    }
}

/// Runs `steps` more steps on every rank of `mesh` (None: local), optionally resuming from and
/// saving to a checkpoint; returns rank 0's losses.
fn run(
    mesh: Option<(usize, usize)>,
    opt: OptimizerKind,
    resume: Option<&Path>,
    steps: usize,
    save: Option<(&Path, bool)>,
) -> Vec<f64> {
    let c = cfg(mesh, opt);
    let body = |_rank: usize| {
        let mut clf = new_classifier(&c).unwrap();
        if let Some(p) = resume {
            clf.resume(p).unwrap();
        }
        let losses: Vec<f64> = (0..steps).map(|_| clf.train_step().unwrap().loss).collect();
        if let Some((p, gathered)) = save {
            clf.save(
                p,
                &Default::default(),
                &SaveOptions {
                    gathered,
                    ..SaveOptions::default()
                },
            )
            .unwrap();
        }
        losses
    };
    match mesh {
        None => body(0),
        Some((d, t)) => run_ranks(d * t, TIMEOUT, body).swap_remove(0),
    }
}

fn assert_curves_match(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-4 * x.abs(), "{a:?} vs {b:?}");
    }
}

fn files_in(p: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(p)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn save_dp4_resume_tp2_continues_the_curve() {
    let full = run(None, OptimizerKind::Sgd, None, 30, None);
    let p = dir("dp4-tp2");
    let first = run(
        Some((4, 1)),
        OptimizerKind::Sgd,
        None,
        15,
        Some((&p, false)),
    );
    assert_curves_match(&first, &full[..15]);
    // DP=4 with replicated weights: rank 0 alone writes every piece.
    assert_eq!(
        files_in(&p),
        vec!["manifest.json", "rank-00000.safetensors"]
    );
    let rest = run(Some((1, 2)), OptimizerKind::Sgd, Some(&p), 15, None);
    assert_curves_match(&rest, &full[15..]);
}

#[test]
fn save_tp4_sharded_resume_dp2_tp2_and_gathered_resume_local_adamw() {
    let full = run(None, OptimizerKind::AdamW, None, 24, None);
    let p = dir("tp4");
    run(
        Some((1, 4)),
        OptimizerKind::AdamW,
        None,
        8,
        Some((&p, false)),
    );
    // Column/row-parallel weights are split over 4 ranks: every rank writes its pieces.
    assert_eq!(files_in(&p).len(), 5, "{:?}", files_in(&p));
    let names = checkpoint::read_manifest_names(&p).unwrap();
    assert!(
        names.iter().any(|n| n == "optim/mlp.fc1.weight/exp_avg_sq"),
        "{names:?}"
    );
    let g = dir("gathered");
    let mid = run(
        Some((2, 2)),
        OptimizerKind::AdamW,
        Some(&p),
        8,
        Some((&g, true)),
    );
    assert_curves_match(&mid, &full[8..16]);
    assert_eq!(
        files_in(&g),
        vec!["manifest.json", "rank-00000.safetensors"]
    );
    let rest = run(None, OptimizerKind::AdamW, Some(&g), 8, None);
    assert_curves_match(&rest, &full[16..]);
}

static CRASH_AT: AtomicU8 = AtomicU8::new(0);

fn crash_hook(s: SaveStage) {
    if CRASH_AT.load(Ordering::SeqCst) == common::save_stage_code(s) {
        panic!("simulated crash at {s:?}");
    }
}

#[test]
fn a_crash_at_any_save_stage_leaves_the_previous_checkpoint_loadable() {
    for stage in 1..=3u8 {
        let p = dir(&format!("crash-{stage}"));
        let c = cfg(None, OptimizerKind::Sgd);
        let mut clf = new_classifier(&c).unwrap();
        for _ in 0..5 {
            clf.train_step().unwrap();
        }
        clf.save(&p, &Default::default(), &SaveOptions::default())
            .unwrap();
        let saved = values(&clf);
        for _ in 0..3 {
            clf.train_step().unwrap();
        }
        CRASH_AT.store(stage, Ordering::SeqCst);
        let opts = SaveOptions {
            stage_hook: Some(crash_hook),
            ..SaveOptions::default()
        };
        let r = catch_unwind(AssertUnwindSafe(|| {
            clf.save(&p, &Default::default(), &opts)
                .map_err(|e| e.to_string())
        }));
        CRASH_AT.store(0, Ordering::SeqCst);
        assert!(r.is_err(), "stage {stage}: the hook crashed the save");
        // The previous checkpoint (step 5) loads, values intact.
        let mut back = new_classifier(&c).unwrap();
        back.resume(&p).unwrap();
        assert_eq!(back.step, 5, "stage {stage}");
        let loaded = values(&back);
        assert_eq!(loaded, saved, "stage {stage}");
        // The next save recovers from the leftovers and publishes step 8.
        clf.save(&p, &Default::default(), &SaveOptions::default())
            .unwrap();
        let mut again = new_classifier(&c).unwrap();
        again.resume(&p).unwrap();
        assert_eq!(again.step, 8, "stage {stage}");
    }
}

#[test]
fn loading_a_missing_or_partial_checkpoint_is_a_typed_error() {
    let p = dir("missing");
    let c = cfg(None, OptimizerKind::Sgd);
    let mut clf = new_classifier(&c).unwrap();
    let err = clf.resume(&p).unwrap_err().to_string();
    assert!(err.contains("no complete checkpoint"), "{err}");
    // A directory without a manifest (a half-written save) never loads.
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("rank-00000.safetensors"), b"garbage").unwrap();
    assert!(clf.resume(&p).is_err());
}
