//! `HfWeights`: the safetensors files of a Hugging Face model directory (`model.safetensors`,
//! or the shards `model.safetensors.index.json` names), memory-mapped, their headers parsed
//! by the safetensors crate; a rank copies out only the byte ranges of the regions its
//! parameters hold (`read_region`), converting the stored dtype (F32, F64, BF16, F16) as it
//! goes, so no rank reads or holds a whole tensor it splits.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use ndarray::{ArrayD, IxDyn};
use oxiflow_dtype::{with_element, DType, Element};
use oxiflow_tensor::{CpuArray, TensorElement};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensors;
use serde_json::Value;

use super::error::{HfError, HfResult};
use super::names::Take;

/// The single-file weights' name.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One mapped safetensors file and its header.
struct WeightFile {
    path: PathBuf,
    map: Mmap,
    /// Where the tensors' data begins (after the 8-byte length and the header).
    data_start: usize,
    meta: Metadata,
}

/// A stored tensor: its file, dtype and shape.
#[derive(Clone, Debug)]
pub struct Stored<'a> {
    pub path: &'a Path,
    pub dtype: Option<DType>,
    /// The safetensors dtype name (for messages).
    pub dtype_name: String,
    pub shape: Vec<usize>,
}

/// The weights of a model directory (see the module docs).
pub struct HfWeights {
    /// `model.safetensors`, or the index of the shards.
    pub source: PathBuf,
    files: Vec<WeightFile>,
    /// Every tensor's file (an index into `files`), by name, in name order.
    by_name: BTreeMap<String, usize>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn format_err(path: &Path, detail: String) -> HfError {
    HfError::Format {
        path: path.to_path_buf(),
        detail,
    }
}

impl WeightFile {
    fn open(path: &Path) -> HfResult<WeightFile> {
        let file = File::open(path).map_err(io(path))?;
        let meta = file.metadata().map_err(io(path))?;
        if !meta.is_file() {
            return Err(format_err(path, "not a regular file".into()));
        }
        // SAFETY: the map is read-only and private to this process; a weights file rewritten
        // or truncated by another process while mapped is outside this program's contract (as
        // for every reader of memory-mapped data); the header's offsets are checked against
        // the map's length by the safetensors crate before any tensor is read.
        let map = unsafe { Mmap::map(&file) }.map_err(io(path))?;
        let (n, meta) = SafeTensors::read_metadata(&map)
            .map_err(|e| format_err(path, format!("not a safetensors file: {e:?}")))?;
        Ok(WeightFile {
            path: path.to_path_buf(),
            map,
            data_start: 8 + n,
            meta,
        })
    }

    fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.meta.info(name)
    }
}

impl HfWeights {
    /// The weights of `dir`: the index's shards when `model.safetensors.index.json` exists
    /// (every file it names must exist and hold the tensors it lists), else
    /// `model.safetensors`.
    pub fn open(dir: &Path) -> HfResult<HfWeights> {
        let index = dir.join(INDEX_FILE);
        if index.exists() {
            return HfWeights::open_index(dir, &index);
        }
        let single = dir.join(WEIGHTS_FILE);
        if !single.exists() {
            return Err(format_err(
                dir,
                format!("holds neither {WEIGHTS_FILE} nor {INDEX_FILE}"),
            ));
        }
        let file = WeightFile::open(&single)?;
        let by_name = file.meta.tensors().into_keys().map(|n| (n, 0)).collect();
        Ok(HfWeights {
            source: single,
            files: vec![file],
            by_name,
        })
    }

