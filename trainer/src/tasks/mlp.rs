//! The MLP classifier on a deterministic synthetic dataset (Gaussian clusters drawn from the
//! counter-based RNG): `MlpClassifier` (a `TrainModel`), `ClusterData` (a `BatchSource`) and
//! `classifier`, which builds a `Trainer` of both. Mesh `[dp, tp]`: data `(S(0), B)`, fc1
//! column-parallel and fc2 row-parallel on the tensor-parallel axis; or local tensors. Every
//! value depends only on the seed and the step, so every layout trains the same function.

use oxiflow_collectives::DType;
use oxiflow_dtype::MixedPrecision;
use oxiflow_models::nn::{
    param_seed, Activation, Init, Mlp, Module, ParamPlacement, Parameter, Pass,
};
use oxiflow_models::optim::{AdamW, AdamWOptions, Optimizer, Sgd, SgdOptions};
use oxiflow_placement::{AxisRole, DeviceType, NamedMesh, Placement};
use oxiflow_sbp::{NdSbp, Sbp, Shape};
use oxiflow_tensor::{no_grad, Tensor};

use crate::error::TrainError;
use crate::model::{Batch, BatchSource, TrainModel};
use crate::schedule::LrSchedule;
use crate::tasks::mesh::mesh_placement;
use crate::trainer::{TrainOptions, Trainer};

/// Which optimizer trains the classifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    AdamW,
}

/// Everything that defines a classifier run.
#[derive(Clone, Debug)]
pub struct ClassifierConfig {
    /// Mesh `[dp, tp]` over ranks `0..dp*tp`; None: local tensors (no communication).
    pub mesh: Option<(usize, usize)>,
    pub batch_size: usize,
    pub features: usize,
    pub classes: usize,
    pub hidden: usize,
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub optimizer: OptimizerKind,
    pub seed: u64,
    pub dtype: DType,
    /// Standard deviation of the noise around each class centre.
    pub noise: f64,
    /// Device type of the mesh placement (cpu, or cuda: one GPU per rank).
    pub device: DeviceType,
    /// The precision policy over master weights in `dtype` (None: everything in `dtype`).
    pub precision: Option<MixedPrecision>,
}

impl Default for ClassifierConfig {
    fn default() -> Self {
        ClassifierConfig {
            mesh: None,
            batch_size: 64,
            features: 16,
            classes: 4,
            hidden: 64,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
            optimizer: OptimizerKind::Sgd,
            seed: 0,
            dtype: DType::F32,
            noise: 1.0,
            device: DeviceType::Cpu,
            precision: None,
        }
    }
}

/// The MLP: features -> hidden (ReLU) -> class logits.
pub struct MlpClassifier {
    pub mlp: Mlp,
}

impl Module for MlpClassifier {
    fn parameters(&self) -> Vec<Parameter> {
        self.mlp.parameters()
    }
}

impl TrainModel for MlpClassifier {
    fn loss(&self, batch: &Batch, _pass: Pass) -> Result<Tensor, TrainError> {
        // Inputs in the layers' compute dtype; the loss in f32 whatever it is.
        let compute = self.mlp.fc1.weight.compute_dtype();
        let x = match batch.inputs.dtype() {
            d if d != compute => batch.inputs.to_dtype(compute)?,
            _ => batch.inputs.clone(),
        };
        let logits = self.mlp.forward(&x)?;
        let logits = match logits.dtype() {
            d if d.is_half() => logits.to_dtype(DType::F32)?,
            _ => logits,
        };
        Ok(logits.cross_entropy(&batch.targets)?.mean_all()?)
    }
    fn flops_per_token(&self) -> Option<f64> {
        let (a, b) = (self.mlp.fc1.weight.value(), self.mlp.fc2.weight.value());
        Some(6.0 * (a.numel() + b.numel()) as f64)
    }
}

/// Gaussian clusters: class centres Normal(0, 1) `[classes, features]`; sample i of step s has
/// label floor(u * classes) and features centre[label] + noise * Normal(0, 1). Held-out
/// batches are fresh draws (steps no training run reaches).
pub struct ClusterData {
    centers: Tensor,
    cfg: ClassifierConfig,
    at: Option<(Placement, NdSbp)>,
}

/// A classifier run.
pub type Classifier = Trainer<MlpClassifier>;

/// Held-out batches are those of steps from here on.
const HELDOUT_STEP: u64 = 1 << 62;

