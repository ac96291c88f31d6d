//! Checkpoints are whole or refused: a save never replaces what is not a checkpoint; every
//! single-bit flip of a manifest is refused by its checksum; doctored manifests whose checksum
//! was recomputed are still refused (regions against the layout, the optimizer's slots, finite
//! values); a refused load changes nothing; `<path>.old` stands in for a damaged checkpoint
//! with a report naming both; and the newest complete checkpoint of a directory is found.

mod catalogue_damages;
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use catalogue_damages::{edit, edit_unsealed, flip_bit, poison};
use common::classifier_values as values;
use oxiflow::checkpoint::{self, LoadOptions, Manifest, Metadata, SaveOptions};
use oxiflow::nn::Module;
use oxiflow::placement::{NamedMesh, DP, TP};
use oxiflow::sbp::NdSbp;
use oxiflow::trainer::tasks::mlp::{
    classifier as new_classifier, Classifier, ClassifierConfig as TrainConfig, OptimizerKind,
};
use oxiflow::trainer::TrainError;
use oxiflow::{run_ranks, DType, DeviceType, Placement, Sbp, Tensor, TensorError};
use serde_json::{json, Value};

fn sibling(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-integrity-{}-{name}", std::process::id()));
    for s in ["", ".old", ".partial"] {
        let p = sibling(&d, s);
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

fn save_local(p: &Path, step: u64) {
    let mut meta = Metadata::new();
    meta.insert("step".into(), step.to_string());
    checkpoint::save_tensors(p, &[("w".into(), value())], &meta, &SaveOptions::default()).unwrap();
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

fn arange12() -> Vec<f32> {
    (0..12).map(|i| i as f32).collect()
}

fn load_w(p: &Path) -> Result<Vec<f32>, TensorError> {
    let like = Tensor::zeros([4, 3], DType::F32);
    let (t, _) = checkpoint::load_tensors(p, &[("w".into(), like)])?;
    t[0].to_vec::<f32>()
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
    assert!(!sibling(&p, ".old").exists(), "nothing was moved aside");
}

#[test]
fn a_save_onto_a_file_is_refused_and_later_saves_still_work() {
    let p = dir("user-file");
    std::fs::write(&p, b"notes").unwrap();
    let err = checkpoint_err(try_save(&p));
    assert!(err.contains("not a directory"), "{err}");
    assert_eq!(std::fs::read(&p).unwrap(), b"notes");
    // Once the file is gone, saves to that path work, twice (the second replaces the first),
    // and leave nothing beside the checkpoint (no lock file, no .partial, no .old).
    std::fs::remove_file(&p).unwrap();
    // A path whose parent does not exist yet: made.
    let nested = dir("nested").join("a").join("b");
    save_local(&nested, 1);
    assert_eq!(load_w(&nested).unwrap(), arange12());
    save_local(&p, 1);
    save_local(&p, 2);
    assert_eq!(load_w(&p).unwrap(), arange12());
    for s in [".lock", ".partial", ".old"] {
        assert!(!sibling(&p, s).exists(), "{s} left behind");
    }
}

#[test]
fn a_foreign_old_or_partial_directory_is_never_removed() {
    for suffix in [".old", ".partial"] {
        let p = dir(&format!("foreign{suffix}"));
        let side = sibling(&p, suffix);
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
    save_local(&p, 3);
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
    save_local(&p, 3);
    edit(&p, |m| {
        let c = &mut m["tensors"]["w"]["pieces"][0]["crc32c"];
        *c = Value::from(c.as_u64().unwrap() ^ 1);
    });
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("corrupt piece") && err.contains("w"), "{err}");
}

/// Every single-bit flip of a real manifest (a TP=2 AdamW checkpoint: layouts, optimizer
/// section, metadata) is refused; most by the manifest's checksum, the rest as unreadable.
#[test]
fn every_single_bit_flip_of_a_manifest_is_refused() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus/checkpoint/tp2-adamw/manifest.json");
    let bytes = std::fs::read(path).unwrap();
    Manifest::parse(&bytes).expect("the seed manifest is valid");
    let mut by_checksum = 0;
    for i in 0..bytes.len() {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            match Manifest::parse(&b) {
                Ok(_) => panic!("flipping bit {bit} of byte {i} passed"),
                Err(e) => by_checksum += usize::from(e.contains("checksum mismatch")),
            }
        }
    }
    eprintln!(
        "{} flips refused, {by_checksum} by the checksum",
        bytes.len() * 8
    );
    assert!(by_checksum > 0);
}

fn classifier(opt: OptimizerKind) -> Classifier {
    new_classifier(&TrainConfig {
        optimizer: opt,
        lr: 0.01,
        ..TrainConfig::default()
    })
    .unwrap()
}

/// An AdamW classifier trained `steps` steps and saved at `p`.
fn saved_adamw(p: &Path, steps: usize) -> Classifier {
    let mut c = classifier(OptimizerKind::AdamW);
    for _ in 0..steps {
        c.train_step().unwrap();
    }
    c.save(p, &Metadata::new(), &SaveOptions::default())
        .unwrap();
    c
}

/// The probe's one-bit manifest edits: `step` 40 -> 50 and the optimizer's step count
/// 40 -> 50, nothing else changed, each refused naming the manifest.
#[test]
fn step_flips_in_the_manifest_are_refused() {
    let p = dir("step-flips");
    saved_adamw(&p, 40);
    let file = p.join("manifest.json");
    let original = std::fs::read_to_string(&file).unwrap();
    for (from, to) in [
        ("\"step\": \"40\"", "\"step\": \"50\""),
        ("\"step_count\": 40", "\"step_count\": 50"),
    ] {
        flip_bit(&p, from, to);
        let mut c = classifier(OptimizerKind::AdamW);
        let before = values(&c);
        let err = resume_err(c.resume(&p));
        assert!(
            err.contains("manifest.json") && err.contains("manifest checksum mismatch"),
            "{err}"
        );
        assert_eq!(values(&c), before, "a refused load changes nothing");
        std::fs::write(&file, &original).unwrap();
    }
    classifier(OptimizerKind::AdamW).resume(&p).unwrap();
}

#[test]
fn swapped_regions_are_refused_though_they_tile() {
    let p = dir("swap");
    save_two_pieces(&p);
    assert_eq!(load_w(&p).unwrap(), arange12());
    let pieces = |m: &mut Value| m["tensors"]["w"]["pieces"].as_array_mut().unwrap().clone();
    // The two regions swapped (files and checksums in place): still an exact tiling.
    edit(&p, |m| {
        let ps = pieces(m);
        m["tensors"]["w"]["pieces"][0]["region"] = ps[1]["region"].clone();
        m["tensors"]["w"]["pieces"][1]["region"] = ps[0]["region"].clone();
    });
    let err = checkpoint_err(load_w(&p));
    assert!(
        err.contains(
            "w: piece 0 is [2..4, 0..3] in rank-00000.safetensors, but its layout [\"S(0)\"] on \
             mesh [2] puts [0..2, 0..3] in rank-00000.safetensors there"
        ),
        "{err}"
    );
    // Each piece's file swapped instead.
    save_two_pieces(&p);
    edit(&p, |m| {
        let ps = pieces(m);
        m["tensors"]["w"]["pieces"][0]["file"] = ps[1]["file"].clone();
        m["tensors"]["w"]["pieces"][1]["file"] = ps[0]["file"].clone();
    });
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("puts [0..2, 0..3] in rank-00000"), "{err}");
    // The layout rewritten to match swapped regions is refused too: S(0) on a mesh whose
    // ranks are reversed puts rank 1's rows first, but the files hold the saved values.
    save_two_pieces(&p);
    edit(&p, |m| {
        m["tensors"]["w"]["layout"]["ranks"] = json!([1, 0]);
    });
    let err = checkpoint_err(load_w(&p));
    assert!(
        err.contains("piece 0 is [0..2, 0..3] in rank-00000"),
        "{err}"
    );
    // The layout and the pieces rewritten together (a consistent manifest): each data file
    // records its own pieces' regions, so the swap is still caught.
    save_two_pieces(&p);
    edit(&p, |m| {
        let ps = pieces(m);
        m["tensors"]["w"]["layout"]["ranks"] = json!([1, 0]);
        let (mut a, mut b) = (ps[1].clone(), ps[0].clone());
        a["region"] = ps[0]["region"].clone();
        b["region"] = ps[1]["region"].clone();
        m["tensors"]["w"]["pieces"] = json!([a, b]);
    });
    let err = checkpoint_err(load_w(&p));
    assert!(
        err.contains("rank-00000.safetensors")
            && err.contains(
                "w: the manifest puts the piece of this file at [2..4, 0..3], the file records \
                 [0..2, 0..3]"
            ),
        "{err}"
    );
}

