//! `save_hf`: a decoder written as a Hugging Face model directory transformers loads:
//! `config.json`, the weights in safetensors shards `model-0000i-of-0000n.safetensors` of at
//! most a given size and `model.safetensors.index.json`, each tensor under its family's name
//! and layout (`names`: the inverse of loading). A collective: every rank moves each parameter
//! whole to rank 0 in turn, which alone holds and writes (a shard's tensors at a time).

use std::collections::BTreeMap;
use std::path::Path;

use oxiflow_dtype::{with_element, DType};
use oxiflow_placement::Placement;
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::{Context, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use crate::nn::Parameter;

use super::config::HfConfig;
use super::error::{HfError, HfResult};
use super::files::INDEX_FILE;
use super::names::{NameMap, Take};

/// One tensor of the checkpoint: its name, shape and the parameters it is made of (with how
/// each maps onto it).
struct Output {
    name: String,
    shape: Vec<usize>,
    parts: Vec<(usize, Take)>,
}

pub(super) fn io(path: &Path) -> impl Fn(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The checkpoint tensors of `params` under `names`, in the parameters' order.
fn outputs(params: &[Parameter], names: &NameMap, at: &Path) -> HfResult<Vec<Output>> {
    let mut out: Vec<Output> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let dims = p.value().shape().dims().to_vec();
        let srcs = names
            .sources(p.name(), &dims)
            .ok_or_else(|| HfError::Model {
                path: at.to_path_buf(),
                detail: format!("parameter {} has no Hugging Face name", p.name()),
            })?;
        for src in srcs {
            let shape = src.take.stored_shape(&dims);
            match out.iter_mut().find(|o| o.name == src.name) {
                Some(o) => o.parts.push((i, src.take)),
                None => out.push(Output {
                    name: src.name,
                    shape,
                    parts: vec![(i, src.take)],
                }),
            }
        }
    }
    Ok(out)
}

/// Writes `params` (a decoder's, in its order) with `config` to `dir` (created; it must not
/// exist or be empty), in their dtype, in shards of at most `shard_bytes` (a tensor larger
/// than that is a shard of its own). Every rank calls it alike; rank 0 writes, and its
/// outcome is every rank's.
pub fn save_hf(
    dir: &Path,
    config: &HfConfig,
    params: &[Parameter],
    shard_bytes: usize,
) -> HfResult<()> {
    let ctx = Context::current().ok_or_else(|| HfError::Model {
        path: dir.to_path_buf(),
        detail: "no runtime context".into(),
    })?;
    let lead = ctx.rank() == 0;
    let names = NameMap::new(config.family, config.vocab, |_| true);
    let outputs = outputs(params, &names, dir)?;
    let dtype = params.first().map_or(DType::F32, |p| p.value().dtype());
    let es = dtype.size();
    // Shards by bytes, in order.
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0usize;
    for (i, o) in outputs.iter().enumerate() {
        let n = o.shape.iter().product::<usize>() * es;
        match shards.last_mut() {
            Some(s) if bytes + n <= shard_bytes => {
                s.push(i);
                bytes += n;
            }
            _ => {
                shards.push(vec![i]);
                bytes = n;
            }
        }
    }
    let count = shards.len();
    let file_of = |s: usize| format!("model-{:05}-of-{count:05}.safetensors", s + 1);
    let mut written: HfResult<()> = if lead { prepare(dir) } else { Ok(()) };
    let device = params
        .first()
        .and_then(|p| p.value().placement().map(Placement::device))
        .unwrap_or(oxiflow_placement::DeviceType::Cpu);
    let root = Placement::range(device, 1).map_err(|e| HfError::Model {
        path: dir.to_path_buf(),
        detail: format!("rank 0's placement: {e}"),
    })?;
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    for (s, shard) in shards.iter().enumerate() {
        let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for &i in shard {
            let o = &outputs[i];
            let mut values = Vec::new();
            for &(p, take) in &o.parts {
                values.push((whole_on_root(&params[p].value(), &root, lead)?, take));
            }
            if lead {
                let bytes = assemble(&o.shape, &values, es);
                total += bytes.len();
                weight_map.insert(o.name.clone(), file_of(s));
                data.push((o.name.clone(), o.shape.clone(), bytes));
            }
        }
        if lead && written.is_ok() {
            written = write_shard(&dir.join(file_of(s)), dtype, &data);
        }
    }
    if lead && written.is_ok() {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        written = write_json(&dir.join(INDEX_FILE), &index).and_then(|_| {
            write_json(
                &dir.join("config.json"),
                &config.to_json(dtype.safetensors_name()),
            )
        });
    }
    agree(written, &root, lead, dir)
}

/// `dir` created, or empty.
pub(super) fn prepare(dir: &Path) -> HfResult<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut entries = std::fs::read_dir(dir).map_err(io(dir))?;
    if entries.next().is_some() {
        return Err(HfError::Format {
            path: dir.to_path_buf(),
            detail: "exists and is not empty (a Hugging Face save replaces nothing)".into(),
        });
    }
    Ok(())
}