impl ClusterData {
    /// The data of `cfg`, on `mesh` split over its batch axis (None: local).
    pub fn new(
        cfg: &ClassifierConfig,
        mesh: Option<&NamedMesh>,
    ) -> Result<ClusterData, TrainError> {
        let shape = Shape::new([cfg.classes, cfg.features]);
        let seed = param_seed(cfg.seed, "data.centers");
        let init = Init::Normal { seed, std: 1.0 };
        let (centers, at) = match mesh {
            None => (init.build(shape, cfg.dtype, &ParamPlacement::Local)?, None),
            Some(m) => {
                let p = m.placement();
                let at = ParamPlacement::Global {
                    placement: p.clone(),
                    nd_sbp: NdSbp::broadcast(p.ndim()),
                };
                let data_sbp = NdSbp::new(m.axes().iter().map(|a| {
                    if a.kind.splits(AxisRole::Batch) {
                        Sbp::S(0)
                    } else {
                        Sbp::B
                    }
                }));
                (
                    init.build(shape, cfg.dtype, &at)?,
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
    pub fn batch(&self, step: u64) -> Result<Batch, TrainError> {
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
                Tensor::rand_global([n], s_lab, DType::F64, p, s.clone())?,
                Tensor::randn_global([n, f], s_noise, c.dtype, p, s.clone())?,
            ),
        };
        let labels = u.mul_scalar(c.classes as f64)?.cast(DType::I64)?;
        let x = Tensor::embedding(&labels, &self.centers)?.add(&noise.scale(c.noise)?)?;
        Ok(Batch {
            inputs: x,
            targets: labels,
        })
    }
}

impl BatchSource for ClusterData {
    fn batch_size(&self) -> usize {
        self.cfg.batch_size
    }
    fn tokens_per_row(&self) -> usize {
        1
    }
    fn train_batch(&mut self, step: u64, index: usize, count: usize) -> Result<Batch, TrainError> {
        let b = self.batch(step)?;
        if count == 1 {
            return Ok(b);
        }
        let n = self.cfg.batch_size;
        if count == 0 || !n.is_multiple_of(count) {
            return Err(TrainError::Layout {
                detail: format!(
                    "--batch-size {n} must be a multiple of the {count} parts of a step"
                ),
            });
        }
        let (rows, at) = (n / count, index * (n / count));
        let _ng = no_grad();
        Ok(Batch {
            inputs: b.inputs.narrow(0, at, rows)?,
            targets: b.targets.narrow(0, at, rows)?,
        })
    }
    fn heldout_batch(&mut self, i: u64) -> Result<Batch, TrainError> {
        self.batch(HELDOUT_STEP + i)
    }
    fn heldout_batches(&self) -> u64 {
        4
    }
    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "Gaussian clusters (seed {}, {} features, {} classes, noise {})",
            c.seed, c.features, c.classes, c.noise
        )
    }
}

/// A classifier run: the MLP, its optimizer (weight decay on the matrices only) and data, at
/// step 0, trained at a constant learning rate, no clipping, no accumulation (change
/// `opts` for those).
pub fn classifier(cfg: &ClassifierConfig) -> Result<Trainer<MlpClassifier>, TrainError> {
    let mesh = cfg
        .mesh
        .map(|(d, t)| mesh_placement(d, t, cfg.device))
        .transpose()?;
    let mlp = Mlp::new(
        "mlp",
        cfg.features,
        cfg.hidden,
        cfg.classes,
        Activation::Relu,
        cfg.seed,
        cfg.dtype,
        mesh.as_ref().map(NamedMesh::placement),
        mesh.as_ref().and_then(|m| m.axis(AxisRole::Heads)),
    )?;
    let model = MlpClassifier { mlp };
    let precision = match cfg.precision {
        Some(p) => p,
        None => MixedPrecision::full(cfg.dtype).map_err(|e| TrainError::Config {
            detail: format!("the classifier's dtype {}: {e}", cfg.dtype),
        })?,
    };
    model.set_precision(&precision)?;
    let params = model.parameters();
    let decay: Vec<f64> = params
        .iter()
        .map(|p| {
            if model.decays(p) {
                cfg.weight_decay
            } else {
                0.0
            }
        })
        .collect();
    let optimizer: Box<dyn Optimizer> = match cfg.optimizer {
        OptimizerKind::Sgd => Box::new(
            Sgd::new(
                params,
                SgdOptions {
                    lr: cfg.lr,
                    momentum: cfg.momentum,
                    ..SgdOptions::default()
                },
            )
            .with_weight_decay(decay)?,
        ),
        OptimizerKind::AdamW => Box::new(
            AdamW::new(
                params,
                AdamWOptions {
                    lr: cfg.lr,
                    ..AdamWOptions::default()
                },
            )
            .with_weight_decay(decay)?,
        ),
    };
    let data = ClusterData::new(cfg, mesh.as_ref())?;
    Trainer::new(
        model,
        optimizer,
        Box::new(data),
        TrainOptions {
            schedule: LrSchedule::constant(cfg.lr),
            clip_grad: None,
            grad_accum: 1,
            bucket_bytes: 0,
            precision: Some(precision),
            pipeline: None,
            compile: false,
        },
    )
}