/// `w` saved in two pieces on the mesh `[dp 2, tp 1]` of named axes.
fn save_on_named_mesh(p: &Path) {
    run_ranks(2, Duration::from_secs(20), |_| {
        let pl = Placement::range(DeviceType::Cpu, 2)
            .and_then(|p| p.reshaped([2, 1]))
            .unwrap();
        let mesh = NamedMesh::of(pl.clone(), &[DP, TP]).unwrap();
        let w = value().to_global(&pl, NdSbp::broadcast(2)).unwrap();
        let w = w.to_global(&pl, NdSbp::new([Sbp::S(0), Sbp::B])).unwrap();
        let opts = SaveOptions {
            meshes: vec![mesh],
            ..SaveOptions::default()
        };
        checkpoint::save_tensors(p, &[("w".into(), w)], &Metadata::new(), &opts).unwrap();
    });
}

#[test]
fn named_mesh_axes_are_recorded_read_back_and_checked() {
    let p = dir("named-axes");
    save_on_named_mesh(&p);
    let manifest: Manifest =
        serde_json::from_slice(&std::fs::read(p.join("manifest.json")).unwrap()).unwrap();
    let layout = manifest.tensors["w"].layout.clone().unwrap();
    assert_eq!(layout.axes, Some(vec!["dp".to_string(), "tp".to_string()]));
    assert_eq!(layout.mesh_text(), "[dp 2, tp 1]");
    assert_eq!(load_w(&p).unwrap(), arange12());
    // A checkpoint written before axes had names (no `axes` field) still loads.
    edit(&p, |m| {
        m["tensors"]["w"]["layout"]
            .as_object_mut()
            .unwrap()
            .remove("axes");
    });
    assert_eq!(load_w(&p).unwrap(), arange12());
    // Messages about the layout name the axes.
    save_on_named_mesh(&p);
    edit(&p, |m| {
        m["tensors"]["w"]["layout"]["ranks"] = json!([1, 0]);
    });
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("on mesh [dp 2, tp 1] puts"), "{err}");
    // Names that are not one distinct, non-empty name per mesh axis are refused.
    for (axes, why) in [
        (json!(["dp"]), "1 names for 2 mesh axes"),
        (json!(["dp", "dp"]), "dp named twice"),
        (json!(["dp", ""]), "an empty name \"\""),
    ] {
        save_on_named_mesh(&p);
        edit(&p, |m| m["tensors"]["w"]["layout"]["axes"] = axes.clone());
        let err = checkpoint_err(load_w(&p));
        let shown = axes.to_string().replace(',', ", ");
        assert!(
            err.contains(&format!("layout axes {shown} of mesh [2, 1]: {why}")),
            "{err}"
        );
    }
}