/// `t` whole on rank 0 as little-endian bytes (empty on other ranks); every rank of its
/// placement calls it.
pub(super) fn whole_on_root(t: &Tensor, root: &Placement, lead: bool) -> HfResult<Vec<u8>> {
    let _ng = oxiflow_tensor::no_grad();
    let t = match t.placement() {
        Some(_) => t.to_global(root, NdSbp::broadcast(1))?,
        None => t.clone(),
    };
    if !lead {
        return Ok(Vec::new());
    }
    Ok(with_element!(t.dtype(), T => bytemuck::cast_slice(&t.to_vec::<T>()?).to_vec()))
}

/// The bytes of a checkpoint tensor of `shape` from its parameters' bytes (`es` per element).
pub(super) fn assemble(shape: &[usize], values: &[(Vec<u8>, Take)], es: usize) -> Vec<u8> {
    let n: usize = shape.iter().product();
    let mut out = vec![0u8; n * es];
    for (v, take) in values {
        match (*take, shape) {
            (Take::Same, _) => out.copy_from_slice(&v[..n * es]),
            (Take::Table { vocab }, [_, c]) => out.copy_from_slice(&v[..vocab * c * es]),
            (Take::Transposed, [b, a]) => transpose_into(&mut out, v, *a, *b, es),
            (Take::Expert { index }, [b, a]) => {
                let n = a * b * es;
                transpose_into(&mut out, &v[index * n..(index + 1) * n], *a, *b, es);
            }
            (Take::Part { index, parts }, [rows, width]) => {
                let part = width / parts;
                for r in 0..*rows {
                    let src = r * part * es;
                    let dst = (r * width + index * part) * es;
                    out[dst..dst + part * es].copy_from_slice(&v[src..src + part * es]);
                }
            }
            (Take::Part { index, parts }, [width]) => {
                let part = width / parts;
                let dst = index * part * es;
                out[dst..dst + part * es].copy_from_slice(&v[..part * es]);
            }
            _ => {}
        }
    }
    out
}

/// The `[a, b]` values `v` (`es` bytes each) into `out` as `[b, a]`.
fn transpose_into(out: &mut [u8], v: &[u8], a: usize, b: usize, es: usize) {
    for i in 0..a {
        for j in 0..b {
            let (src, dst) = ((i * b + j) * es, (j * a + i) * es);
            out[dst..dst + es].copy_from_slice(&v[src..src + es]);
        }
    }
}

pub(super) fn write_shard(
    path: &Path,
    dtype: DType,
    data: &[(String, Vec<usize>, Vec<u8>)],
) -> HfResult<()> {
    let st: Dtype =
        serde_json::from_value(json!(dtype.safetensors_name())).map_err(|e| HfError::Format {
            path: path.to_path_buf(),
            detail: format!("dtype {dtype}: {e}"),
        })?;
    let views = data
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(st, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| HfError::Format {
                    path: path.to_path_buf(),
                    detail: format!("tensor {name}: {e:?}"),
                })
        })
        .collect::<HfResult<Vec<_>>>()?;
    let meta = Some(
        [("format".to_string(), "pt".to_string())]
            .into_iter()
            .collect(),
    );
    let tmp = path.with_extension("safetensors.partial");
    safetensors::serialize_to_file(views, &meta, &tmp).map_err(|e| HfError::Format {
        path: tmp.clone(),
        detail: format!("{e:?}"),
    })?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

pub(super) fn write_json(path: &Path, v: &serde_json::Value) -> HfResult<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| HfError::Format {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(io(path))
}

/// Rank 0's outcome on every rank: its error as is there, and an error naming the directory
/// on the others.
pub(super) fn agree(
    written: HfResult<()>,
    root: &Placement,
    lead: bool,
    dir: &Path,
) -> HfResult<()> {
    let _ng = oxiflow_tensor::no_grad();
    let flag = Tensor::from_vec(vec![i64::from(written.is_err())], [1])?
        .to_global(root, NdSbp::broadcast(1))?;
    let world = Placement::range(
        root.device(),
        Context::current().map_or(1, |c| c.world_size()),
    )
    .map_err(|e| HfError::Model {
        path: dir.to_path_buf(),
        detail: format!("the world's placement: {e}"),
    })?;
    let failed = flag
        .to_global(&world, NdSbp::broadcast(1))?
        .to_vec::<i64>()?;
    match (written, failed.first()) {
        (Err(e), _) => Err(e),
        (Ok(()), Some(1)) if !lead => Err(HfError::Model {
            path: dir.to_path_buf(),
            detail: "rank 0 could not write the model (its error names why)".into(),
        }),
        (Ok(()), _) => Ok(()),
    }
}
