//! The checkpoint-file part of the bad-input catalogue: a fresh checkpoint and the damages
//! done to it, each with the fragment its load error must name; and the editing helpers the
//! checkpoint tests share (manifest edits that recompute the manifest's checksum, as a hostile
//! user would, or leave it; a value poisoned with its checksums recomputed).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use oxiflow::checkpoint::{self, Manifest, Metadata, SaveOptions};
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

/// Replaces the one occurrence of `from` in the manifest of checkpoint `d` with `to`, which
/// differs from it in one bit (the manifest's checksum left as it was).
pub fn flip_bit(d: &Path, from: &str, to: &str) {
    let path = d.join("manifest.json");
    let m = std::fs::read_to_string(&path).unwrap();
    assert_eq!(m.matches(from).count(), 1, "{from}");
    let bits: u32 = from
        .bytes()
        .zip(to.bytes())
        .map(|(a, b)| (a ^ b).count_ones())
        .sum();
    assert_eq!(bits, 1, "{from} -> {to} is one bit");
    std::fs::write(&path, m.replace(from, to)).unwrap();
}

/// The bytes of a manifest edited as `v`, its checksum recomputed when it still has the
/// manifest's fields (a hostile edit that passes the checksum).
pub fn sealed(v: &Value) -> Vec<u8> {
    match serde_json::from_value::<Manifest>(v.clone()) {
        Ok(mut m) => {
            m.seal().unwrap();
            serde_json::to_vec_pretty(&m).unwrap()
        }
        Err(_) => serde_json::to_vec(v).unwrap(),
    }
}

/// Edits the manifest of the checkpoint in `d` and recomputes its checksum.
pub fn edit(d: &Path, f: impl FnOnce(&mut Value)) {
    let path = d.join("manifest.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, sealed(&v)).unwrap();
}

/// Edits the manifest of the checkpoint in `d`, leaving its checksum as it was.
pub fn edit_unsealed(d: &Path, f: impl FnOnce(&mut Value)) {
    let path = d.join("manifest.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// Writes a NaN over the first element of `tensor`'s piece in `file` of the checkpoint in `d`
/// and recomputes every checksum that covers it (the piece's, the file's, the manifest's).
pub fn poison(d: &Path, tensor: &str, file: &str) {
    let path = d.join(file);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offsets = &header[tensor]["data_offsets"];
    let (a, b) = (
        8 + n + offsets[0].as_u64().unwrap() as usize,
        8 + n + offsets[1].as_u64().unwrap() as usize,
    );
    let nan = match header[tensor]["dtype"].as_str().unwrap() {
        "F64" => f64::NAN.to_le_bytes().to_vec(),
        _ => f32::NAN.to_le_bytes().to_vec(),
    };
    bytes[a..a + nan.len()].copy_from_slice(&nan);
    std::fs::write(&path, &bytes).unwrap();
    let piece_crc = crc32c::crc32c(&bytes[a..b]);
    edit(d, |m| {
        for f in m["files"].as_array_mut().unwrap() {
            if f["name"] == file {
                f["bytes"] = json!(bytes.len());
                f["crc32c"] = json!(crc32c::crc32c(&bytes));
            }
        }
        for p in m["tensors"][tensor]["pieces"].as_array_mut().unwrap() {
            if p["file"] == file {
                p["crc32c"] = json!(piece_crc);
            }
        }
    });
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
    let manifest = |bytes: &'static [u8]| -> Box<dyn Fn(&Path)> {
        Box::new(move |d: &Path| std::fs::write(d.join("manifest.json"), bytes).unwrap())
    };
    // The piece of `w` and its entry in the file list renamed `name`.
    let piece_named = |name: &'static str| -> Box<dyn Fn(&Path)> {
        Box::new(move |d: &Path| {
            edit(d, |m| {
                m["files"][0]["name"] = json!(name);
                m["tensors"]["w"]["pieces"][0]["file"] = json!(name);
            })
        })
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
            manifest(b"{\"format\": \"oxiflow-checkpoint\", "),
        ),
        (
            "manifest fields missing",
            "bad manifest",
            manifest(b"{\"format\": \"oxiflow-checkpoint\"}"),
        ),
        (
            "another format",
            "not an oxiflow checkpoint",
            set("/format", json!("pytorch")),
        ),
        ("old version", "version 1", set("/version", json!(1))),
        (
            "version flipped 3 -> 2, checksum left",
            "manifest version 2",
            Box::new(|d: &Path| edit_unsealed(d, |m| m["version"] = json!(2))),
        ),
        (
            "metadata step changed, checksum left",
            "manifest checksum mismatch",
            Box::new(|d: &Path| edit_unsealed(d, |m| m["metadata"]["step"] = json!("2"))),
        ),
        (
            "checksum field removed",
            "missing field `manifest_crc32c`",
            Box::new(|d: &Path| {
                edit_unsealed(d, |m| {
                    m.as_object_mut().unwrap().remove("manifest_crc32c");
                })
            }),
        ),
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
            "saved whole, so one piece covering [0..4, 0..3]",
            set("/tensors/w/pieces/0/region", json!([[0, 9], [0, 3]])),
        ),
        (
            "region that leaves a gap",
            "saved whole, so one piece covering [0..4, 0..3]",
            set("/tensors/w/pieces/0/region", json!([[0, 2], [0, 3]])),
        ),
        (
            "a layout its pieces do not follow",
            "the manifest lists 1 piece(s) but its layout [\"S(0)\"] on mesh [2] makes 2",
            set(
                "/tensors/w/layout",
                json!({"mesh": [2], "ranks": [0, 1], "sbp": ["S(0)"]}),
            ),
        ),
        (
            "a layout with a partial sum",
            "a saved piece is never a partial sum",
            set(
                "/tensors/w/layout",
                json!({"mesh": [1], "ranks": [0], "sbp": ["P"]}),
            ),
        ),
        (
            "absolute piece path",
            "not a plain file name",
            piece_named("/etc/passwd"),
        ),
        (
            "piece path with ..",
            "not a plain file name",
            piece_named("../x"),
        ),
        (
            "piece file not listed",
            "not among the checkpoint's files",
            set("/tensors/w/pieces/0/file", json!("rank-00009.safetensors")),
        ),
        (
            "duplicated piece",
            "saved whole, so one piece",
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
            "optimizer state optim/w/exp_avg is missing",
            set(
                "/optimizer",
                json!({"step_count": 1, "slots": ["exp_avg"], "params": ["w"], "empty": []}),
            ),
        ),
        (
            "NaN value with every checksum recomputed",
            "holds a non-finite value (NaN)",
            Box::new(|d: &Path| poison(d, "w", "rank-00000.safetensors")),
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
