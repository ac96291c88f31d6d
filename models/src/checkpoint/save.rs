//! Saving: which rank writes which piece, the per-rank safetensors files, the manifest, and the
//! atomic publish (every rank calls; barriers order the phases).

use std::collections::BTreeMap;
use std::path::Path;

use oxiflow_sbp::{NdSbp, Region, Sbp, Shape};
use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};

use crate::nn::Parameter;
use crate::optim::Optimizer;
use crate::{Result, TensorError};
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Context;
use oxiflow_tensor::CpuArray;
use oxiflow_tensor::Tensor;

use super::atomic::{
    check_save_target, fresh_partial, io_err, publish, recover, sibling, write_file, MANIFEST,
};
use super::manifest::{FileEntry, Manifest, PieceEntry, TensorEntry, FORMAT, VERSION};
use super::pieces::{st_dtype, to_bytes};
use super::{optim_key, Metadata, SaveOptions, SaveStage};

/// One saved piece: the writing rank and the global region it covers.
struct PieceInfo {
    writer: usize,
    region: Region,
}

fn file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn full_region(shape: &Shape) -> Region {
    shape.dims().iter().map(|&n| 0..n).collect()
}

fn host_piece(t: &Tensor) -> Result<CpuArray> {
    match t.storage() {
        Some(s) => Ok(s.to_host()?.into_standard()),
        None => Ok(CpuArray::zeros(t.dtype(), t.local_shape().dims())),
    }
}

/// The pieces of `t` and, for the ones this rank writes, their data.
fn plan_tensor(
    t: &Tensor,
    rank: usize,
    gathered: bool,
    mine: &mut Vec<CpuArray>,
) -> Result<Vec<PieceInfo>> {
    let Some(layout) = t.layout() else {
        if rank == 0 {
            mine.push(host_piece(t)?);
        }
        return Ok(vec![PieceInfo {
            writer: 0,
            region: full_region(t.shape()),
        }]);
    };
    let placement = layout.placement().clone();
    if gathered {
        let b = t.to_global(&placement, NdSbp::broadcast(placement.ndim()))?;
        let writer = placement.ranks().first().copied().unwrap_or(0);
        if rank == writer {
            mine.push(host_piece(&b)?);
        }
        return Ok(vec![PieceInfo {
            writer,
            region: full_region(t.shape()),
        }]);
    }
    let nd = layout.nd_sbp();
    let t2 = if nd.has_partial() {
        let reduced = NdSbp::new(nd.iter().map(|s| if s.is_partial() { Sbp::B } else { s }));
        t.to_global(&placement, reduced)?
    } else {
        t.clone()
    };
    let Some(layout2) = t2.layout() else {
        return Err(TensorError::Kernel {
            op: "checkpoint save",
            detail: "boxing lost the layout".into(),
        });
    };
    let sbps: Vec<Sbp> = layout2.nd_sbp().iter().collect();
    let mut out = Vec::new();
    for (idx, &r) in placement.ranks().iter().enumerate() {
        let coord = placement.coord_of_index(idx);
        if sbps
            .iter()
            .zip(&coord)
            .any(|(s, &c)| s.is_broadcast() && c != 0)
        {
            continue;
        }
        let region = layout2.region_at(&coord);
        if region.iter().any(|x| x.is_empty()) && !region.is_empty() {
            continue;
        }
        if r == rank {
            mine.push(host_piece(&t2)?);
        }
        out.push(PieceInfo { writer: r, region });
    }
    Ok(out)
}

/// What a writing rank leaves beside its data file for rank 0: the file's size and checksum
/// and each piece's checksum (rank 0 moves them into the manifest and removes this file).
#[derive(Serialize, Deserialize)]
struct WriterSums {
    bytes: u64,
    crc32c: u32,
    pieces: BTreeMap<String, u32>,
}

fn sums_name(rank: usize) -> String {
    format!("rank-{rank:05}.sums.json")
}

