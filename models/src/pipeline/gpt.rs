//! `Gpt` as a `PipelineModel`: the embeddings enter on the first stage, the blocks run chunk by
//! chunk, the final norm and the output projection (the tied token table, brought there by the
//! runner, or `lm_head`) end on the last stage.

use oxiflow_collectives::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::Tensor;

use crate::nn::gpt::{Gpt, RouterLog};
use crate::nn::Pass;
use crate::Result;

use super::model::{PipelineModel, Tied};

impl PipelineModel for Gpt {
    fn stages(&self) -> usize {
        self.split.stages()
    }
    fn chunks(&self) -> usize {
        self.split.chunks()
    }
    fn stage_placement(&self, s: usize) -> Option<Placement> {
        self.split.layout(s).placement().cloned()
    }
    fn stream_layout(&self, g: usize) -> Option<(Placement, NdSbp)> {
        Gpt::stream_layout(self, g)
    }
    fn stream_meta(&self, inputs: &Tensor) -> (Vec<usize>, DType) {
        let s = inputs.shape();
        let dims = if s.ndim() == 2 {
            vec![s.dim(0), s.dim(1), self.cfg.width]
        } else {
            vec![0, 0, self.cfg.width]
        };
        // The stream has the dtype layers compute with (a mixed-precision copy's).
        (dims, self.wte.weight.compute_dtype())
    }
    fn tied(&self) -> Option<Tied> {
        let (_, layout) = self.tied_layout()?;
        Some(Tied {
            param: self.wte.weight.clone(),
            layout,
        })
    }
    fn enter(&self, inputs: &Tensor, pass: Pass) -> Result<Tensor> {
        self.embed(inputs, &self.wte.weight.compute()?, pass)
    }
    fn run_chunk(&self, g: usize, x: &Tensor, pass: Pass) -> Result<Tensor> {
        Gpt::run_chunk(self, g, x, pass)
    }
    fn aux_loss(&self, pass: Pass) -> Option<(f64, usize)> {
        match &self.arch.moe {
            Some(m) if pass != Pass::Eval && m.aux_loss_coef > 0.0 => {
                Some((m.aux_loss_coef, m.experts))
            }
            _ => None,
        }
    }
    fn run_chunk_routed(
        &self,
        g: usize,
        x: &Tensor,
        pass: Pass,
        log: &mut RouterLog,
    ) -> Result<Tensor> {
        Gpt::run_chunk_routed(self, g, x, pass, log)
    }
    fn exit_loss(
        &self,
        y: &Tensor,
        targets: &Tensor,
        tied: Option<&Tensor>,
        _pass: Pass,
    ) -> Result<Tensor> {
        self.head_loss(y, &self.head_table(tied)?, targets)
    }
}