    fn open_index(dir: &Path, index: &Path) -> HfResult<HfWeights> {
        let text = std::fs::read_to_string(index).map_err(io(index))?;
        let value: Value =
            serde_json::from_str(&text).map_err(|e| format_err(index, format!("not JSON: {e}")))?;
        let Some(Value::Object(map)) = value.get("weight_map") else {
            return Err(format_err(index, "no weight_map object".into()));
        };
        let mut files: Vec<WeightFile> = Vec::new();
        let mut opened: HashMap<String, usize> = HashMap::new();
        let mut by_name = BTreeMap::new();
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(format_err(
                    index,
                    format!("weight_map names {file} for {tensor}, not a file name"),
                ));
            };
            let plain = Path::new(file).components().count() == 1
                && Path::new(file).file_name().is_some_and(|f| f == file);
            if !plain {
                return Err(format_err(
                    index,
                    format!("weight_map names {file:?} for {tensor}: not a file of the directory"),
                ));
            }
            let at = match opened.get(file) {
                Some(&i) => i,
                None => {
                    let path = dir.join(file);
                    if !path.exists() {
                        return Err(HfError::IndexMissingFile {
                            index: index.to_path_buf(),
                            file: file.to_string(),
                            tensor: tensor.clone(),
                        });
                    }
                    files.push(WeightFile::open(&path)?);
                    opened.insert(file.to_string(), files.len() - 1);
                    files.len() - 1
                }
            };
            if files[at].info(tensor).is_none() {
                return Err(format_err(
                    &files[at].path,
                    format!(
                        "{} lists tensor {tensor} in this file, which does not hold it",
                        index.display()
                    ),
                ));
            }
            by_name.insert(tensor.clone(), at);
        }
        for f in &files {
            let unlisted: Vec<String> = f
                .meta
                .tensors()
                .into_keys()
                .filter(|n| !by_name.contains_key(n))
                .collect();
            if !unlisted.is_empty() {
                return Err(format_err(
                    &f.path,
                    format!(
                        "holds tensors {unlisted:?} that {} does not list",
                        index.display()
                    ),
                ));
            }
        }
        Ok(HfWeights {
            source: index.to_path_buf(),
            files,
            by_name,
        })
    }

    /// Every stored tensor's name, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// Whether a tensor `name` is stored.
    pub fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The stored tensor `name`.
    pub fn stored(&self, name: &str) -> Option<Stored<'_>> {
        let f = &self.files[*self.by_name.get(name)?];
        let info = f.info(name)?;
        let dtype_name = format!("{:?}", info.dtype);
        Some(Stored {
            path: &f.path,
            dtype: DType::from_safetensors_name(&dtype_name).filter(|d| d.is_float()),
            dtype_name,
            shape: info.shape.clone(),
        })
    }

    /// The region `region` of a parameter of `shape` and dtype `dtype` from stored tensor
    /// `name` taken as `take` (its shape and dtype already checked), as a host array: only the
    /// region's bytes of the mapped file are read.
    pub fn read_region(
        &self,
        name: &str,
        take: Take,
        shape: &[usize],
        region: &[Range<usize>],
        dtype: DType,
    ) -> HfResult<CpuArray> {
        let values = self.region_values(name, take, shape, region)?;
        self.host_array(values, region, dtype)
    }

    /// The region `region` of a stacked `[experts, a, b]` parameter of dtype `dtype` from its
    /// experts' tensors `names` (one per expert, each stored `[b, a]`): only the tensors of the
    /// region's experts are read.
    pub fn read_experts(
        &self,
        names: &[String],
        shape: &[usize],
        region: &[Range<usize>],
        dtype: DType,
    ) -> HfResult<CpuArray> {
        let (Some(experts), Some(matrix), Some(inner)) =
            (region.first(), shape.get(1..), region.get(1..))
        else {
            return Err(format_err(
                &self.source,
                format!("region {region:?} of stacked experts {shape:?}"),
            ));
        };
        let mut values = Vec::new();
        for e in experts.clone() {
            let name = names.get(e).ok_or_else(|| {
                format_err(
                    &self.source,
                    format!("no tensor of expert {e} in {names:?}"),
                )
            })?;
            values.extend(self.region_values(name, Take::Transposed, matrix, inner)?);
        }
        self.host_array(values, region, dtype)
    }

    /// The values of `region` (see [`HfWeights::read_region`]) in f64.
    fn region_values(
        &self,
        name: &str,
        take: Take,
        shape: &[usize],
        region: &[Range<usize>],
    ) -> HfResult<Vec<f64>> {
        let Some((f, info)) = self
            .by_name
            .get(name)
            .and_then(|&i| Some((&self.files[i], self.files[i].info(name)?)))
        else {
            return Err(format_err(&self.source, format!("no tensor {name}")));
        };
        let (s, e) = info.data_offsets;
        let data = f
            .map
            .get(f.data_start + s..f.data_start + e)
            .ok_or_else(|| format_err(&f.path, format!("tensor {name}: data out of the file")))?;
        let src_name = format!("{:?}", info.dtype);
        let Some(src) = DType::from_safetensors_name(&src_name).filter(|d| d.is_float()) else {
            return Err(HfError::DType {
                path: f.path.clone(),
                tensor: name.to_string(),
                dtype: src_name,
            });
        };
        let values =
            with_element!(src, S => copy_region::<S>(data, take, shape, &info.shape, region));
        values.ok_or_else(|| {
            format_err(
                &f.path,
                format!(
                    "tensor {name} {:?} does not hold region {region:?} of a parameter {shape:?} \
                     taken as {take:?}",
                    info.shape
                ),
            )
        })
    }

    /// `values` of `region` as a host array of `dtype`.
    fn host_array(
        &self,
        values: Vec<f64>,
        region: &[Range<usize>],
        dtype: DType,
    ) -> HfResult<CpuArray> {
        let local: Vec<usize> = region.iter().map(|r| r.len()).collect();
        with_element!(dtype, T => {
            let v: Vec<T> = values.iter().map(|&x| T::from_f64(x)).collect();
            ArrayD::from_shape_vec(IxDyn(&local), v)
                .map(TensorElement::wrap)
                .map_err(|e| format_err(&self.source, format!("region {region:?}: {e}")))
        })
    }
}

