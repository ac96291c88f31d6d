//! `--eval-only`: the mean next-token loss of a decoder over every window of the data
//! (`EvalWindows`), `--batch-size` windows at a time on any layout. A batch need not divide
//! over the data-parallel ranks (the last one may hold a single window): each batch's loss is
//! the sum over its tokens, added up on the host in f64 and divided by the number of predicted
//! tokens once, so the result is exact whatever the batches. A mixture of experts' routing
//! statistics are summed over every batch, so its load-balancing loss is the one of all the
//! windows as one batch.

use oxiflow_collectives::DType;
use oxiflow_models::data::EvalWindows;
use oxiflow_models::nn::gpt::{Gpt, GptLayout, RouterLog};
use oxiflow_models::nn::Pass;
use oxiflow_placement::{NamedMesh, Placement};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{no_grad, Tensor};

use crate::error::TrainError;

/// What an evaluation found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalReport {
    /// The mean next-token loss (nats per predicted token).
    pub loss: f64,
    /// Predicted tokens.
    pub tokens: usize,
    pub windows: u64,
    /// A mixture of experts' load-balancing loss over every window (without its coefficient).
    pub router_aux: Option<f64>,
}

impl EvalReport {
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Host rows `[rows, T]` (natural order) as global ids on `m`, whole on every rank first, then
/// split over the data-parallel axis (unevenly where the rows do not divide) and, on a
/// context-parallel axis, the tokens in the load-balanced order and split over it.
pub(crate) fn rows_on(
    m: &NamedMesh,
    rows: usize,
    t: usize,
    v: Vec<i64>,
) -> Result<Tensor, TrainError> {
    let p = m.placement();
    let layout = GptLayout::Mesh(m.clone());
    let v = layout.seq_order().reorder_rows(&v, t);
    let whole = Tensor::from_vec(v, [rows, t])?.to_global(p, NdSbp::broadcast(p.ndim()))?;
    let nd = layout
        .activation_sbp(Sbp::B)
        .unwrap_or_else(|| NdSbp::broadcast(p.ndim()));
    Ok(whole.to_global(p, nd)?)
}

/// `model`'s loss over every window of `windows`, `batch` windows at a time; `world` (every
/// rank of the job) is where a pipeline's last stage shares each batch's sum. Every rank calls
/// it alike.
pub fn evaluate(
    model: &Gpt,
    windows: &EvalWindows,
    batch: usize,
    world: &Placement,
) -> Result<EvalReport, TrainError> {
    let _ng = no_grad();
    let global = |l: &GptLayout| {
        l.mesh().cloned().ok_or_else(|| TrainError::Layout {
            detail: "the decoder is not global".into(),
        })
    };
    let (first, last) = (global(model.split.first())?, global(model.split.last())?);
    let t = windows.seq_len();
    let (mut sum, mut tokens) = (0.0f64, 0usize);
    let mut at = 0u64;
    let mut log = RouterLog::default();
    // A 0-d result's value on every rank (shared by a pipeline's last stage).
    let read = |s: Tensor| -> Result<f64, TrainError> {
        let s = s.cast(DType::F64)?;
        let s = match model.split.stages() {
            1 => s,
            _ => s.to_global(world, NdSbp::broadcast(1))?,
        };
        Ok(s.to_vec::<f64>()?.first().copied().unwrap_or(f64::NAN))
    };
    while at < windows.len() {
        let rows = (windows.len() - at).min(batch.max(1) as u64) as usize;
        let b = windows.batch(at, rows)?;
        let ids = rows_on(&first, rows, t, b.inputs)?;
        let targets = rows_on(&last, rows, t, b.targets)?;
        let (s, n) = model.loss_sum_routed(&ids, &targets, Pass::Eval, &mut log)?;
        sum += read(s)?;
        tokens += n;
        at += rows as u64;
    }
    Ok(EvalReport {
        loss: sum / tokens.max(1) as f64,
        tokens,
        windows: windows.len(),
        router_aux: log.aux_loss()?.map(read).transpose()?,
    })
}
