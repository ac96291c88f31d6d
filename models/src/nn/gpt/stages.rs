//! `StageSplit`: a GPT's blocks cut into contiguous chunks (virtual stages), each on the layout
//! of one pipeline stage: chunk `g` lives on stage `g % pp`, so with `v` chunks per stage the
//! chunks go round the stages `v` times (interleaved). One stage is the unsplit model.

use std::ops::Range;

use oxiflow_placement::Placement;

use crate::{Result, TensorError};

use super::config::GptLayout;

fn split_err(detail: String) -> TensorError {
    TensorError::Shape {
        op: "StageSplit::new",
        shapes: "-".into(),
        sbps: "-".into(),
        detail,
    }
}

/// Which blocks each virtual stage runs and where each pipeline stage lives.
#[derive(Clone, Debug, PartialEq)]
pub struct StageSplit {
    /// The layout of each pipeline stage (`pp` of them).
    layouts: Vec<GptLayout>,
    /// The blocks of each virtual stage (`pp * v` of them), in model order.
    chunks: Vec<Range<usize>>,
}

impl StageSplit {
    /// The whole model on one layout.
    pub fn single(layers: usize, layout: &GptLayout) -> StageSplit {
        StageSplit {
            layouts: vec![layout.clone()],
            chunks: std::iter::once(0..layers).collect(),
        }
    }

    /// `layers` blocks over `layouts.len()` stages with `virtual_stages` chunks each, as even
    /// as possible (the first `layers % chunks` chunks get one block more). Every chunk gets
    /// at least one block; stages must be global and on disjoint rank sets.
    pub fn new(layers: usize, layouts: Vec<GptLayout>, virtual_stages: usize) -> Result<Self> {
        let pp = layouts.len();
        if pp == 0 || virtual_stages == 0 {
            return Err(split_err(format!(
                "{pp} stages with {virtual_stages} virtual stages each: both must be at least 1"
            )));
        }
        let n = pp * virtual_stages;
        if layers < n {
            return Err(split_err(format!(
                "{layers} layers cannot fill {pp} stages x {virtual_stages} virtual stages (every chunk needs a layer)"
            )));
        }
        if pp > 1 {
            let places: Vec<&Placement> = layouts.iter().filter_map(|l| l.placement()).collect();
            if places.len() != pp {
                return Err(split_err("pipeline stages must be global layouts".into()));
            }
            for (i, a) in places.iter().enumerate() {
                for b in &places[i + 1..] {
                    if a.ranks().iter().any(|&r| b.contains(r)) {
                        return Err(split_err(format!(
                            "pipeline stages {a} and {b} share ranks"
                        )));
                    }
                }
            }
        }
        let (base, extra) = (layers / n, layers % n);
        let mut chunks = Vec::with_capacity(n);
        let mut at = 0;
        for g in 0..n {
            let len = base + usize::from(g < extra);
            chunks.push(at..at + len);
            at += len;
        }
        Ok(StageSplit { layouts, chunks })
    }

    /// Number of pipeline stages.
    pub fn stages(&self) -> usize {
        self.layouts.len()
    }
    /// Number of virtual stages (chunks) in all.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }
    /// The blocks of virtual stage `g`.
    pub fn blocks(&self, g: usize) -> Range<usize> {
        self.chunks.get(g).cloned().unwrap_or(0..0)
    }
    /// The pipeline stage running virtual stage `g`.
    pub fn stage_of(&self, g: usize) -> usize {
        g % self.layouts.len().max(1)
    }
    /// The layout of pipeline stage `s`.
    pub fn layout(&self, s: usize) -> &GptLayout {
        &self.layouts[s.min(self.layouts.len() - 1)]
    }
    /// The layout of virtual stage `g`.
    pub fn chunk_layout(&self, g: usize) -> &GptLayout {
        self.layout(self.stage_of(g))
    }
    /// The layout of block `i`.
    pub fn block_layout(&self, i: usize) -> &GptLayout {
        let g = self.chunks.iter().position(|c| c.contains(&i)).unwrap_or(0);
        self.chunk_layout(g)
    }
    /// The first stage's layout (embeddings) and the last virtual stage's (final norm, logits).
    pub fn first(&self) -> &GptLayout {
        self.layout(0)
    }
    pub fn last(&self) -> &GptLayout {
        self.chunk_layout(self.chunks().saturating_sub(1))
    }
}
