//! Loading: each rank computes the region its target layout needs and copies it out of the
//! saved pieces that intersect it, reading only the files that hold them. No communication.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use oxiflow_sbp::Region;
use safetensors::SafeTensors;

use crate::nn::Parameter;
use crate::optim::Optimizer;
use crate::{Result, TensorError};
use oxiflow_tensor::Storage;
use oxiflow_tensor::Tensor;

use oxiflow_dtype::DType;

use super::atomic::{io_err, resolve_for_load, MANIFEST};
use super::manifest::{show_region, Manifest, PieceEntry, MAX_MANIFEST_BYTES};
use super::pieces::{copy_region, from_bytes, intersect, st_dtype};
use super::{optim_key, Metadata};

/// A validated manifest and the directory it was read from.
struct Loaded {
    dir: PathBuf,
    manifest: Manifest,
}

fn bad(path: &Path, detail: impl Into<String>) -> TensorError {
    TensorError::Checkpoint {
        op: "checkpoint load",
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

/// Reads a regular file (never through a symlink), refusing ones over `limit` bytes.
fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| io_err("checkpoint load", path, e))?;
    if !meta.is_file() {
        return Err(bad(path, "not a regular file (symlinks are not followed)"));
    }
    if meta.len() > limit {
        return Err(bad(
            path,
            format!("{} bytes, more than the {limit} expected", meta.len()),
        ));
    }
    std::fs::read(path).map_err(|e| io_err("checkpoint load", path, e))
}

fn read_manifest(path: &Path) -> Result<Loaded> {
    let Some(dir) = resolve_for_load(path) else {
        // A manifest.json that is not ours: say what is wrong with it.
        let file = path.join(MANIFEST);
        if let Ok(text) = read_regular(&file, MAX_MANIFEST_BYTES) {
            let detail = Manifest::parse(&text).err().unwrap_or_else(|| {
                "the checkpoint directory is not a plain directory (symlinks are not followed)"
                    .into()
            });
            return Err(bad(&file, detail));
        }
        return Err(bad(
            path,
            "no complete checkpoint (no manifest.json here or in <path>.old)",
        ));
    };
    let file = dir.join(MANIFEST);
    let text = read_regular(&file, MAX_MANIFEST_BYTES)?;
    let manifest = Manifest::parse(&text).map_err(|e| bad(&file, e))?;
    Ok(Loaded { dir, manifest })
}

/// Reads and validates the manifest of the checkpoint at `path` (or `<path>.old`, see the
/// recovery rule) without reading any data.
pub fn read_manifest_at(path: &Path) -> Result<Manifest> {
    read_manifest(path).map(|l| l.manifest)
}

/// The tensor names a checkpoint holds.
pub fn read_manifest_names(path: &Path) -> Result<Vec<String>> {
    Ok(read_manifest(path)?.manifest.tensors.into_keys().collect())
}