#[test]
fn non_finite_values_are_refused_with_every_checksum_recomputed() {
    let p = dir("nan");
    save_local(&p, 3);
    poison(&p, "w", "rank-00000.safetensors");
    let err = checkpoint_err(load_w(&p));
    assert!(
        err.contains("w: piece [0..4, 0..3] holds a non-finite value (NaN) at element 0"),
        "{err}"
    );
    // In a training checkpoint: the optimizer state is checked too, and nothing is loaded.
    let q = dir("nan-adam");
    saved_adamw(&q, 2);
    poison(
        &q,
        "optim/mlp.fc2.bias/exp_avg_sq",
        "rank-00000.safetensors",
    );
    let mut c = classifier(OptimizerKind::AdamW);
    let before = values(&c);
    let err = resume_err(c.resume(&q));
    assert!(err.contains("optim/mlp.fc2.bias/exp_avg_sq"), "{err}");
    assert!(err.contains("non-finite"), "{err}");
    assert_eq!(values(&c), before);
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
        save_local(&p, 3);
        edit(&p, |m| {
            m["files"][0]["name"] = Value::from(bad);
            m["tensors"]["w"]["pieces"][0]["file"] = Value::from(bad);
        });
        let err = checkpoint_err(load_w(&p));
        assert!(err.contains("not a plain file name"), "{bad}: {err}");
    }
    // A symlink to a file outside the checkpoint is not followed.
    save_local(&p, 3);
    std::fs::create_dir_all(&outside).unwrap();
    let target = outside.join("real.safetensors");
    std::fs::rename(p.join("rank-00000.safetensors"), &target).unwrap();
    std::os::unix::fs::symlink(&target, p.join("rank-00000.safetensors")).unwrap();
    let err = checkpoint_err(load_w(&p));
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn invalid_steps_versions_and_unknown_fields_are_errors() {
    let p = dir("step");
    save_local(&p, 3);
    edit(&p, |m| m["metadata"]["step"] = Value::from("abc"));
    let err = checkpoint_err(load_w(&p));
    assert!(
        err.contains("step") && err.contains("not a step count"),
        "{err}"
    );
    // Another version is refused before the checksum is even read: a flip of the version
    // field never bypasses the checksum.
    for v in [1, 2, 4] {
        save_local(&p, 3);
        edit_unsealed(&p, |m| m["version"] = Value::from(v));
        let err = checkpoint_err(load_w(&p));
        assert!(err.contains(&format!("manifest version {v}")), "{err}");
    }
    save_local(&p, 3);
    edit(&p, |m| m["tensors"]["w"]["shape"] = json!([usize::MAX, 2]));
    assert!(checkpoint_err(load_w(&p)).contains("too large"));
    save_local(&p, 3);
    edit(&p, |m| m["extra"] = json!(1));
    assert!(checkpoint_err(load_w(&p)).contains("unknown field `extra`"));
}

