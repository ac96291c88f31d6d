//! Saving: which rank writes which piece, the per-rank safetensors files, the manifest, and the
//! atomic publish under the save lock (every rank calls; after each phase the ranks agree on
//! whether any of them failed, so all succeed or all fail, and a failed save leaves no
//! `.partial` behind).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{NdSbp, Region, Sbp, Shape};
use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};

use crate::nn::Parameter;
use crate::optim::Optimizer;
use crate::Result;
use oxiflow_tensor::no_grad;
use oxiflow_tensor::Context;
use oxiflow_tensor::CpuArray;
use oxiflow_tensor::Tensor;
use oxiflow_tensor::TensorError;

use super::atomic::{
    check_save_target, fresh_partial, publish, recover, remove_partial, write_file,
};
use super::layout::{file_name, pieces_of, LayoutEntry};
use super::lock::{SaveLock, DEFAULT_LOCK_WAIT};
use super::manifest::{
    show_region, FileEntry, Manifest, OptimizerEntry, PieceEntry, TensorEntry, FORMAT, MANIFEST,
    VERSION,
};
use super::paths::{io_err, sibling};
use super::pieces::{st_dtype, to_bytes};
use super::verify::REGIONS_KEY;
use super::{optim_key, Metadata, SaveOptions, SaveStage};