/// Serializes this rank's pieces into a safetensors file and returns it with its checksums.
fn serialize_mine(
    path: &Path,
    names: &[String],
    data: &[CpuArray],
) -> Result<(Vec<u8>, WriterSums)> {
    let bytes: Vec<Vec<u8>> = data.iter().map(to_bytes).collect();
    let mut views = Vec::with_capacity(bytes.len());
    let mut pieces = BTreeMap::new();
    for ((name, a), b) in names.iter().zip(data).zip(&bytes) {
        let st = st_dtype(a.dtype()).ok_or_else(|| {
            io_err(
                "checkpoint save",
                path,
                format!("{name}: safetensors has no {} dtype", a.dtype()),
            )
        })?;
        let v = TensorView::new(st, a.shape().to_vec(), b)
            .map_err(|e| io_err("checkpoint save", path, format!("{name}: {e}")))?;
        views.push((name.clone(), v));
        pieces.insert(name.clone(), crc32c::crc32c(b));
    }
    let file = safetensors::tensor::serialize(views, &None)
        .map_err(|e| io_err("checkpoint save", path, e))?;
    let sums = WriterSums {
        bytes: file.len() as u64,
        crc32c: crc32c::crc32c(&file),
        pieces,
    };
    Ok((file, sums))
}

/// Reads the checksums writer `w` left in `partial` into `manifest` and removes that file.
fn collect_sums(partial: &Path, w: usize, manifest: &mut Manifest) -> Result<()> {
    let data = partial.join(file_name(w));
    if !data.is_file() {
        return Err(io_err("checkpoint save", &data, "a rank's file is missing"));
    }
    let sums_path = partial.join(sums_name(w));
    let text = std::fs::read(&sums_path).map_err(|e| io_err("checkpoint save", &sums_path, e))?;
    let sums: WriterSums =
        serde_json::from_slice(&text).map_err(|e| io_err("checkpoint save", &sums_path, e))?;
    let name = file_name(w);
    manifest.files.push(FileEntry {
        name: name.clone(),
        bytes: sums.bytes,
        crc32c: sums.crc32c,
    });
    for (tensor, entry) in manifest.tensors.iter_mut() {
        for p in entry.pieces.iter_mut().filter(|p| p.file == name) {
            p.crc32c = *sums.pieces.get(tensor).ok_or_else(|| {
                io_err(
                    "checkpoint save",
                    &sums_path,
                    format!("no checksum for {tensor}"),
                )
            })?;
        }
    }
    std::fs::remove_file(&sums_path).map_err(|e| io_err("checkpoint save", &sums_path, e))
}