#[test]
fn optimizer_state_is_whole_or_refused() {
    let p = dir("optim");
    saved_adamw(&p, 1);
    let manifest = checkpoint::read_manifest_at(&p).unwrap();
    let o = manifest.optimizer.as_ref().unwrap();
    assert_eq!(o.slots, ["exp_avg", "exp_avg_sq"]);
    assert_eq!(o.step_count, 1);
    assert!(o.empty.is_empty());
    // AdamW state into SGD: refused, naming the slots.
    let mut sgd = classifier(OptimizerKind::Sgd);
    let err = resume_err(sgd.resume(&p));
    assert!(err.contains("does not fit this optimizer"), "{err}");
    type Damage = (&'static str, &'static str, fn(&mut Value));
    let damages: [Damage; 4] = [
        (
            "one entry removed",
            "optimizer state optim/mlp.fc2.bias/exp_avg_sq is missing",
            |m| {
                m["tensors"]
                    .as_object_mut()
                    .unwrap()
                    .remove("optim/mlp.fc2.bias/exp_avg_sq");
            },
        ),
        (
            "one entry declared never initialised",
            "optimizer state of mlp.fc2.bias is partial",
            |m| {
                m["tensors"]
                    .as_object_mut()
                    .unwrap()
                    .remove("optim/mlp.fc2.bias/exp_avg_sq");
                m["optimizer"]["empty"] = json!(["optim/mlp.fc2.bias/exp_avg_sq"]);
            },
        ),
        (
            "the optimizer section removed",
            "the checkpoint has no optimizer state",
            |m| m["optimizer"] = Value::Null,
        ),
        (
            "the parameter list emptied",
            "belongs to no (parameter, slot) pair",
            |m| m["optimizer"]["params"] = json!([]),
        ),
    ];
    for (what, want, damage) in damages {
        let q = dir("optim-damaged");
        saved_adamw(&q, 1);
        edit(&q, damage);
        let mut c = classifier(OptimizerKind::AdamW);
        let before = values(&c);
        let err = resume_err(c.resume(&q));
        assert!(err.contains(want), "{what}: {err}");
        assert_eq!(values(&c), before, "{what}: a refused load changes nothing");
    }
    // A checkpoint saved without an optimizer: refused, or under the explicit option loaded
    // with every slot reset and named.
    let bare = dir("optim-bare");
    let trained = saved_adamw(&dir("optim-src"), 3);
    checkpoint::save(
        &bare,
        &trained.model.parameters(),
        None,
        &Metadata::new(),
        &SaveOptions::default(),
    )
    .unwrap();
    let mut c = classifier(OptimizerKind::AdamW);
    let err = resume_err(c.resume(&bare));
    assert!(err.contains("no optimizer state"), "{err}");
    let report = checkpoint::load_with(
        &bare,
        &c.model.parameters(),
        Some(c.optimizer.as_mut()),
        &LoadOptions {
            reset_missing_optimizer_state: true,
        },
    )
    .unwrap();
    assert_eq!(report.reset.len(), 8, "{:?}", report.reset);
    assert!(report
        .reset
        .contains(&"optim/mlp.fc1.weight/exp_avg_sq".to_string()));
    assert_eq!(c.optimizer.step_count(), 0);
    assert_eq!(values(&c), values(&trained));
}

