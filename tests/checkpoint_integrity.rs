//! Checkpoints cannot lose or invent data: a save never replaces what is not a checkpoint,
//! corrupt bytes and doctored manifests are typed errors naming the file, coverage counts each
//! region once, and optimizer state must match the optimizer it is loaded into.

use std::path::{Path, PathBuf};
use std::time::Duration;

use oxiflow::checkpoint::{self, Metadata, SaveOptions};
use oxiflow::nn::Module;
use oxiflow::trainer::tasks::mlp::{
    classifier as new_classifier, Classifier, ClassifierConfig as TrainConfig, OptimizerKind,
};
use oxiflow::trainer::TrainError;
use oxiflow::{run_ranks, DType, DeviceType, Placement, Sbp, Tensor, TensorError};
use serde_json::Value;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-integrity-{}-{name}", std::process::id()));
    for s in ["", ".old", ".partial"] {
        let mut p = d.as_os_str().to_owned();
        p.push(s);
        let p = PathBuf::from(p);
        let _ = std::fs::remove_dir_all(&p);
        let _ = std::fs::remove_file(&p);
    }
    d
}

fn value() -> Tensor {
    Tensor::arange(0.0, 12.0, 1.0, DType::F32)
        .unwrap()
        .reshape([4, 3])
        .unwrap()
}

fn try_save(p: &Path) -> Result<(), TensorError> {
    checkpoint::save_tensors(
        p,
        &[("w".into(), value())],
        &Metadata::new(),
        &SaveOptions::default(),
    )
}

fn save_local(p: &Path) -> checkpoint::Metadata {
    let mut meta = Metadata::new();
    meta.insert("step".into(), "3".into());
    checkpoint::save_tensors(p, &[("w".into(), value())], &meta, &SaveOptions::default()).unwrap();
    meta
}

/// A checkpoint of `w` = arange(12) as [4, 3], saved in two pieces (S(0) over two ranks).
fn save_two_pieces(p: &Path) {
    run_ranks(2, Duration::from_secs(20), |_| {
        let pl = Placement::range(DeviceType::Cpu, 2).unwrap();
        let w = value().to_global(&pl, Sbp::B).unwrap();
        let w = w.to_global(&pl, Sbp::S(0)).unwrap();
        checkpoint::save_tensors(p, &[("w".into(), w)], &Metadata::new(), &Default::default())
            .unwrap();
    });
}

fn load_w(p: &Path) -> Result<Vec<f32>, TensorError> {
    let like = Tensor::zeros([4, 3], DType::F32);
    let (t, _) = checkpoint::load_tensors(p, &[("w".into(), like)])?;
    t[0].to_vec::<f32>()
}

fn edit_manifest(p: &Path, f: impl FnOnce(&mut Value)) {
    let path = p.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut m);
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
}

fn checkpoint_err(r: Result<impl std::fmt::Debug, TensorError>) -> String {
    let e = r.unwrap_err();
    assert!(matches!(e, TensorError::Checkpoint { .. }), "{e}");
    e.to_string()
}

/// The checkpoint error of a failed resume.
fn resume_err(r: Result<u64, TrainError>) -> String {
    match r {
        Err(TrainError::Tensor(e)) => checkpoint_err(Err::<(), _>(e)),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn a_save_onto_a_directory_that_is_not_a_checkpoint_keeps_it() {
    let p = dir("user-dir");
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("thesis.txt"), b"years of work").unwrap();
    let err = checkpoint_err(try_save(&p));
    assert!(err.contains("not an oxiflow checkpoint"), "{err}");
    assert_eq!(
        std::fs::read(p.join("thesis.txt")).unwrap(),
        b"years of work"
    );
    let old = PathBuf::from(format!("{}.old", p.display()));
    assert!(!old.exists(), "nothing was moved aside");
}

#[test]
fn a_save_onto_a_file_is_refused_and_later_saves_still_work() {
    let p = dir("user-file");
    std::fs::write(&p, b"notes").unwrap();
    let err = checkpoint_err(try_save(&p));
    assert!(err.contains("not a directory"), "{err}");
    assert_eq!(std::fs::read(&p).unwrap(), b"notes");
    // Once the file is gone, saves to that path work, twice (the second replaces the first).
    std::fs::remove_file(&p).unwrap();
    save_local(&p);
    save_local(&p);
    assert_eq!(
        load_w(&p).unwrap(),
        (0..12).map(|i| i as f32).collect::<Vec<_>>()
    );
}

#[test]
fn a_foreign_old_or_partial_directory_is_never_removed() {
    for suffix in [".old", ".partial"] {
        let p = dir(&format!("foreign{suffix}"));
        let side = PathBuf::from(format!("{}{suffix}", p.display()));
        std::fs::create_dir_all(&side).unwrap();
        std::fs::write(side.join("keep.txt"), b"mine").unwrap();
        let err = checkpoint_err(try_save(&p));
        assert!(err.contains("refusing"), "{err}");
        assert_eq!(std::fs::read(side.join("keep.txt")).unwrap(), b"mine");
    }
}

#[test]
fn a_flipped_data_byte_is_an_error_naming_the_file() {
    let p = dir("flip");
    save_local(&p);
    let file = p.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let err = checkpoint_err(load_w(&p));
    assert!(
        err.contains("rank-00000.safetensors") && err.contains("corrupt"),
        "{err}"
    );
}

#[test]
fn a_piece_checksum_mismatch_is_an_error() {
    let p = dir("piece-crc");
    save_local(&p);
    edit_manifest(&p, |m| {
        let c = &mut m["tensors"]["w"]["pieces"][0]["crc32c"];
        *c = Value::from(c.as_u64().unwrap() ^ 1);
    });
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("corrupt piece") && err.contains("w"), "{err}");
}