/// The pieces of `t` (the layout record, and per piece the writer and region) and, for the
/// ones this rank writes, their data.
struct Planned {
    layout: Option<LayoutEntry>,
    pieces: Vec<(usize, Region)>,
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

fn plan_tensor(
    path: &Path,
    t: &Tensor,
    rank: usize,
    opts: &SaveOptions,
    mine: &mut Vec<CpuArray>,
) -> Result<Planned> {
    let whole = |writer: usize| Planned {
        layout: None,
        pieces: vec![(writer, full_region(t.shape()))],
    };
    let Some(layout) = t.layout() else {
        if rank == 0 {
            mine.push(host_piece(t)?);
        }
        return Ok(whole(0));
    };
    let placement = layout.placement().clone();
    if opts.gathered {
        let b = t.to_global(&placement, NdSbp::broadcast(placement.ndim()))?;
        let writer = placement.ranks().first().copied().unwrap_or(0);
        if rank == writer {
            mine.push(host_piece(&b)?);
        }
        return Ok(whole(writer));
    }
    let nd = layout.nd_sbp();
    let t2 = if nd.has_partial() {
        let reduced = NdSbp::new(nd.iter().map(|s| if s.is_partial() { Sbp::B } else { s }));
        t.to_global(&placement, reduced)?
    } else {
        t.clone()
    };
    let Some(layout2) = t2.layout() else {
        return Err(io_err("checkpoint save", path, "boxing lost the layout"));
    };
    let record = LayoutEntry::of(layout2, &opts.meshes);
    let pieces =
        pieces_of(t.shape().dims(), &record).map_err(|e| io_err("checkpoint save", path, e))?;
    if pieces.iter().any(|(w, _)| *w == rank) {
        mine.push(host_piece(&t2)?);
    }
    Ok(Planned {
        layout: Some(record),
        pieces,
    })
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

/// Serializes this rank's pieces (name, global region, data) into a safetensors file, whose
/// header records each piece's region, and returns it with its checksums.
fn serialize_mine(
    path: &Path,
    mine: &[(String, Region, CpuArray)],
) -> Result<(Vec<u8>, WriterSums)> {
    let bytes: Vec<Vec<u8>> = mine.iter().map(|(_, _, a)| to_bytes(a)).collect();
    let mut views = Vec::with_capacity(bytes.len());
    let mut pieces = BTreeMap::new();
    let mut regions = BTreeMap::new();
    for ((name, region, a), b) in mine.iter().zip(&bytes) {
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
        regions.insert(name.clone(), show_region(region));
    }
    // One header entry, so the file's bytes do not depend on a hash map's order.
    let record = serde_json::to_string(&regions).map_err(|e| io_err("checkpoint save", path, e))?;
    let header = HashMap::from([(REGIONS_KEY.to_string(), record)]);
    let file = safetensors::tensor::serialize(views, &Some(header))
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

/// Every rank learns whether any rank's step failed (`mine` on each rank) and the failing
/// rank's message: a failing rank returns its own error, the others one naming it. Without a
/// world (local tensors) it is `mine`. The flags and the message travel as global tensors on
/// the world's ranks of `device` (the saved tensors' device: an NCCL world takes device
/// buffers only).
fn agree(site: Option<&SaveSite>, path: &Path, step: &str, mine: Result<()>) -> Result<()> {
    let Some(site) = site else {
        return mine;
    };
    let fail = |e: TensorError| io_err("checkpoint save", path, format!("agreeing on {step}: {e}"));
    let (rank, size) = (site.ctx.rank(), site.ctx.world_size());
    let world = Placement::range(site.device, size).map_err(|e| {
        io_err(
            "checkpoint save",
            path,
            format!("the world's placement: {e}"),
        )
    })?;
    // Each rank's row of a partial sum: its flag, then its message where it failed; summed,
    // every row is its rank's.
    let words = AGREE_MESSAGE_BYTES / 8;
    let gathered = |row: Vec<i64>, width: usize| -> std::result::Result<Vec<i64>, TensorError> {
        let mut all = vec![0i64; size * width];
        all[rank * width..(rank + 1) * width].copy_from_slice(&row);
        Tensor::from_vec(all, [size, width])?
            .to_global(&world, NdSbp::new([Sbp::P]))?
            .to_global(&world, NdSbp::broadcast(1))?
            .to_vec::<i64>()
    };
    let flags = gathered(vec![i64::from(mine.is_err())], 1).map_err(fail)?;
    let Some(root) = flags.iter().position(|&f| f != 0) else {
        return Ok(());
    };
    let mut msg = vec![0u8; AGREE_MESSAGE_BYTES];
    if let (Err(e), true) = (&mine, rank == root) {
        let text = e.to_string();
        let n = text.len().min(msg.len());
        msg[..n].copy_from_slice(&text.as_bytes()[..n]);
    }
    let row: Vec<i64> = msg
        .chunks_exact(8)
        .map(|w| i64::from_le_bytes(w.try_into().unwrap_or_default()))
        .collect();
    let all = gathered(row, words).map_err(fail)?;
    mine?;
    let text: Vec<u8> = all[root * words..(root + 1) * words]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    Err(io_err(
        "checkpoint save",
        path,
        format!(
            "rank {root} failed {step}: {}",
            String::from_utf8_lossy(&text[..end])
        ),
    ))
}

/// Where a save's ranks agree: the world and the device of the saved tensors.
struct SaveSite {
    ctx: Context,
    device: DeviceType,
}

/// The longest failure message one rank tells the others (a multiple of 8 bytes).
const AGREE_MESSAGE_BYTES: usize = 1024;

/// Saves named tensors (local or global) and metadata as a checkpoint directory at `path`.
/// Every rank of the world must call it with the same names and layouts. `optimizer` records
/// the optimizer state among `tensors`. A failure on any rank fails the save on every rank and
/// removes `<path>.partial`.
pub(crate) fn save_with_state(
    path: &Path,
    tensors: &[(String, Tensor)],
    optimizer: Option<OptimizerEntry>,
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
    let device = tensors
        .iter()
        .find_map(|(_, t)| t.placement().map(Placement::device))
        .unwrap_or(DeviceType::Cpu);
    let site = ctx.clone().map(|ctx| SaveSite { ctx, device });
    // Every rank checks the target before rank 0 changes anything next to it (recover,
    // fresh_partial): agreeing keeps a rank's check from seeing rank 0's new `.partial`.
    agree(
        site.as_ref(),
        path,
        "checking the target",
        check_save_target(path),
    )?;
    let hook = |s: SaveStage| {
        if let Some(h) = opts.stage_hook {
            h(s)
        }
    };
    // Plan every tensor (collective boxing of partial sums / gathers happens here).
    let mut mine: Vec<(String, Region, CpuArray)> = Vec::new();
    let mut entries = BTreeMap::new();
    let mut writers: Vec<usize> = Vec::new();
    for (name, t) in tensors {
        let mut data = Vec::new();
        let planned = plan_tensor(path, t, rank, opts, &mut data)?;
        if let (Some(a), Some((_, region))) =
            (data.pop(), planned.pieces.iter().find(|(w, _)| *w == rank))
        {
            mine.push((name.clone(), region.clone(), a));
        }
        let pieces: Vec<PieceEntry> = planned
            .pieces
            .iter()
            .map(|(writer, region)| {
                if !writers.contains(writer) {
                    writers.push(*writer);
                }
                PieceEntry {
                    file: file_name(*writer),
                    region: region.iter().map(|r| [r.start, r.end]).collect(),
                    crc32c: 0,
                }
            })
            .collect();
        entries.insert(
            name.clone(),
            TensorEntry {
                shape: t.shape().dims().to_vec(),
                dtype: t.dtype().as_str().into(),
                layout: planned.layout,
                pieces,
            },
        );
    }
    writers.sort_unstable();
    let mut manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        manifest_crc32c: 0,
        files: Vec::with_capacity(writers.len()),
        metadata: metadata.clone(),
        tensors: entries,
        optimizer,
    };
    // Rank 0 holds the lock of `path` until the save is published or cleaned up.
    let mut lock = None;
    let prepared = if rank == 0 {
        SaveLock::acquire(path, opts.lock_wait.unwrap_or(DEFAULT_LOCK_WAIT)).and_then(|l| {
            lock = Some(l);
            recover(path)?;
            fresh_partial(path).map(|_| ())
        })
    } else {
        Ok(())
    };
    let partial = sibling(path, ".partial");
    let saved = agree(site.as_ref(), path, "preparing <path>.partial", prepared)
        .and_then(|()| {
            let written = if mine.is_empty() {
                Ok(())
            } else {
                write_mine(path, &partial, rank, &mine, &hook)
            };
            agree(site.as_ref(), path, "writing its checkpoint file", written)
        })
        .and_then(|()| {
            let done = if rank == 0 {
                publish_manifest(path, &partial, &writers, &mut manifest, &hook)
            } else {
                Ok(())
            };
            agree(site.as_ref(), path, "publishing the checkpoint", done)
        });
    if saved.is_err() {
        // Only the holder of the lock may remove `.partial`: without it, it is another save's.
        if lock.is_some() {
            remove_partial(path);
        }
        // Every rank knows the save failed; none returns (and exits, which would have a
        // launcher stop the others) before `.partial` is gone.
        if let Some(c) = &ctx {
            let _ = c.world().barrier();
        }
    }
    drop(lock);
    saved
}

/// Writes this rank's checksums and data file into `partial`.
fn write_mine(
    path: &Path,
    partial: &Path,
    rank: usize,
    mine: &[(String, Region, CpuArray)],
    hook: &dyn Fn(SaveStage),
) -> Result<()> {
    let (bytes, sums) = serialize_mine(path, mine)?;
    let sums_text = serde_json::to_vec(&sums).map_err(|e| io_err("checkpoint save", path, e))?;
    write_file(&partial.join(sums_name(rank)), &sums_text, &|_| {})?;
    write_file(&partial.join(file_name(rank)), &bytes, hook)
}

/// Rank 0: moves the writers' checksums into the manifest, seals and writes it, publishes.
fn publish_manifest(
    path: &Path,
    partial: &Path,
    writers: &[usize],
    manifest: &mut Manifest,
    hook: &dyn Fn(SaveStage),
) -> Result<()> {
    for &w in writers {
        collect_sums(partial, w, manifest)?;
    }
    manifest
        .validate()
        .and_then(|()| manifest.seal())
        .map_err(|e| io_err("checkpoint save", path, e))?;
    let text =
        serde_json::to_vec_pretty(manifest).map_err(|e| io_err("checkpoint save", path, e))?;
    write_file(&partial.join(MANIFEST), &text, &|_| {})?;
    publish(path, hook)
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
    save_with_state(path, tensors, None, metadata, opts)
}

/// Saves parameters (by name) and, optionally, an optimizer's state: every (parameter, slot)
/// as the tensor `optim/<param>/<slot>`, or recorded as never initialised, with the step count.
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
    let optimizer = optim.map(|o| {
        let mut empty = Vec::new();
        for (i, p) in o.params().iter().enumerate() {
            for slot in o.slot_names() {
                let key = optim_key(p.name(), slot);
                match o.state(i, slot) {
                    Some(t) => tensors.push((key, t)),
                    None => empty.push(key),
                }
            }
        }
        OptimizerEntry {
            step_count: o.step_count(),
            slots: o.slot_names().iter().map(|s| s.to_string()).collect(),
            params: o.params().iter().map(|p| p.name().to_string()).collect(),
            empty,
        }
    });
    save_with_state(path, &tensors, optimizer, metadata, opts)
}
