//! The manifest (`manifest.json`): its typed form, its own checksum, and the checks every
//! manifest passes before any data is read. A manifest that passes was not changed since it
//! was written (its crc32c covers every other field, the version included), names only plain
//! files inside the checkpoint, gives every tensor a known dtype and a shape whose byte size
//! fits in memory arithmetic, puts every piece exactly where the tensor's recorded layout puts
//! it (so pieces tile their tensor, and two swapped regions are refused), names every
//! optimizer slot of every parameter as saved (in its parameter's shape) or as never
//! initialised, and counts no more optimizer steps than training steps. Validation is pure and
//! bounded in time and memory by the input size.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use serde::{Deserialize, Serialize};

use super::layout::{file_name, pieces_of, LayoutEntry};
use super::{optim_key, Metadata};

/// The name of the manifest file in a checkpoint directory.
pub(crate) const MANIFEST: &str = "manifest.json";
pub(crate) const FORMAT: &str = "oxiflow-checkpoint";
/// Version 3: the manifest's own checksum, piece layouts, the optimizer section. Earlier
/// versions carry no manifest checksum and are refused.
pub(crate) const VERSION: u32 = 3;
/// The largest manifest read (larger ones are refused before reading).
pub(crate) const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Metadata keys whose values must be unsigned integers when present.
pub(crate) const INTEGER_KEYS: [&str; 1] = ["step"];

/// `manifest.json` as written by `save` and read by `load`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// crc32c of the manifest's canonical form ([`Manifest::checksum`]).
    pub manifest_crc32c: u32,
    /// The data files (one per writing rank), with their size and checksum.
    pub files: Vec<FileEntry>,
    pub metadata: Metadata,
    pub tensors: BTreeMap<String, TensorEntry>,
    /// The optimizer whose state the checkpoint holds; None: saved without one.
    pub optimizer: Option<OptimizerEntry>,
}

/// One data file of the checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// A plain file name inside the checkpoint directory.
    pub name: String,
    pub bytes: u64,
    pub crc32c: u32,
}

/// One saved tensor: its global shape, dtype, the layout it was saved under (None: saved
/// whole, one piece) and the pieces that hold it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    pub shape: Vec<usize>,
    pub dtype: String,
    pub layout: Option<LayoutEntry>,
    pub pieces: Vec<PieceEntry>,
}

/// One piece: the file holding it (under the tensor's name), its global region and the crc32c
/// of its little-endian bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PieceEntry {
    pub file: String,
    pub region: Vec<[usize; 2]>,
    pub crc32c: u32,
}

/// The optimizer state a checkpoint holds: every (parameter, slot) pair is either saved as the
/// tensor `optim/<param>/<slot>` or listed in `empty` (never initialised: before the first
/// step, a parameter without a gradient so far, or a slot the optimizer's options leave unused).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerEntry {
    pub step_count: u64,
    /// The optimizer's state slots (e.g. `exp_avg`, `exp_avg_sq`).
    pub slots: Vec<String>,
    /// The parameters it updates, in order.
    pub params: Vec<String>,
    /// The `optim/<param>/<slot>` names that hold no state.
    pub empty: Vec<String>,
}

impl PieceEntry {
    pub(crate) fn ranges(&self) -> Vec<Range<usize>> {
        self.region.iter().map(|[a, b]| *a..*b).collect()
    }
}

/// Whether `name` is a file name the manifest may refer to: one path component of ASCII
/// letters, digits, `.`, `_` and `-`, not starting with `.` (so never `.`, `..`, absolute,
/// nested or hidden).
pub(crate) fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

pub(crate) fn show_region(r: &[Range<usize>]) -> String {
    let parts: Vec<String> = r
        .iter()
        .map(|x| format!("{}..{}", x.start, x.end))
        .collect();
    format!("[{}]", parts.join(", "))
}

fn show_piece(file: &str, region: &[Range<usize>]) -> String {
    format!("{} in {file}", show_region(region))
}

