//! Helpers shared by the compile suites: a tensor's bits, the row each of two ranks holds and
//! the small GPT the replays train.
#![allow(dead_code)]

pub mod sgd_step;

use std::sync::Arc;

use oxiflow_compile::{CompileError, Compiled, CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::GptConfig;
use oxiflow_placement::Placement;
use oxiflow_sbp::Sbp;
use oxiflow_tensor::Tensor;

/// Bits of the values widened to f64 (exactly), every NaN alike.
pub fn bits(t: &Tensor) -> Vec<u64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
        .into_iter()
        .map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() })
        .collect()
}

/// This rank's `row` as its row of a [ranks, 2] tensor split by rows over `p`.
pub fn split_row(p: &Placement, row: [f64; 2]) -> Tensor {
    Tensor::from_vec(row.to_vec(), [1, 2])
        .unwrap()
        .to_global(p, Sbp::S(0))
        .unwrap()
}

/// The small GPT of the replay suites (vocabulary 32, 2 layers of width 16, 2 heads, no
/// dropout, seed 7) on `seq_len` positions in `dtype`, `sequence_parallel` as given.
pub fn small_gpt(seq_len: usize, dtype: DType, sequence_parallel: bool) -> GptConfig {
    GptConfig {
        vocab: 32,
        seq_len,
        layers: 2,
        heads: 2,
        width: 16,
        dropout: 0.0,
        seed: 7,
        dtype,
        sequence_parallel,
        vocab_multiple: 1,
        ..GptConfig::default()
    }
}

/// The first run of `step` on `inputs` through `compiled`, which must compile: its (eager)
/// outputs and the program.
pub fn compile_first<E: From<CompileError> + std::fmt::Debug>(
    compiled: &mut CompiledStep,
    inputs: &[Tensor],
    step: impl FnOnce() -> Result<Vec<Tensor>, E>,
) -> (Vec<Tensor>, Arc<Compiled>) {
    let (outs, run) = compiled.run(inputs, step).unwrap();
    let StepRun::Compiled(c) = run else {
        panic!("the first call compiles")
    };
    (outs, c)
}
