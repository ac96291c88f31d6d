//! Verifying a checkpoint's data against its (already validated) manifest: every data file is
//! a regular file of the listed size and crc32c, its safetensors header parses, and every piece
//! the manifest puts in it is there at the global region the file's own header records (so
//! the file's checksum covers where its pieces go), with the listed dtype, shape and crc32c,
//! holding only finite values. Every rank verifies every file before it loads anything, so all ranks reach
//! the same verdict and no parameter is changed by a load that then fails.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use oxiflow_collectives::DType;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

use crate::{Result, TensorError};

use super::manifest::{show_region, Manifest, PieceEntry};
use super::paths::io_err;
use super::pieces::{first_non_finite, st_dtype};

pub(crate) fn bad(path: &Path, detail: impl Into<String>) -> TensorError {
    TensorError::Checkpoint {
        op: "checkpoint load",
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

/// Reads a regular file (never through a symlink), refusing ones over `limit` bytes.
pub(crate) fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>> {
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

/// The bytes of data file `name` of the checkpoint in `dir`, checked against the manifest's
/// size and crc32c.
pub(crate) fn checked_file(dir: &Path, manifest: &Manifest, name: &str) -> Result<Vec<u8>> {
    let path = dir.join(name);
    let entry = manifest
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
    Ok(bytes)
}

/// A parsed data file: its tensors and the global region the file records for each.
pub(crate) struct DataFile<'a> {
    st: SafeTensors<'a>,
    regions: BTreeMap<String, String>,
}

/// The safetensors header entry holding a data file's piece regions: a JSON object from
/// tensor name to region (as `show_region` prints it).
pub(crate) const REGIONS_KEY: &str = "oxiflow.regions";

/// The saved piece of tensor `name` in a parsed data file, its region (as the file records
/// it), dtype, shape and crc32c checked.
pub(crate) fn piece_view<'a>(
    file: &DataFile<'a>,
    path: &Path,
    name: &str,
    piece: &PieceEntry,
    dtype: DType,
) -> Result<TensorView<'a>> {
    let region = piece.ranges();
    let recorded = file.regions.get(name).map_or("none", String::as_str);
    if recorded != show_region(&region) {
        return Err(bad(
            path,
            format!(
                "{name}: the manifest puts the piece of this file at {}, the file records {recorded}",
                show_region(&region)
            ),
        ));
    }
    let st = &file.st;
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
                show_region(&region),
                piece.crc32c
            ),
        ));
    }
    Ok(view)
}

/// Parses the safetensors header of a data file.
pub(crate) fn parse_file<'a>(bytes: &'a [u8], path: &Path) -> Result<DataFile<'a>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(path, e.to_string()))?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| bad(path, e.to_string()))?;
    let record = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(REGIONS_KEY))
        .ok_or_else(|| bad(path, "the file records no piece regions"))?;
    let regions = serde_json::from_str(record).map_err(|e| {
        bad(
            path,
            format!("the file's piece regions are unreadable: {e}"),
        )
    })?;
    Ok(DataFile { st, regions })
}

/// Verifies every file and piece of the checkpoint in `dir` (see the module docs), reading one
/// file at a time.
pub(crate) fn verify(dir: &Path, manifest: &Manifest) -> Result<()> {
    let mut by_file: HashMap<&str, Vec<(&str, &PieceEntry, DType)>> = HashMap::new();
    for name in manifest.tensors.keys() {
        let (entry, dtype) = manifest
            .tensor(name)
            .ok_or_else(|| bad(dir, format!("{name}: unknown dtype")))?;
        for p in &entry.pieces {
            by_file
                .entry(p.file.as_str())
                .or_default()
                .push((name.as_str(), p, dtype));
        }
    }
    for f in &manifest.files {
        let path = dir.join(&f.name);
        let bytes = checked_file(dir, manifest, &f.name)?;
        let file = parse_file(&bytes, &path)?;
        for (name, piece, dtype) in by_file.get(f.name.as_str()).into_iter().flatten() {
            let view = piece_view(&file, &path, name, piece, *dtype)?;
            if let Some((i, v)) = first_non_finite(*dtype, view.data()) {
                return Err(bad(
                    &path,
                    format!(
                        "{name}: piece {} holds a non-finite value ({v}) at element {i}; \
                         refusing to load it",
                        show_region(&piece.ranges())
                    ),
                ));
            }
        }
    }
    Ok(())
}
