//! The checkpoint-file part of the bad-input catalogue: a fresh checkpoint and the damages
//! done to it, each with the fragment its load error must name.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use oxiflow::checkpoint::{self, Metadata, SaveOptions};
use oxiflow::prelude::*;
use serde_json::{json, Value};

pub fn ckpt_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-catalogue-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A fresh checkpoint of `w` = arange(12) as [4, 3] at the directory named after `case`.
pub fn saved(case: &str) -> PathBuf {
    let d = ckpt_dir(case);
    let w = Tensor::arange(0.0, 12.0, 1.0, DType::F32)
        .and_then(|t| t.reshape([4, 3]))
        .unwrap();
    let mut meta = Metadata::new();
    meta.insert("step".into(), "1".into());
    checkpoint::save_tensors(&d, &[("w".into(), w)], &meta, &SaveOptions::default()).unwrap();
    d
}

fn edit(d: &Path, f: impl FnOnce(&mut Value)) {
    let path = d.join("manifest.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

fn data_file(d: &Path) -> PathBuf {
    d.join("rank-00000.safetensors")
}

/// (case, fragment the error must name, what to do to a fresh checkpoint).
pub type Damage = (&'static str, &'static str, Box<dyn Fn(&Path)>);

pub fn damages() -> Vec<Damage> {
    let set = |ptr: &'static str, v: Value| -> Box<dyn Fn(&Path)> {
        Box::new(move |d: &Path| edit(d, |m| *m.pointer_mut(ptr).unwrap() = v.clone()))
    };
    vec![
        (
            "no manifest",
            "no complete checkpoint",
            Box::new(|d: &Path| std::fs::remove_file(d.join("manifest.json")).unwrap()),
        ),
        (
            "manifest not JSON",
            "bad manifest",
            Box::new(|d: &Path| {
                std::fs::write(
                    d.join("manifest.json"),
                    b"{\"format\": \"oxiflow-checkpoint\", ",
                )
                .unwrap()
            }),
        ),
        (
            "manifest fields missing",
            "bad manifest",
            Box::new(|d: &Path| {
                std::fs::write(
                    d.join("manifest.json"),
                    b"{\"format\": \"oxiflow-checkpoint\"}",
                )
                .unwrap()
            }),
        ),
        (
            "another format",
            "not an oxiflow checkpoint",
            set("/format", json!("pytorch")),
        ),
        ("old version", "version 1", set("/version", json!(1))),
        (
            "unknown field",
            "unknown field",
            Box::new(|d: &Path| edit(d, |m| m["extra"] = json!(1))),
        ),
        (
            "unknown dtype",
            "unknown dtype",
            set("/tensors/w/dtype", json!("f8")),
        ),
        (
            "shape too large",
            "too large",
            set("/tensors/w/shape", json!([usize::MAX, 2])),
        ),
        (
            "region outside the shape",
            "outside the shape",
            set("/tensors/w/pieces/0/region", json!([[0, 9], [0, 3]])),
        ),
        (
            "region that leaves a gap",
            "cover 6 of the 12",
            set("/tensors/w/pieces/0/region", json!([[0, 2], [0, 3]])),
        ),
        (
            "absolute piece path",
            "not a plain file name",
            Box::new(|d: &Path| {
                edit(d, |m| {
                    m["files"][0]["name"] = json!("/etc/passwd");
                    m["tensors"]["w"]["pieces"][0]["file"] = json!("/etc/passwd");
                })
            }),
        ),
        (
            "piece path with ..",
            "not a plain file name",
            Box::new(|d: &Path| {
                edit(d, |m| {
                    m["files"][0]["name"] = json!("../x");
                    m["tensors"]["w"]["pieces"][0]["file"] = json!("../x");
                })
            }),
        ),
        (
            "piece file not listed",
            "not among the checkpoint's files",
            set("/tensors/w/pieces/0/file", json!("rank-00009.safetensors")),
        ),
        (
            "duplicated piece",
            "more than the 12 elements",
            Box::new(|d: &Path| {
                edit(d, |m| {
                    let mut f = m["files"][0].clone();
                    f["name"] = json!("rank-00001.safetensors");
                    m["files"].as_array_mut().unwrap().push(f);
                    let mut p = m["tensors"]["w"]["pieces"][0].clone();
                    p["file"] = json!("rank-00001.safetensors");
                    m["tensors"]["w"]["pieces"].as_array_mut().unwrap().push(p);
                })
            }),
        ),
        (
            "step not a number",
            "not a step count",
            set("/metadata/step", json!("three")),
        ),
        (
            "optimizer state not saved",
            "listed but not saved",
            set("/optimizer_state", json!(["optim/w/exp_avg"])),
        ),
        (
            "flipped data byte",
            "corrupt",
            Box::new(|d: &Path| {
                let mut b = std::fs::read(data_file(d)).unwrap();
                let n = b.len() - 5;
                b[n] ^= 1;
                std::fs::write(data_file(d), b).unwrap();
            }),
        ),
        (
            "truncated data file",
            "the manifest says",
            Box::new(|d: &Path| {
                let b = std::fs::read(data_file(d)).unwrap();
                std::fs::write(data_file(d), &b[..b.len() / 2]).unwrap();
            }),
        ),
        (
            "data file missing",
            "rank-00000.safetensors",
            Box::new(|d: &Path| std::fs::remove_file(data_file(d)).unwrap()),
        ),
        (
            "data file a symlink",
            "not a regular file",
            Box::new(|d: &Path| {
                let real = d.with_extension("real");
                std::fs::rename(data_file(d), &real).unwrap();
                std::os::unix::fs::symlink(&real, data_file(d)).unwrap();
            }),
        ),
        (
            "data file garbage with a matching checksum",
            "rank-00000.safetensors",
            Box::new(|d: &Path| {
                let junk = vec![0xffu8; 64];
                std::fs::write(data_file(d), &junk).unwrap();
                edit(d, |m| {
                    m["files"][0]["bytes"] = json!(64);
                    m["files"][0]["crc32c"] = json!(crc32c::crc32c(&junk));
                });
            }),
        ),
        (
            "piece checksum altered",
            "corrupt piece",
            Box::new(|d: &Path| {
                edit(d, |m| {
                    let c = m["tensors"]["w"]["pieces"][0]["crc32c"].as_u64().unwrap();
                    m["tensors"]["w"]["pieces"][0]["crc32c"] = json!(c ^ 1);
                })
            }),
        ),
    ]
}