/// The values of `region` of a parameter of `shape` from a stored tensor of `stored` shape and
/// element type `S` (`data`: its bytes), taken as `take`, in f64 (exact for every float
/// type); None when a range falls outside the stored tensor.
fn copy_region<S: Element>(
    data: &[u8],
    take: Take,
    shape: &[usize],
    stored: &[usize],
    region: &[Range<usize>],
) -> Option<Vec<f64>> {
    let es = std::mem::size_of::<S>();
    let run = |first: usize, n: usize, out: &mut Vec<f64>| -> Option<()> {
        let bytes = data.get(first * es..(first + n) * es)?;
        out.extend(
            bytes
                .chunks_exact(es)
                .map(|c| bytemuck::pod_read_unaligned::<S>(c).to_f64()),
        );
        Some(())
    };
    let n: usize = region.iter().map(|r| r.len()).product();
    let mut out = Vec::with_capacity(n);
    match (take, region) {
        (Take::Part { index, .. }, [r]) => run(index * shape[0] + r.start, r.len(), &mut out)?,
        (_, [r]) => run(r.start, r.len(), &mut out)?,
        (Take::Transposed, [r0, r1]) => {
            // Stored [b, a]: the parameter's column j is stored row j.
            let width = *stored.get(1)?;
            let mut cols = Vec::with_capacity(r0.len() * r1.len());
            for j in r1.clone() {
                run(j * width + r0.start, r0.len(), &mut cols)?;
            }
            let (h, w) = (r0.len(), r1.len());
            out.resize(h * w, 0.0);
            for (lj, col) in cols.chunks_exact(h.max(1)).enumerate().take(w) {
                for (li, &v) in col.iter().enumerate() {
                    out[li * w + lj] = v;
                }
            }
        }
        (_, [r0, r1]) => {
            let width = *stored.get(1)?;
            let (rows, offset) = match take {
                Take::Table { vocab } => (vocab, 0),
                Take::Part { index, .. } => (stored[0], index * shape.get(1)?),
                _ => (stored[0], 0),
            };
            for i in r0.clone() {
                if i < rows {
                    run(i * width + offset + r1.start, r1.len(), &mut out)?;
                } else {
                    out.extend(std::iter::repeat_n(0.0, r1.len()));
                }
            }
        }
        _ => return None,
    }
    (out.len() == n).then_some(out)
}