/// The bytes of data file `name`, read once per load and checked against the manifest's size
/// and crc32c.
fn data_file<'a>(
    m: &Loaded,
    files: &'a mut HashMap<String, Vec<u8>>,
    name: &str,
) -> Result<&'a [u8]> {
    if !files.contains_key(name) {
        let path = m.dir.join(name);
        let entry = m
            .manifest
            .file(name)
            .ok_or_else(|| bad(&path, "not listed in the manifest"))?;
        let bytes = read_regular(&path, entry.bytes)?;
        if bytes.len() as u64 != entry.bytes {
            return Err(bad(
                &path,
                format!(
                    "{} bytes, the manifest says {} (truncated?)",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        let sum = crc32c::crc32c(&bytes);
        if sum != entry.crc32c {
            return Err(bad(
                &path,
                format!(
                    "corrupt: crc32c {sum:#010x}, the manifest says {:#010x}",
                    entry.crc32c
                ),
            ));
        }
        files.insert(name.to_string(), bytes);
    }
    Ok(files.get(name).map(Vec::as_slice).unwrap_or(&[]))
}

/// The bytes of one saved piece of `name` (dtype, shape and crc32c checked).
fn piece_bytes<'a>(
    file: &'a [u8],
    path: &Path,
    name: &str,
    piece: &PieceEntry,
    region: &[Range<usize>],
    dtype: DType,
) -> Result<safetensors::tensor::TensorView<'a>> {
    let st = SafeTensors::deserialize(file).map_err(|e| bad(path, e.to_string()))?;
    let view = st
        .tensor(name)
        .map_err(|e| bad(path, format!("{name}: {e}")))?;
    let dims: Vec<usize> = region.iter().map(|r| r.len()).collect();
    if Some(view.dtype()) != st_dtype(dtype) || view.shape() != dims.as_slice() {
        return Err(bad(
            path,
            format!(
                "{name}: piece is {:?} {:?}, the manifest says {dtype} {dims:?}",
                view.dtype(),
                view.shape()
            ),
        ));
    }
    let sum = crc32c::crc32c(view.data());
    if sum != piece.crc32c {
        return Err(bad(
            path,
            format!(
                "{name}: corrupt piece {}: crc32c {sum:#010x}, the manifest says {:#010x}",
                show_region(region),
                piece.crc32c
            ),
        ));
    }
    Ok(view)
}

/// Reads the value of `name` into `like`'s layout (shape, dtype, placement, nd-SBP).
fn load_one(
    m: &Loaded,
    files: &mut HashMap<String, Vec<u8>>,
    name: &str,
    like: &Tensor,
) -> Result<Tensor> {
    let dir = &m.dir;
    let (entry, dtype) = m
        .manifest
        .tensor(name)
        .ok_or_else(|| bad(dir, format!("no tensor {name}")))?;
    let shape = &entry.shape;
    if shape.as_slice() != like.shape().dims() || dtype != like.dtype() {
        return Err(bad(
            dir,
            format!(
                "{name} is {shape:?} {dtype} in the checkpoint but the target is {}",
                like.describe()
            ),
        ));
    }
    // The region this rank needs; None: outside the placement; zero: a non-root P coordinate.
    let (need, zero): (Option<Region>, bool) = match (like.layout(), like.context()) {
        (Some(l), Some(ctx)) => match l.placement().coord_of(ctx.rank()) {
            Some(c) => (Some(l.region_at(&c)), !l.is_partial_root(&c)),
            None => (None, false),
        },
        _ => (Some(shape.iter().map(|&n| 0..n).collect()), false),
    };
    let es = dtype.size();
    let piece = match need {
        None => None,
        Some(need) => {
            let local: Vec<usize> = need.iter().map(|r| r.len()).collect();
            // The shape was validated (its byte size fits), so the local one does too.
            let n: usize = local.iter().product();
            let mut buf = vec![0u8; n * es];
            let mut covered = 0usize;
            if !zero && n > 0 {
                for p in &entry.pieces {
                    let region = p.ranges();
                    let Some(inter) = intersect(&region, &need) else {
                        continue;
                    };
                    let path = dir.join(&p.file);
                    let bytes = data_file(m, files, &p.file)?;
                    let view = piece_bytes(bytes, &path, name, p, &region, dtype)?;
                    copy_region(view.data(), &region, &mut buf, &need, &inter, es);
                    covered += inter.iter().map(|r| r.len()).product::<usize>();
                }
                if covered != n {
                    return Err(bad(dir, format!("{name}: the saved pieces cover {covered} of the {n} elements this rank needs")));
                }
            }
            let arr = from_bytes(dtype, &local, &buf)
                .ok_or_else(|| bad(dir, format!("{name}: bad piece data")))?;
            Some(Storage::Cpu(arr))
        }
    };
    Tensor::with_layout_of(like, piece).map_err(|e| bad(dir, format!("{name}: {e}")))
}

/// Loads the named tensors, each into the layout of its `like` tensor (so a checkpoint saved
/// under one parallel layout loads under another). Returns them with the metadata.
pub fn load_tensors(path: &Path, targets: &[(String, Tensor)]) -> Result<(Vec<Tensor>, Metadata)> {
    let m = read_manifest(path)?;
    let mut files = HashMap::new();
    let mut out = Vec::with_capacity(targets.len());
    for (name, like) in targets {
        out.push(load_one(&m, &mut files, name, like)?);
    }
    Ok((out, m.manifest.metadata.clone()))
}

/// Loads parameters (each into its current layout) and, optionally, the optimizer state
/// saved by `save`. Returns the checkpoint's metadata.
pub fn load(
    path: &Path,
    params: &[Parameter],
    optim: Option<&mut dyn Optimizer>,
) -> Result<Metadata> {
    let m = read_manifest(path)?;
    let mut files = HashMap::new();
    for p in params {
        let t = load_one(&m, &mut files, p.name(), &p.value())?;
        p.set_value(&t)?;
    }
    let meta = m.manifest.metadata.clone();
    if let Some(o) = optim {
        load_optimizer(&m, &mut files, o)?;
    }
    Ok(meta)
}

/// Loads the optimizer state: every state tensor the checkpoint lists must belong to one of
/// this optimizer's (parameter, slot) pairs, and the step count must be present.
fn load_optimizer(
    m: &Loaded,
    files: &mut HashMap<String, Vec<u8>>,
    o: &mut dyn Optimizer,
) -> Result<()> {
    let dir = &m.dir;
    let steps = m.manifest.metadata.get("optim.step_count").ok_or_else(|| {
        bad(
            dir,
            "the checkpoint has no optimizer state (saved without one)",
        )
    })?;
    let steps: u64 = steps.parse().map_err(|_| {
        bad(
            dir,
            format!("optim.step_count {steps:?} is not a step count"),
        )
    })?;
    let targets: Vec<(usize, &'static str, String, Tensor)> = o
        .params()
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            o.slot_names()
                .iter()
                .map(move |slot| (i, *slot, optim_key(p.name(), slot), p.value()))
        })
        .collect();
    if let Some(extra) = m
        .manifest
        .optimizer_state
        .iter()
        .find(|s| !targets.iter().any(|(_, _, k, _)| k == *s))
    {
        return Err(bad(
            dir,
            format!(
                "optimizer state {extra} does not fit this optimizer (its state slots: {})",
                o.slot_names().join(", ")
            ),
        ));
    }
    for (i, slot, key, like) in targets {
        if m.manifest.optimizer_state.contains(&key) {
            let t = load_one(m, files, &key, &like)?;
            o.set_state(i, slot, t)?;
        }
    }
    o.set_step_count(steps);
    Ok(())
}
