//! `HfCheckpoint`: a Hugging Face model directory opened (its `config.json` and the headers
//! of its weights), matched against a decoder's parameters (`plan`: every name, shape and
//! dtype checked, the same on every rank, before anything is read) and read into them
//! (`load_into`: each rank copies the regions its layout holds out of the mapped files; no
//! communication).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use oxiflow_sbp::Region;
use oxiflow_tensor::{Storage, Tensor};

use crate::nn::Parameter;

use super::config::HfConfig;
use super::error::{HfError, HfResult};
use super::files::HfWeights;
use super::names::{NameMap, Source, Take};

/// A model directory: its configuration and weights (see the module docs).
pub struct HfCheckpoint {
    pub dir: PathBuf,
    pub config: HfConfig,
    pub weights: HfWeights,
}

impl HfCheckpoint {
    /// Reads `dir/config.json` and maps the weights' files, parsing their headers.
    pub fn open(dir: &Path) -> HfResult<HfCheckpoint> {
        Ok(HfCheckpoint {
            dir: dir.to_path_buf(),
            config: HfConfig::read(dir)?,
            weights: HfWeights::open(dir)?,
        })
    }

    /// The names of this checkpoint's family.
    pub fn names(&self) -> NameMap {
        NameMap::new(self.config.family, self.config.vocab, |n| {
            self.weights.has(n)
        })
    }

    /// The source tensors of each parameter (one, or one per expert of stacked expert
    /// matrices; names and global shapes, as
    /// `Gpt::parameter_shapes` gives them), checked: every parameter has one of the shape it
    /// needs in a float dtype, and every stored tensor is some parameter's (or a buffer
    /// transformers also leaves unread). Errors name the file and the tensors. Reads headers
    /// only.
    pub fn plan(&self, params: &[(String, Vec<usize>)]) -> HfResult<Vec<Vec<Source>>> {
        let names = self.names();
        let at = &self.weights.source;
        let mut sources = Vec::with_capacity(params.len());
        for (name, shape) in params {
            let src = names.sources(name, shape).ok_or_else(|| HfError::Model {
                path: at.clone(),
                detail: format!(
                    "parameter {name} has no tensor in a {} checkpoint",
                    self.config.family.architecture()
                ),
            })?;
            sources.push(src);
        }
        let missing: Vec<String> = sources
            .iter()
            .flatten()
            .map(|s| s.name.clone())
            .filter(|n| !self.weights.has(n))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if !missing.is_empty() {
            return Err(HfError::Missing {
                path: at.clone(),
                tensors: missing,
            });
        }
        let used: BTreeSet<&str> = sources.iter().flatten().map(|s| s.name.as_str()).collect();
        let tied = self.config.arch.tie_embeddings;
        let unexpected: Vec<String> = self
            .weights
            .names()
            .filter(|n| !used.contains(n) && !names.ignorable(n, tied))
            .map(str::to_string)
            .collect();
        if !unexpected.is_empty() {
            return Err(HfError::Unexpected {
                path: at.clone(),
                tensors: unexpected,
            });
        }
        let each = params
            .iter()
            .zip(&sources)
            .flat_map(|((_, shape), srcs)| srcs.iter().map(move |src| (shape, src)));
        for (shape, src) in each {
            let Some(stored) = self.weights.stored(&src.name) else {
                continue;
            };
            if stored.dtype.is_none() {
                return Err(HfError::DType {
                    path: stored.path.to_path_buf(),
                    tensor: src.name.clone(),
                    dtype: stored.dtype_name,
                });
            }
            let want = src.take.stored_shape(shape);
            if stored.shape != want {
                return Err(HfError::Shape {
                    path: stored.path.to_path_buf(),
                    tensor: src.name.clone(),
                    found: stored.shape,
                    expected: want,
                });
            }
        }
        Ok(sources)
    }

    /// Reads every parameter's value from the checkpoint (after `plan`'s checks): each rank
    /// the region its layout holds, in the parameter's dtype. No communication; nothing is
    /// changed unless every value was read.
    pub fn load_into(&self, params: &[Parameter]) -> HfResult<()> {
        let shapes: Vec<(String, Vec<usize>)> = params
            .iter()
            .map(|p| (p.name().to_string(), p.value().shape().dims().to_vec()))
            .collect();
        let sources = self.plan(&shapes)?;
        let mut values = Vec::with_capacity(params.len());
        for (p, srcs) in params.iter().zip(&sources) {
            let like = p.value();
            let shape = like.shape().dims().to_vec();
            let piece = match (region_of(&like), &srcs[..]) {
                (None, _) => None,
                (Some(region), [src]) if !matches!(src.take, Take::Expert { .. }) => {
                    Some(Storage::Cpu(self.weights.read_region(
                        &src.name,
                        src.take,
                        &shape,
                        &region,
                        like.dtype(),
                    )?))
                }
                (Some(region), _) => {
                    let names: Vec<String> = srcs.iter().map(|s| s.name.clone()).collect();
                    Some(Storage::Cpu(self.weights.read_experts(
                        &names,
                        &shape,
                        &region,
                        like.dtype(),
                    )?))
                }
            };
            values.push(Tensor::with_layout_of(&like, piece)?);
        }
        for (p, v) in params.iter().zip(&values) {
            p.set_value(v)?;
        }
        Ok(())
    }
}

/// The global region of `t` this rank holds (None: the rank is outside its placement).
fn region_of(t: &Tensor) -> Option<Region> {
    match (t.layout(), t.context()) {
        (Some(l), Some(ctx)) => {
            let c = l.placement().coord_of(ctx.rank())?;
            Some(l.region_at(&c))
        }
        _ => Some(t.shape().dims().iter().map(|&n| 0..n).collect()),
    }
}
