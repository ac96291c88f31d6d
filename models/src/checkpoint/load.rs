//! Loading: each rank computes the region its target layout needs and copies it out of the
//! saved pieces that intersect it, reading only the files that hold them. No communication.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use oxiflow_sbp::Region;
use safetensors::SafeTensors;
use serde_json::Value;

use crate::nn::Parameter;
use crate::optim::Optimizer;
use crate::{Result, TensorError};
use oxiflow_tensor::Storage;
use oxiflow_tensor::Tensor;

use super::atomic::{io_err, resolve_for_load, MANIFEST};
use super::pieces::{copy_region, dtype_from_name, from_bytes, intersect};
use super::{optim_key, Metadata};

struct Manifest {
    dir: PathBuf,
    json: Value,
}

fn bad(path: &Path, detail: impl Into<String>) -> TensorError {
    TensorError::Checkpoint {
        op: "checkpoint load",
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

fn read_manifest(path: &Path) -> Result<Manifest> {
    let dir = resolve_for_load(path).ok_or_else(|| {
        bad(
            path,
            "no complete checkpoint (no manifest.json here or in <path>.old)",
        )
    })?;
    let text = std::fs::read(dir.join(MANIFEST)).map_err(|e| io_err("checkpoint load", &dir, e))?;
    let json: Value =
        serde_json::from_slice(&text).map_err(|e| bad(&dir, format!("bad manifest: {e}")))?;
    if json.get("format").and_then(Value::as_str) != Some("oxiflow-checkpoint") {
        return Err(bad(&dir, "not an oxiflow checkpoint manifest"));
    }
    Ok(Manifest { dir, json })
}

/// The tensor names a checkpoint holds.
pub fn read_manifest_names(path: &Path) -> Result<Vec<String>> {
    let m = read_manifest(path)?;
    Ok(m.json
        .get("tensors")
        .and_then(Value::as_object)
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default())
}

fn metadata_of(m: &Manifest) -> Metadata {
    m.json
        .get("metadata")
        .and_then(Value::as_object)
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

fn region_of_json(v: &Value) -> Option<Vec<Range<usize>>> {
    v.as_array()?
        .iter()
        .map(|r| {
            let a = r.as_array()?;
            Some(a.first()?.as_u64()? as usize..a.get(1)?.as_u64()? as usize)
        })
        .collect()
}

/// Reads the value of `name` into `like`'s layout (shape, dtype, placement, nd-SBP).
fn load_one(
    m: &Manifest,
    files: &mut HashMap<String, Vec<u8>>,
    name: &str,
    like: &Tensor,
) -> Result<Tensor> {
    let dir = &m.dir;
    let entry = m
        .json
        .get("tensors")
        .and_then(|t| t.get(name))
        .ok_or_else(|| bad(dir, format!("no tensor {name}")))?;
    let shape: Vec<usize> = entry
        .get("shape")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|d| d.as_u64().map(|d| d as usize))
                .collect()
        })
        .ok_or_else(|| bad(dir, format!("{name}: no shape")))?;
    let dtype = entry
        .get("dtype")
        .and_then(Value::as_str)
        .and_then(dtype_from_name)
        .ok_or_else(|| bad(dir, format!("{name}: bad dtype")))?;
    if shape != like.shape().dims() || dtype != like.dtype() {
        return Err(bad(
            dir,
            format!(
                "{name} is [{}] {dtype} in the checkpoint but the target is {}",
                shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
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
            let n: usize = local.iter().product();
            let mut buf = vec![0u8; n * es];
            let mut covered = 0usize;
            if !zero && n > 0 {
                let pieces = entry
                    .get("pieces")
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad(dir, format!("{name}: no pieces")))?;
                for p in pieces {
                    let file = p
                        .get("file")
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad(dir, format!("{name}: piece without file")))?;
                    let region = p
                        .get("region")
                        .and_then(region_of_json)
                        .ok_or_else(|| bad(dir, format!("{name}: bad region")))?;
                    let Some(inter) = intersect(&region, &need) else {
                        continue;
                    };
                    if !files.contains_key(file) {
                        let bytes = std::fs::read(dir.join(file))
                            .map_err(|e| io_err("checkpoint load", &dir.join(file), e))?;
                        files.insert(file.to_string(), bytes);
                    }
                    let bytes = files.get(file).map(Vec::as_slice).unwrap_or(&[]);
                    let st = SafeTensors::deserialize(bytes)
                        .map_err(|e| bad(&dir.join(file), e.to_string()))?;
                    let view = st
                        .tensor(name)
                        .map_err(|e| bad(&dir.join(file), format!("{name}: {e}")))?;
                    let plen: usize = region.iter().map(|r| r.len()).product::<usize>() * es;
                    if view.data().len() != plen {
                        return Err(bad(
                            &dir.join(file),
                            format!(
                                "{name}: piece has {} bytes, expected {plen}",
                                view.data().len()
                            ),
                        ));
                    }
                    copy_region(view.data(), &region, &mut buf, &need, &inter, es);
                    covered += inter.iter().map(|r| r.len()).product::<usize>();
                }
                if covered < n {
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
    Ok((out, metadata_of(&m)))
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
    let meta = metadata_of(&m);
    if let Some(o) = optim {
        let names: Vec<(usize, String, Tensor)> = o
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| (i, p.name().to_string(), p.value()))
            .collect();
        let has = |k: &str| m.json.get("tensors").and_then(|t| t.get(k)).is_some();
        for (i, pname, like) in names {
            for slot in o.slot_names() {
                let key = optim_key(&pname, slot);
                if has(&key) {
                    let t = load_one(&m, &mut files, &key, &like)?;
                    o.set_state(i, slot, t)?;
                }
            }
        }
        if let Some(n) = meta.get("optim.step_count").and_then(|s| s.parse().ok()) {
            o.set_step_count(n);
        }
    }
    Ok(meta)
}