#[test]
fn a_duplicated_piece_does_not_hide_a_missing_one() {
    let p = dir("dup");
    save_two_pieces(&p);
    assert_eq!(
        load_w(&p).unwrap(),
        (0..12).map(|i| i as f32).collect::<Vec<_>>()
    );
    // The second piece claims the first one's region: rows 2..4 are held by nobody.
    edit_manifest(&p, |m| {
        m["tensors"]["w"]["pieces"][1]["region"] = serde_json::json!([[0, 2], [0, 3]]);
    });
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("overlap"), "{err}");
    // Dropping a piece leaves a gap.
    save_two_pieces(&p);
    edit_manifest(&p, |m| {
        m["tensors"]["w"]["pieces"].as_array_mut().unwrap().pop();
    });
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("cover 6 of the 12"), "{err}");
}

#[test]
fn piece_paths_must_stay_inside_the_checkpoint() {
    let p = dir("paths");
    let outside = dir("paths-outside");
    for bad in [
        "/etc/passwd",
        "../x.safetensors",
        "sub/rank.safetensors",
        ".hidden",
        "",
    ] {
        save_local(&p);
        edit_manifest(&p, |m| {
            m["files"][0]["name"] = Value::from(bad);
            m["tensors"]["w"]["pieces"][0]["file"] = Value::from(bad);
        });
        let err = checkpoint_err(load_w(&p));
        assert!(err.contains("not a plain file name"), "{bad}: {err}");
    }
    // A symlink to a file outside the checkpoint is not followed.
    save_local(&p);
    std::fs::create_dir_all(&outside).unwrap();
    let target = outside.join("real.safetensors");
    std::fs::rename(p.join("rank-00000.safetensors"), &target).unwrap();
    std::os::unix::fs::symlink(&target, p.join("rank-00000.safetensors")).unwrap();
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn invalid_steps_and_unknown_fields_are_errors() {
    let p = dir("step");
    for (key, v) in [("step", "abc"), ("optim.step_count", "-1")] {
        save_local(&p);
        edit_manifest(&p, |m| m["metadata"][key] = Value::from(v));
        let err = checkpoint_err(load_w(&p));
        assert!(
            err.contains(key) && err.contains("not a step count"),
            "{err}"
        );
    }
    save_local(&p);
    edit_manifest(&p, |m| m["version"] = Value::from(1));
    assert!(checkpoint_err(load_w(&p)).contains("version 1"));
    save_local(&p);
    edit_manifest(&p, |m| {
        m["tensors"]["w"]["shape"] = serde_json::json!([usize::MAX, 2])
    });
    assert!(checkpoint_err(load_w(&p)).contains("too large"));
}

fn classifier(opt: OptimizerKind) -> Classifier {
    new_classifier(&TrainConfig {
        optimizer: opt,
        lr: 0.01,
        ..TrainConfig::default()
    })
    .unwrap()
}

#[test]
fn optimizer_state_must_be_present_and_fit_the_optimizer() {
    let p = dir("optim");
    let mut adam = classifier(OptimizerKind::AdamW);
    adam.train_step().unwrap();
    adam.save(&p, &Metadata::new(), &SaveOptions::default())
        .unwrap();
    // AdamW state into SGD: refused, naming the state.
    let mut sgd = classifier(OptimizerKind::Sgd);
    let err = resume_err(sgd.resume(&p));
    assert!(err.contains("does not fit this optimizer"), "{err}");
    // State listed but its tensor dropped from the manifest: refused.
    edit_manifest(&p, |m| {
        let key = m["optimizer_state"][0].as_str().unwrap().to_string();
        m["tensors"].as_object_mut().unwrap().remove(&key);
    });
    let err = resume_err(classifier(OptimizerKind::AdamW).resume(&p));
    assert!(err.contains("listed but not saved"), "{err}");
    // A checkpoint saved without an optimizer does not resume one.
    let params = classifier(OptimizerKind::Sgd).model.parameters();
    checkpoint::save(&p, &params, None, &Metadata::new(), &SaveOptions::default()).unwrap();
    let err = resume_err(sgd.resume(&p));
    assert!(err.contains("no optimizer state"), "{err}");
}