/// Checks one tensor's dtype, shape and pieces against its layout (or, saved whole, one piece
/// covering it) and that every piece's file is listed.
fn check_tensor(name: &str, t: &TensorEntry, files: &BTreeSet<&str>) -> Result<DType, String> {
    let dtype = t
        .dtype
        .parse::<DType>()
        .ok()
        .ok_or_else(|| format!("{name}: unknown dtype {:?}", t.dtype))?;
    let shape = Shape::new(t.shape.iter().copied());
    shape
        .checked_bytes(dtype.size())
        .ok_or_else(|| format!("{name}: shape {shape} is too large"))?;
    for p in &t.pieces {
        if !files.contains(p.file.as_str()) {
            return Err(format!(
                "{name}: piece file {:?} is not among the checkpoint's files",
                p.file
            ));
        }
    }
    let listed: Vec<(&str, Vec<Range<usize>>)> = t
        .pieces
        .iter()
        .map(|p| (p.file.as_str(), p.ranges()))
        .collect();
    let Some(record) = &t.layout else {
        let whole: Vec<Range<usize>> = t.shape.iter().map(|&n| 0..n).collect();
        return match listed.as_slice() {
            [(_, r)] if *r == whole => Ok(dtype),
            _ => Err(format!(
                "{name}: saved whole, so one piece covering {}, but the manifest lists {}",
                show_region(&whole),
                listed
                    .iter()
                    .map(|(f, r)| show_piece(f, r))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        };
    };
    let expected = pieces_of(&t.shape, record).map_err(|e| format!("{name}: {e}"))?;
    let under = || format!("its layout {:?} on mesh {}", record.sbp, record.mesh_text());
    if expected.len() != listed.len() {
        return Err(format!(
            "{name}: the manifest lists {} piece(s) but {} makes {}",
            listed.len(),
            under(),
            expected.len()
        ));
    }
    for (i, ((writer, region), (file, got))) in expected.iter().zip(&listed).enumerate() {
        let want_file = file_name(*writer);
        if got.as_slice() != region.as_slice() || *file != want_file {
            return Err(format!(
                "{name}: piece {i} is {}, but {} puts {} there",
                show_piece(file, got),
                under(),
                show_piece(&want_file, region)
            ));
        }
    }
    Ok(dtype)
}

/// Checks that the optimizer section names every (parameter, slot) pair once, as saved or
/// empty, all-or-nothing per parameter, and that no other `optim/` tensor is saved.
fn check_optimizer(
    o: &OptimizerEntry,
    tensors: &BTreeMap<String, TensorEntry>,
) -> Result<(), String> {
    let mut slots = BTreeSet::new();
    for s in &o.slots {
        if s.is_empty() || s.contains('/') || !slots.insert(s.as_str()) {
            return Err(format!(
                "optimizer slot {s:?} is empty, nested or listed twice"
            ));
        }
    }
    let mut params = BTreeSet::new();
    for p in &o.params {
        if !params.insert(p.as_str()) {
            return Err(format!("optimizer parameter {p} is listed twice"));
        }
        if !tensors.contains_key(p) {
            return Err(format!("optimizer parameter {p} is not saved"));
        }
    }
    let mut empty: BTreeSet<&str> = BTreeSet::new();
    for e in &o.empty {
        if !empty.insert(e.as_str()) {
            return Err(format!("optimizer state {e} is listed as empty twice"));
        }
    }
    let mut keys = BTreeSet::new();
    for p in &o.params {
        let mut saved = Vec::new();
        for s in &o.slots {
            let key = optim_key(p, s);
            match (tensors.get(&key), empty.contains(key.as_str())) {
                (Some(state), false) => {
                    let param = tensors.get(p).map(|t| &t.shape);
                    if param != Some(&state.shape) {
                        return Err(format!(
                            "optimizer state {key} has shape {:?} but its parameter {p} has \
                             {:?}",
                            state.shape,
                            param.map_or(&[][..], Vec::as_slice)
                        ));
                    }
                    saved.push(true)
                }
                (None, true) => saved.push(false),
                (Some(_), true) => {
                    return Err(format!(
                        "optimizer state {key} is both saved and listed as empty"
                    ))
                }
                (None, false) => {
                    return Err(format!(
                        "optimizer state {key} is missing: neither saved nor listed as empty"
                    ))
                }
            }
            keys.insert(key);
        }
        if saved.iter().any(|&s| s) && saved.iter().any(|&s| !s) {
            return Err(format!(
                "optimizer state of {p} is partial: slots {:?} saved, {:?} empty",
                o.slots
                    .iter()
                    .zip(&saved)
                    .filter(|(_, &s)| s)
                    .map(|(n, _)| n)
                    .collect::<Vec<_>>(),
                o.slots
                    .iter()
                    .zip(&saved)
                    .filter(|(_, &s)| !s)
                    .map(|(n, _)| n)
                    .collect::<Vec<_>>()
            ));
        }
    }
    if let Some(e) = empty.iter().find(|e| !keys.contains(**e)) {
        return Err(format!(
            "optimizer state {e} is listed as empty but names no (parameter, slot) pair"
        ));
    }
    if let Some(t) = tensors
        .keys()
        .find(|t| t.starts_with("optim/") && !keys.contains(*t))
    {
        return Err(format!(
            "optimizer state {t} is saved but belongs to no (parameter, slot) pair"
        ));
    }
    Ok(())
}

#[derive(Deserialize)]
struct Header {
    format: String,
    version: u32,
}

fn check_header(format: &str, version: u32) -> Result<(), String> {
    if format != FORMAT {
        return Err(format!("not an oxiflow checkpoint (format {format:?})"));
    }
    if version != VERSION {
        return Err(format!(
            "manifest version {version} (this build reads version {VERSION} only: earlier \
             versions carry no manifest checksum)"
        ));
    }
    Ok(())
}

impl Manifest {
    /// Parses and validates manifest bytes: format and version, the typed fields, the
    /// manifest's checksum, then [`Manifest::validate`]; the error says what is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Manifest, String> {
        let h: Header = serde_json::from_slice(bytes).map_err(|e| format!("bad manifest: {e}"))?;
        check_header(&h.format, h.version)?;
        let m: Manifest =
            serde_json::from_slice(bytes).map_err(|e| format!("bad manifest: {e}"))?;
        let sum = m.checksum()?;
        if sum != m.manifest_crc32c {
            return Err(format!(
                "manifest checksum mismatch: its contents give crc32c {sum:#010x}, the manifest \
                 says {:#010x} (changed or corrupted after it was written)",
                m.manifest_crc32c
            ));
        }
        m.validate()?;
        Ok(m)
    }

    /// The crc32c of the canonical form: the compact JSON of this manifest with
    /// `manifest_crc32c` set to 0.
    pub fn checksum(&self) -> Result<u32, String> {
        let canonical = Manifest {
            manifest_crc32c: 0,
            ..self.clone()
        };
        let bytes =
            serde_json::to_vec(&canonical).map_err(|e| format!("encoding the manifest: {e}"))?;
        Ok(crc32c::crc32c(&bytes))
    }

    /// Sets `manifest_crc32c` to the checksum of the current contents.
    pub fn seal(&mut self) -> Result<(), String> {
        self.manifest_crc32c = self.checksum()?;
        Ok(())
    }

    /// The checks described in the module docs (all but the checksum).
    pub fn validate(&self) -> Result<(), String> {
        check_header(&self.format, self.version)?;
        let mut files = BTreeSet::new();
        for f in &self.files {
            if !is_plain_file_name(&f.name) || f.name == MANIFEST {
                return Err(format!(
                    "file name {:?} is not a plain file name inside the checkpoint",
                    f.name
                ));
            }
            if !files.insert(f.name.as_str()) {
                return Err(format!("file {} is listed twice", f.name));
            }
        }
        for (name, t) in &self.tensors {
            check_tensor(name, t, &files)?;
        }
        if let Some(o) = &self.optimizer {
            check_optimizer(o, &self.tensors)?;
        }
        for key in INTEGER_KEYS {
            if let Some(v) = self.metadata.get(key) {
                v.parse::<u64>()
                    .map_err(|_| format!("metadata {key} = {v:?} is not a step count"))?;
            }
        }
        if let (Some(o), Some(_)) = (&self.optimizer, self.metadata.get("step")) {
            if o.step_count > self.step() {
                return Err(format!(
                    "optimizer.step_count {} is beyond metadata step {}: a run updates at most \
                     once per step (the manifest was edited)",
                    o.step_count,
                    self.step()
                ));
            }
        }
        Ok(())
    }

    /// The entry of tensor `name` and its dtype (validated).
    pub(crate) fn tensor(&self, name: &str) -> Option<(&TensorEntry, DType)> {
        let t = self.tensors.get(name)?;
        Some((t, t.dtype.parse::<DType>().ok()?))
    }

    pub(crate) fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    /// The `step` metadata (0 when absent).
    pub fn step(&self) -> u64 {
        self.metadata
            .get("step")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }
}
