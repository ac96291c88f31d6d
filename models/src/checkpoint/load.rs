//! Loading: the checkpoint is located and verified whole first (see `locate` and `verify`),
//! then each rank computes the region its target layout needs and copies it out of the saved
//! pieces that intersect it. No communication. Nothing is changed until every value (and the
//! optimizer state) has been read, so a load either applies completely or is refused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use oxiflow_sbp::Region;

use crate::nn::Parameter;
use crate::optim::Optimizer;
use crate::Result;
use oxiflow_tensor::Storage;
use oxiflow_tensor::Tensor;

use super::locate::{locate, Verified};
use super::manifest::Manifest;
use super::pieces::{copy_region, from_bytes, intersect};
use super::verify::{bad, checked_file, parse_file, piece_view};
use super::{optim_key, Metadata};

/// How to load.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// When the checkpoint holds no optimizer state, or state of another optimizer (other
    /// slots), start this optimizer fresh (every slot unset, step count 0) instead of refusing;
    /// the report names every slot reset. State of the same optimizer is always loaded whole.
    pub reset_missing_optimizer_state: bool,
}

/// What a load did.
#[derive(Clone, Debug)]
pub struct LoadReport {
    /// The checkpoint's metadata.
    pub metadata: Metadata,
    /// The directory read: the requested path, or its `.old` (see `fell_back`).
    pub dir: PathBuf,
    /// Why `<path>.old` was read instead of the requested path (also logged as a warning).
    pub fell_back: Option<String>,
    /// The optimizer state names (`optim/<param>/<slot>`) started fresh under
    /// `LoadOptions::reset_missing_optimizer_state` (also logged as a warning).
    pub reset: Vec<String>,
}

/// Reads the value of `name` into `like`'s layout (shape, dtype, placement, nd-SBP).
fn load_one(
    m: &Verified,
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
            let mut buf = Vec::new();
            buf.try_reserve_exact(n * es).map_err(|e| {
                bad(
                    dir,
                    format!("{name}: cannot allocate this rank's {} bytes: {e}", n * es),
                )
            })?;
            buf.resize(n * es, 0u8);
            if !zero && n > 0 {
                for p in &entry.pieces {
                    let region = p.ranges();
                    let Some(inter) = intersect(&region, &need) else {
                        continue;
                    };
                    if !files.contains_key(&p.file) {
                        let bytes = checked_file(dir, &m.manifest, &p.file)?;
                        files.insert(p.file.clone(), bytes);
                    }
                    let bytes = files.get(&p.file).map(Vec::as_slice).unwrap_or(&[]);
                    let path = dir.join(&p.file);
                    let file = parse_file(bytes, &path)?;
                    let view = piece_view(&file, &path, name, p, dtype)?;
                    copy_region(view.data(), &region, &mut buf, &need, &inter, es);
                }
            }
            let arr = from_bytes(dtype, &local, &buf)
                .ok_or_else(|| bad(dir, format!("{name}: bad piece data")))?;
            Some(Storage::Cpu(arr))
        }
    };
    Tensor::with_layout_of(like, piece).map_err(|e| bad(dir, format!("{name}: {e}")))
}

/// Reads the manifest of the checkpoint a load of `path` would read (`path`, or `<path>.old`
/// by the recovery rule), after verifying the whole checkpoint.
pub fn read_manifest_at(path: &Path) -> Result<Manifest> {
    locate(path).map(|v| v.manifest)
}

/// The tensor names a checkpoint holds.
pub fn read_manifest_names(path: &Path) -> Result<Vec<String>> {
    Ok(read_manifest_at(path)?.tensors.into_keys().collect())
}

/// Loads the named tensors, each into the layout of its `like` tensor (so a checkpoint saved
/// under one parallel layout loads under another). Returns them with the metadata.
pub fn load_tensors(path: &Path, targets: &[(String, Tensor)]) -> Result<(Vec<Tensor>, Metadata)> {
    let m = locate(path)?;
    let mut files = HashMap::new();
    let mut out = Vec::with_capacity(targets.len());
    for (name, like) in targets {
        out.push(load_one(&m, &mut files, name, like)?);
    }
    Ok((out, m.manifest.metadata.clone()))
}

/// Loads parameters (each into its current layout) and, optionally, the optimizer state
/// saved by `save`, which must be whole (every slot of every parameter). Returns the
/// checkpoint's metadata.
pub fn load(
    path: &Path,
    params: &[Parameter],
    optim: Option<&mut dyn Optimizer>,
) -> Result<Metadata> {
    load_with(path, params, optim, &LoadOptions::default()).map(|r| r.metadata)
}

