//! A small MLP classifier on a deterministic synthetic dataset (Gaussian clusters drawn from
//! the counter-based RNG): the model the `train` example runs and the equivalence tests check.
//!
//! Mesh `[dp, tp]`: data `(S(0), B)` (split over the data-parallel axis), fc1 column-parallel
//! and fc2 row-parallel on the tensor-parallel axis. Every value (data, initial weights) depends
//! only on the seed and the step, so every layout trains the same function.

use std::path::Path;

use oxiflow::checkpoint::{self, Metadata, SaveOptions};
use oxiflow::nn::{param_seed, Activation, Init, Mlp, Module, ParamPlacement, Parameter};
use oxiflow::optim::{AdamW, AdamWOptions, Optimizer, Sgd, SgdOptions};
use oxiflow::prelude::*;
use oxiflow::{no_grad, Result};

/// Which optimizer trains the classifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    AdamW,
}

/// Everything that defines a training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Mesh `[dp, tp]` over ranks `0..dp*tp`; None: local tensors (no communication).
    pub mesh: Option<(usize, usize)>,
    pub batch_size: usize,
    pub features: usize,
    pub classes: usize,
    pub hidden: usize,
    pub lr: f64,
    pub momentum: f64,
    pub optimizer: OptimizerKind,
    pub seed: u64,
    pub dtype: DType,
    /// Standard deviation of the noise around each class centre.
    pub noise: f64,
    /// Device type of the mesh placement (cpu, or cuda: one GPU per rank).
    pub device: DeviceType,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            mesh: None,
            batch_size: 64,
            features: 16,
            classes: 4,
            hidden: 64,
            lr: 0.05,
            momentum: 0.9,
            optimizer: OptimizerKind::Sgd,
            seed: 0,
            dtype: DType::F32,
            noise: 1.0,
            device: DeviceType::Cpu,
        }
    }
}

/// Gaussian clusters: class centres Normal(0, 1) `[classes, features]`; sample i of step s has
/// label floor(u * classes) and features centre[label] + noise * Normal(0, 1).
pub struct ClusterData {
    centers: Tensor,
    cfg: TrainConfig,
    at: Option<(Placement, NdSbp)>,
}

impl ClusterData {
    fn new(cfg: &TrainConfig, placement: Option<&Placement>) -> Result<ClusterData> {
        let shape = Shape::new([cfg.classes, cfg.features]);
        let seed = param_seed(cfg.seed, "data.centers");
        let (centers, at) = match placement {
            None => (
                Init::Normal { seed, std: 1.0 }.build(shape, cfg.dtype, &ParamPlacement::Local)?,
                None,
            ),
            Some(p) => {
                let b = NdSbp::broadcast(p.ndim());
                let at = ParamPlacement::Global {
                    placement: p.clone(),
                    nd_sbp: b,
                };
                let data_sbp = NdSbp::new([Sbp::S(0), Sbp::B]);
                (
                    Init::Normal { seed, std: 1.0 }.build(shape, cfg.dtype, &at)?,
                    Some((p.clone(), data_sbp)),
                )
            }
        };
        Ok(ClusterData {
            centers,
            cfg: cfg.clone(),
            at,
        })
    }

    /// Features `[batch, features]` and labels `[batch]` (i64) of step `step`.
    pub fn batch(&self, step: u64) -> Result<(Tensor, Tensor)> {
        let _ng = no_grad();
        let c = &self.cfg;
        let s_lab = param_seed(c.seed, &format!("data.labels.{step}"));
        let s_noise = param_seed(c.seed, &format!("data.noise.{step}"));
        let (n, f) = (c.batch_size, c.features);
        let (u, noise) = match &self.at {
            None => (
                Tensor::rand([n], s_lab, DType::F64),
                Tensor::randn([n, f], s_noise, c.dtype),
            ),
            Some((p, s)) => (
                Tensor::rand_global(
                    [n],
                    s_lab,
                    DType::F64,
                    p,
                    NdSbp::new([s.as_slice()[0], Sbp::B]),
                )?,
                Tensor::randn_global([n, f], s_noise, c.dtype, p, s.clone())?,
            ),
        };
        let labels = u.mul_scalar(c.classes as f64)?.cast(DType::I64)?;
        let x = Tensor::embedding(&labels, &self.centers)?.add(&noise.scale(c.noise)?)?;
        Ok((x, labels))
    }
}

