//! `PipelineModel`: what the pipeline runner needs from a model cut into chunks (virtual
//! stages) over pipeline stages: where each stage and each stream between chunks lives, the
//! chunks themselves, and an optional parameter the first and last chunks share (a tied
//! embedding), which the runner moves to the last stage and whose gradient it brings back.

use oxiflow_collectives::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::Tensor;

use crate::nn::gpt::RouterLog;
use crate::nn::{Module, Parameter, Pass};
use crate::Result;

/// A parameter the first and the last chunk both use: the value the first stage computes with
/// goes to the last stage in `layout` (on the last stage's placement).
#[derive(Clone, Debug)]
pub struct Tied {
    pub param: Parameter,
    pub layout: NdSbp,
}

/// A model the pipeline runner drives: chunk `g` runs on stage `g % stages()`; chunk 0 starts
/// from a micro-batch's inputs (global on the first stage), the last chunk ends in its mean
/// loss against the targets (global on the last stage).
pub trait PipelineModel: Module {
    /// Number of pipeline stages.
    fn stages(&self) -> usize;
    /// Number of chunks (virtual stages) in all.
    fn chunks(&self) -> usize;
    /// The placement of stage `s` (None when the model is local).
    fn stage_placement(&self, s: usize) -> Option<Placement>;
    /// Where the stream entering chunk `g` lives (None when local).
    fn stream_layout(&self, g: usize) -> Option<(Placement, NdSbp)>;
    /// The shape and dtype of the stream between chunks for a micro-batch of `inputs` (the
    /// dtype layers compute with).
    fn stream_meta(&self, inputs: &Tensor) -> (Vec<usize>, DType);
    /// The parameter the first and last chunks share, if any.
    fn tied(&self) -> Option<Tied>;
    /// Chunk 0's input stream from a micro-batch's inputs.
    fn enter(&self, inputs: &Tensor, pass: Pass) -> Result<Tensor>;
    /// Chunk `g` on the stream `x`.
    fn run_chunk(&self, g: usize, x: &Tensor, pass: Pass) -> Result<Tensor>;
    /// The routers' load-balancing loss `pass` adds to the loss: its coefficient and the
    /// experts of every router (None: no such loss).
    fn aux_loss(&self, pass: Pass) -> Option<(f64, usize)> {
        let _ = pass;
        None
    }
    /// [`PipelineModel::run_chunk`], adding the routing statistics of the chunk's routers to
    /// `log`.
    fn run_chunk_routed(
        &self,
        g: usize,
        x: &Tensor,
        pass: Pass,
        log: &mut RouterLog,
    ) -> Result<Tensor> {
        let _ = log;
        self.run_chunk(g, x, pass)
    }
    /// The mean loss of the last chunk's output `y` against `targets` (0-d); `tied`: the
    /// shared parameter's value on the last stage, when the runner brought it there.
    fn exit_loss(
        &self,
        y: &Tensor,
        targets: &Tensor,
        tied: Option<&Tensor>,
        pass: Pass,
    ) -> Result<Tensor>;
}