#[test]
fn a_damaged_checkpoint_falls_back_to_old_naming_both() {
    let p = dir("fallback");
    save_local(&p, 7);
    let old = sibling(&p, ".old");
    std::fs::create_dir_all(&old).unwrap();
    for f in ["manifest.json", "rank-00000.safetensors"] {
        std::fs::copy(p.join(f), old.join(f)).unwrap();
    }
    std::fs::write(p.join("manifest.json"), b"\x00garbage{").unwrap();
    let c = classifier(OptimizerKind::Sgd);
    let _ = c;
    let like = Tensor::zeros([4, 3], DType::F32);
    let (t, meta) = checkpoint::load_tensors(&p, &[("w".into(), like)]).unwrap();
    assert_eq!(t[0].to_vec::<f32>().unwrap(), arange12());
    assert_eq!(meta["step"], "7");
    let report = checkpoint::load_with(&p, &[], None, &LoadOptions::default()).unwrap();
    assert_eq!(report.dir, old);
    let why = report.fell_back.unwrap();
    assert!(
        why.contains(&format!("{} is not loadable", p.display()))
            && why.contains("bad manifest")
            && why.contains(&format!(
                "loading the previous checkpoint {}",
                old.display()
            )),
        "{why}"
    );
    // <path> gone (a crash between the renames): the report says so.
    std::fs::remove_dir_all(&p).unwrap();
    let report = checkpoint::load_with(&p, &[], None, &LoadOptions::default()).unwrap();
    assert!(report.fell_back.unwrap().contains("does not exist"));
    // Both damaged: refused, naming both.
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("manifest.json"), b"[]").unwrap();
    std::fs::remove_file(old.join("rank-00000.safetensors")).unwrap();
    let err = checkpoint_err(load_w(&p));
    assert!(
        err.contains("the previous checkpoint is not loadable either"),
        "{err}"
    );
}

#[test]
fn the_newest_complete_checkpoint_is_found() {
    let root = dir("newest");
    // Nothing there: a fresh start.
    assert_eq!(checkpoint::newest_complete(&root).unwrap(), None);
    std::fs::create_dir_all(&root).unwrap();
    assert_eq!(checkpoint::newest_complete(&root).unwrap(), None);
    // A save that never published is not a checkpoint.
    let flat = root.join("ckpt");
    std::fs::create_dir_all(sibling(&flat, ".partial")).unwrap();
    assert_eq!(checkpoint::newest_complete(&flat).unwrap(), None);
    std::fs::remove_dir_all(sibling(&flat, ".partial")).unwrap();
    // A checkpoint path: itself, or its .old when it is damaged.
    save_local(&flat, 5);
    assert_eq!(
        checkpoint::newest_complete(&flat).unwrap(),
        Some(flat.clone())
    );
    let old = sibling(&flat, ".old");
    std::fs::create_dir_all(&old).unwrap();
    for f in ["manifest.json", "rank-00000.safetensors"] {
        std::fs::copy(flat.join(f), old.join(f)).unwrap();
    }
    poison(&flat, "w", "rank-00000.safetensors");
    assert_eq!(
        checkpoint::newest_complete(&flat).unwrap(),
        Some(old.clone())
    );
    std::fs::remove_dir_all(&old).unwrap();
    let err = checkpoint_err(checkpoint::newest_complete(&flat));
    assert!(
        err.contains("none is complete") && err.contains("non-finite"),
        "{err}"
    );
    std::fs::remove_dir_all(&flat).unwrap();
    // A directory of checkpoints: the highest step among the complete ones.
    for (name, step) in [("a", 30), ("b", 20), ("c", 40)] {
        save_local(&root.join(name), step);
    }
    assert_eq!(
        checkpoint::newest_complete(&root).unwrap(),
        Some(root.join("c"))
    );
    edit_unsealed(&root.join("c"), |m| m["metadata"]["step"] = json!("41"));
    assert_eq!(
        checkpoint::newest_complete(&root).unwrap(),
        Some(root.join("a"))
    );
}