/// Saves named tensors (local or global) and metadata as a checkpoint directory at `path`.
/// Every rank of the world must call it with the same names and layouts. `optimizer_state`
/// names the tensors that hold optimizer state (a load with an optimizer requires them all).
pub(crate) fn save_with_state(
    path: &Path,
    tensors: &[(String, Tensor)],
    optimizer_state: Vec<String>,
    metadata: &Metadata,
    opts: &SaveOptions,
) -> Result<()> {
    let _ng = no_grad();
    for (i, (n, _)) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|(m, _)| m == n) {
            return Err(io_err(
                "checkpoint save",
                path,
                format!("duplicate tensor name {n}"),
            ));
        }
    }
    let ctx = tensors
        .iter()
        .find_map(|(_, t)| t.context().cloned())
        .or_else(Context::current);
    let rank = ctx.as_ref().map_or(0, Context::rank);
    let barrier = |stage: &str| -> Result<()> {
        match &ctx {
            Some(c) => c
                .world()
                .barrier()
                .map_err(|e| io_err("checkpoint save", path, format!("barrier {stage}: {e}"))),
            None => Ok(()),
        }
    };
    // Every rank checks the target before rank 0 changes anything next to it (recover,
    // fresh_partial): the barrier keeps a rank's check from seeing rank 0's new `.partial`.
    let target = check_save_target(path);
    barrier("after checking the target")?;
    target?;
    let hook = |s: SaveStage| {
        if let Some(h) = opts.stage_hook {
            h(s)
        }
    };
    // Plan every tensor (collective boxing of partial sums / gathers happens here).
    let mut mine_data: Vec<CpuArray> = Vec::new();
    let mut mine_names: Vec<String> = Vec::new();
    let mut entries = BTreeMap::new();
    let mut writers: Vec<usize> = Vec::new();
    for (name, t) in tensors {
        let before = mine_data.len();
        let pieces = plan_tensor(t, rank, opts.gathered, &mut mine_data)?;
        for _ in before..mine_data.len() {
            mine_names.push(name.clone());
        }
        let list: Vec<PieceEntry> = pieces
            .iter()
            .map(|p| {
                if !writers.contains(&p.writer) {
                    writers.push(p.writer);
                }
                PieceEntry {
                    file: file_name(p.writer),
                    region: p.region.iter().map(|r| [r.start, r.end]).collect(),
                    crc32c: 0,
                }
            })
            .collect();
        entries.insert(
            name.clone(),
            TensorEntry {
                shape: t.shape().dims().to_vec(),
                dtype: t.dtype().as_str().into(),
                pieces: list,
            },
        );
    }
    writers.sort_unstable();
    let mut manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        files: Vec::with_capacity(writers.len()),
        metadata: metadata.clone(),
        tensors: entries,
        optimizer_state,
    };
    if rank == 0 {
        recover(path)?;
        fresh_partial(path)?;
    }
    barrier("before writing")?;
    let partial = sibling(path, ".partial");
    if !mine_data.is_empty() {
        let (data, sums) = serialize_mine(path, &mine_names, &mine_data)?;
        let sums_text =
            serde_json::to_vec(&sums).map_err(|e| io_err("checkpoint save", path, e))?;
        write_file(&partial.join(sums_name(rank)), &sums_text, &|_| {})?;
        write_file(&partial.join(file_name(rank)), &data, &hook)?;
    }
    barrier("after writing")?;
    if rank == 0 {
        for &w in &writers {
            collect_sums(&partial, w, &mut manifest)?;
        }
        manifest
            .validate()
            .map_err(|e| io_err("checkpoint save", path, e))?;
        let text =
            serde_json::to_vec_pretty(&manifest).map_err(|e| io_err("checkpoint save", path, e))?;
        write_file(&partial.join(MANIFEST), &text, &|_| {})?;
        publish(path, &hook)?;
    }
    barrier("after publishing")
}

/// Saves named tensors (local or global) and metadata as a checkpoint directory at `path`.
/// Every rank of the world must call it with the same names and layouts. Refuses a `path` that
/// exists and is not a checkpoint (see `atomic`).
pub fn save_tensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &Metadata,
    opts: &SaveOptions,
) -> Result<()> {
    save_with_state(path, tensors, Vec::new(), metadata, opts)
}

/// Saves parameters (by name) and, optionally, an optimizer's state (`optim/<param>/<slot>`
/// tensors and its step count in the metadata as `optim.step_count`).
pub fn save(
    path: &Path,
    params: &[Parameter],
    optim: Option<&dyn Optimizer>,
    metadata: &Metadata,
    opts: &SaveOptions,
) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = params
        .iter()
        .map(|p| (p.name().to_string(), p.value()))
        .collect();
    let mut meta = metadata.clone();
    let mut state = Vec::new();
    if let Some(o) = optim {
        for (i, p) in o.params().iter().enumerate() {
            for slot in o.slot_names() {
                if let Some(t) = o.state(i, slot) {
                    let key = optim_key(p.name(), slot);
                    state.push(key.clone());
                    tensors.push((key, t));
                }
            }
        }
        meta.insert("optim.step_count".into(), o.step_count().to_string());
    }
    save_with_state(path, &tensors, state, &meta, opts)
}