/// A training run: model, optimizer, data and step counter.
pub struct Classifier {
    pub model: Mlp,
    pub optimizer: Box<dyn Optimizer>,
    pub data: ClusterData,
    pub step: u64,
    pub cfg: TrainConfig,
}

/// The 2-d placement `cpu:[dp, tp]` over ranks `0..dp*tp`.
pub fn mesh_placement(dp: usize, tp: usize) -> Result<Placement> {
    let ranks: Vec<usize> = (0..dp * tp).collect();
    Placement::new_1d(DeviceType::Cpu, ranks)
        .and_then(|p| p.reshaped([dp, tp]))
        .map_err(|e| TensorError::Sbp {
            op: "mesh_placement",
            shapes: "-".into(),
            sbps: "-".into(),
            placement: format!("[{dp}, {tp}]"),
            detail: e.to_string(),
        })
}

impl Classifier {
    /// Builds the model and optimizer (global runs need an installed context).
    pub fn new(cfg: &TrainConfig) -> Result<Classifier> {
        let placement = cfg
            .mesh
            .map(|(d, t)| mesh_placement(d, t).map(|p| p.with_device(cfg.device)))
            .transpose()?;
        let tp_axis = placement.as_ref().map(|_| 1);
        let model = Mlp::new(
            "mlp",
            cfg.features,
            cfg.hidden,
            cfg.classes,
            Activation::Relu,
            cfg.seed,
            cfg.dtype,
            placement.as_ref(),
            tp_axis,
        )?;
        let params = model.parameters();
        let optimizer: Box<dyn Optimizer> = match cfg.optimizer {
            OptimizerKind::Sgd => Box::new(Sgd::new(
                params,
                SgdOptions {
                    lr: cfg.lr,
                    momentum: cfg.momentum,
                    ..SgdOptions::default()
                },
            )),
            OptimizerKind::AdamW => Box::new(AdamW::new(
                params,
                AdamWOptions {
                    lr: cfg.lr,
                    ..AdamWOptions::default()
                },
            )),
        };
        let data = ClusterData::new(cfg, placement.as_ref())?;
        Ok(Classifier {
            model,
            optimizer,
            data,
            step: 0,
            cfg: cfg.clone(),
        })
    }

    pub fn parameters(&self) -> Vec<Parameter> {
        self.model.parameters()
    }

    /// Mean cross-entropy of the current step's batch (a 0-d tensor with history).
    pub fn loss(&self) -> Result<Tensor> {
        let (x, y) = self.data.batch(self.step)?;
        self.model.forward(&x)?.cross_entropy(&y)?.mean_all()
    }

    /// One step: forward, backward, update. Returns the loss (every rank gets it).
    pub fn train_step(&mut self) -> Result<f64> {
        let loss = self.loss()?;
        self.optimizer.zero_grad();
        loss.backward()?;
        self.optimizer.step()?;
        self.step += 1;
        let _ng = no_grad();
        let v = loss.cast(DType::F64)?.to_vec::<f64>()?;
        v.first().copied().ok_or_else(|| TensorError::Kernel {
            op: "train_step",
            detail: "empty loss".into(),
        })
    }

    /// Saves model, optimizer state and step (every rank calls).
    pub fn save(&self, path: &Path, opts: &SaveOptions) -> Result<()> {
        let mut meta = Metadata::new();
        meta.insert("step".into(), self.step.to_string());
        meta.insert("seed".into(), self.cfg.seed.to_string());
        checkpoint::save(
            path,
            &self.parameters(),
            Some(self.optimizer.as_ref()),
            &meta,
            opts,
        )
    }

    /// Loads a checkpoint saved under any layout into this run's layout; continues its step.
    pub fn resume(&mut self, path: &Path) -> Result<()> {
        let params = self.parameters();
        let meta = checkpoint::load(path, &params, Some(self.optimizer.as_mut()))?;
        self.step = meta.get("step").and_then(|s| s.parse().ok()).unwrap_or(0);
        Ok(())
    }
}
