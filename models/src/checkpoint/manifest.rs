//! The manifest (`manifest.json`): its typed form and the checks every manifest passes before
//! any data is read. A manifest that passes names only plain files inside the checkpoint, gives
//! every tensor a known dtype and a shape whose byte size fits in memory arithmetic, and tiles
//! every tensor exactly once with its pieces (no overlap, no gap), so coverage cannot be faked
//! by a duplicated piece. Validation is pure and bounded in time and memory by the input size.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use serde::{Deserialize, Serialize};

use super::Metadata;

pub(crate) const FORMAT: &str = "oxiflow-checkpoint";
/// Version 2: per-file and per-piece crc32c checksums, the list of optimizer state tensors.
pub(crate) const VERSION: u32 = 2;
/// The largest manifest read (larger ones are refused before reading).
pub(crate) const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Metadata keys whose values must be unsigned integers when present.
pub(crate) const INTEGER_KEYS: [&str; 2] = ["step", "optim.step_count"];

/// `manifest.json` as written by `save` and read by `load`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// The data files (one per writing rank), with their size and checksum.
    pub files: Vec<FileEntry>,
    pub metadata: Metadata,
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Names of the tensors that hold optimizer state (all of them were saved).
    #[serde(default)]
    pub optimizer_state: Vec<String>,
}

/// One data file of the checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// A plain file name inside the checkpoint directory.
    pub name: String,
    pub bytes: u64,
    pub crc32c: u32,
}

/// One saved tensor: its global shape, dtype and the pieces that hold it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    pub shape: Vec<usize>,
    pub dtype: String,
    pub pieces: Vec<PieceEntry>,
}

/// One piece: the file holding it (under the tensor's name), its global region and the crc32c
/// of its little-endian bytes.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PieceEntry {
    pub file: String,
    pub region: Vec<[usize; 2]>,
    pub crc32c: u32,
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

fn volume(region: &[Range<usize>]) -> Option<usize> {
    region
        .iter()
        .try_fold(1usize, |a, r| a.checked_mul(r.len()))
}

fn overlaps(a: &[Range<usize>], b: &[Range<usize>]) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| x.start.max(y.start) < x.end.min(y.end))
}

/// Checks that `regions` (each inside `shape`, non-empty) are pairwise disjoint: a sweep along
/// the dim with the most distinct starts compares only pieces whose ranges meet on that dim.
fn check_disjoint(regions: &[Vec<Range<usize>>]) -> Result<(), String> {
    let Some(first) = regions.first() else {
        return Ok(());
    };
    let ndim = first.len();
    let sweep = (0..ndim)
        .max_by_key(|&d| {
            regions
                .iter()
                .map(|r| r[d].start)
                .collect::<BTreeSet<_>>()
                .len()
        })
        .unwrap_or(0);
    if ndim == 0 {
        return match regions.len() {
            1 => Ok(()),
            n => Err(format!("{n} pieces of a 0-d tensor")),
        };
    }
    let mut order: Vec<usize> = (0..regions.len()).collect();
    order.sort_by_key(|&i| regions[i][sweep].start);
    let mut active: Vec<usize> = Vec::new();
    for &i in &order {
        let start = regions[i][sweep].start;
        active.retain(|&j| regions[j][sweep].end > start);
        if let Some(&j) = active.iter().find(|&&j| overlaps(&regions[i], &regions[j])) {
            return Err(format!(
                "pieces {} and {} overlap",
                show_region(&regions[j]),
                show_region(&regions[i])
            ));
        }
        active.push(i);
    }
    Ok(())
}

pub(crate) fn show_region(r: &[Range<usize>]) -> String {
    let parts: Vec<String> = r
        .iter()
        .map(|x| format!("{}..{}", x.start, x.end))
        .collect();
    format!("[{}]", parts.join(", "))
}

fn check_tensor(name: &str, t: &TensorEntry, files: &BTreeSet<&str>) -> Result<DType, String> {
    let dtype = t
        .dtype
        .parse::<DType>()
        .ok()
        .ok_or_else(|| format!("{name}: unknown dtype {:?}", t.dtype))?;
    let shape = Shape::from(&t.shape);
    let numel = shape
        .checked_bytes(dtype.size())
        .and_then(|_| shape.checked_numel())
        .ok_or_else(|| format!("{name}: shape {shape} is too large"))?;
    let mut regions = Vec::with_capacity(t.pieces.len());
    let mut piece_files = BTreeSet::new();
    let mut total = 0usize;
    for p in &t.pieces {
        if !files.contains(p.file.as_str()) {
            return Err(format!(
                "{name}: piece file {:?} is not among the checkpoint's files",
                p.file
            ));
        }
        if !piece_files.insert(p.file.as_str()) {
            return Err(format!("{name}: two pieces in file {}", p.file));
        }
        let r = p.ranges();
        if r.len() != t.shape.len()
            || r.iter()
                .zip(&t.shape)
                .any(|(x, &n)| x.start >= x.end || x.end > n)
        {
            return Err(format!(
                "{name}: piece region {} is empty or outside the shape {:?}",
                show_region(&r),
                t.shape
            ));
        }
        total = volume(&r)
            .and_then(|v| total.checked_add(v))
            .filter(|&s| s <= numel)
            .ok_or_else(|| {
                format!("{name}: the pieces hold more than the {numel} elements of the tensor")
            })?;
        regions.push(r);
    }
    check_disjoint(&regions).map_err(|e| format!("{name}: {e}"))?;
    if total != numel {
        return Err(format!(
            "{name}: the pieces cover {total} of the {numel} elements"
        ));
    }
    Ok(dtype)
}

impl Manifest {
    /// Parses and validates manifest bytes; the error says what is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Manifest, String> {
        let m: Manifest =
            serde_json::from_slice(bytes).map_err(|e| format!("bad manifest: {e}"))?;
        m.validate()?;
        Ok(m)
    }

    /// The checks described in the module docs.
    pub fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "not an oxiflow checkpoint (format {:?})",
                self.format
            ));
        }
        if self.version != VERSION {
            return Err(format!(
                "manifest version {} (this build reads version {VERSION})",
                self.version
            ));
        }
        let mut files = BTreeSet::new();
        for f in &self.files {
            if !is_plain_file_name(&f.name) || f.name == super::atomic::MANIFEST {
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
        for s in &self.optimizer_state {
            if !self.tensors.contains_key(s) {
                return Err(format!("optimizer state {s} is listed but not saved"));
            }
        }
        for key in INTEGER_KEYS {
            if let Some(v) = self.metadata.get(key) {
                v.parse::<u64>()
                    .map_err(|_| format!("metadata {key} = {v:?} is not a step count"))?;
            }
        }
        Ok(())
    }

    /// The entry of tensor `name`, its dtype and its numel (validated).
    pub(crate) fn tensor(&self, name: &str) -> Option<(&TensorEntry, DType)> {
        let t = self.tensors.get(name)?;
        Some((t, t.dtype.parse::<DType>().ok()?))
    }

    pub(crate) fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }
}