/// `load` with options; the report says which directory was read and what was reset.
pub fn load_with(
    path: &Path,
    params: &[Parameter],
    optim: Option<&mut dyn Optimizer>,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let m = locate(path)?;
    let mut files = HashMap::new();
    let values = params
        .iter()
        .map(|p| load_one(&m, &mut files, p.name(), &p.value()))
        .collect::<Result<Vec<Tensor>>>()?;
    let plan = match &optim {
        Some(o) => Some(plan_optimizer(&m, &mut files, &**o, opts)?),
        None => None,
    };
    for (p, t) in params.iter().zip(&values) {
        p.set_value(t)?;
    }
    let mut reset = Vec::new();
    if let (Some(o), Some(plan)) = (optim, plan) {
        for (i, slot, t) in plan.states {
            o.set_state(i, slot, t)?;
        }
        o.set_step_count(plan.step_count);
        if !plan.reset.is_empty() {
            tracing::warn!(
                "checkpoint {}: {}; started fresh (step count 0): {}",
                m.dir.display(),
                plan.why_reset,
                plan.reset.join(", ")
            );
        }
        reset = plan.reset;
    }
    Ok(LoadReport {
        metadata: m.manifest.metadata.clone(),
        dir: m.dir,
        fell_back: m.fell_back,
        reset,
    })
}

/// The optimizer state to set, read before anything is changed.
struct OptimizerPlan {
    states: Vec<(usize, &'static str, Tensor)>,
    step_count: u64,
    reset: Vec<String>,
    why_reset: String,
}

/// Reads the optimizer state for `o`: the checkpoint must hold the state of the same optimizer
/// (the same slots, the same parameters), every (parameter, slot) saved or recorded as never
/// initialised (then `o` must not have it either). Under
/// `LoadOptions::reset_missing_optimizer_state`, a checkpoint without state of this optimizer
/// starts `o` fresh instead.
fn plan_optimizer(
    m: &Verified,
    files: &mut HashMap<String, Vec<u8>>,
    o: &dyn Optimizer,
    opts: &LoadOptions,
) -> Result<OptimizerPlan> {
    let dir = &m.dir;
    let names: Vec<String> = o.params().iter().map(|p| p.name().to_string()).collect();
    let slots: Vec<String> = o.slot_names().iter().map(|s| s.to_string()).collect();
    let all_keys = || -> Vec<String> {
        names
            .iter()
            .flat_map(|p| slots.iter().map(move |s| optim_key(p, s)))
            .collect()
    };
    let missing = match &m.manifest.optimizer {
        None => {
            Some("the checkpoint has no optimizer state (saved without an optimizer)".to_string())
        }
        Some(e) if e.slots != slots => Some(format!(
            "the checkpoint's optimizer state does not fit this optimizer: it holds slots {:?}, \
             this optimizer's state slots are {slots:?}",
            e.slots
        )),
        Some(_) => None,
    };
    if let Some(why) = missing {
        if !opts.reset_missing_optimizer_state {
            return Err(bad(
                dir,
                format!(
                    "{why}; refusing to resume without it (a load may reset it only when asked)"
                ),
            ));
        }
        let has_state = (0..names.len()).any(|i| slots.iter().any(|s| o.state(i, s).is_some()));
        if has_state {
            return Err(bad(
                dir,
                format!("{why}, and this optimizer already has state, so it cannot start fresh"),
            ));
        }
        return Ok(OptimizerPlan {
            states: Vec::new(),
            step_count: 0,
            reset: all_keys(),
            why_reset: why,
        });
    }
    let Some(entry) = &m.manifest.optimizer else {
        return Err(bad(dir, "no optimizer state"));
    };
    if entry.params != names {
        let first = entry
            .params
            .iter()
            .zip(&names)
            .find(|(a, b)| a != b)
            .map_or_else(
                || {
                    format!(
                        "{} parameters saved, {} here",
                        entry.params.len(),
                        names.len()
                    )
                },
                |(a, b)| format!("saved parameter {a} where this optimizer has {b}"),
            );
        return Err(bad(
            dir,
            format!("the checkpoint's optimizer state is for other parameters: {first}"),
        ));
    }
    let mut states = Vec::new();
    for (i, p) in o.params().iter().enumerate() {
        for &slot in o.slot_names() {
            let key = optim_key(p.name(), slot);
            if entry.empty.contains(&key) {
                if o.state(i, slot).is_some() {
                    return Err(bad(
                        dir,
                        format!(
                            "{key} was never initialised when saved, but this optimizer has it; \
                             load into a fresh optimizer"
                        ),
                    ));
                }
                continue;
            }
            let t = load_one(m, files, &key, &p.value())?;
            states.push((i, slot, t));
        }
    }
    Ok(OptimizerPlan {
        states,
        step_count: entry.step_count,
        reset: Vec::new(),
        why_reset: String::new(),
    })
}
