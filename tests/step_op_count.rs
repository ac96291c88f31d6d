//! The ops one GPT training step dispatches (backend-independent: on a GPU each is one or a
//! few kernel launches), counted from the trace's op lane on one CPU rank: `gpt_bench`'s step
//! (forward, backward, global-norm clipping, AdamW) at GPT-2's depth (12 layers, 196
//! parameter tensors, narrow), bf16-mixed. The gradient norm is one multi-tensor op (no per-tensor
//! squares and sums), and after the first update layers compute with the bf16 copies AdamW
//! wrote (no cast of a parameter in the forward pass): the casts left are the backward's
//! gradient casts; every LayerNorm's parameter gradients come from its fused backward.
//! Measured: 1,748 ops per step with a cast per parameter in the forward pass and five ops per
//! gradient for the norm; 770 with the LayerNorm weight gradients composed; 666 with adds
//! summing the Q, K and V projections' input gradients and the residual stream's two; 556 now.

use std::collections::BTreeMap;
use std::time::Duration;

use oxiflow::collectives::trace::{enable_trace, write_rank_trace};
use oxiflow::dtype::MixedPrecision;
use oxiflow::nn::gpt::{Gpt, GptConfig, GptLayout, Pass};
use oxiflow::nn::Module;
use oxiflow::optim::{AdamW, AdamWOptions, Optimizer};
use oxiflow::placement::{NamedMesh, DP, TP};
use oxiflow::prelude::*;

/// Token ids `[b, t + 1]` of step `step` below `vocab`.
fn tokens(b: usize, t: usize, vocab: usize, step: u64) -> Vec<i64> {
    (0..b * (t + 1))
        .map(|i| ((i as u64 * 7 + step * 13) % vocab as u64) as i64)
        .collect()
}

/// Op counts by name of the second of two steps, and the parameter count.
fn count_step_ops() -> (BTreeMap<String, usize>, usize) {
    let dir = std::env::temp_dir().join(format!("oxiflow_step_ops_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = oxiflow::run_ranks(1, Duration::from_secs(120), |_| {
        let placement = Placement::range(DeviceType::Cpu, 1)
            .and_then(|p| p.reshaped([1, 1]))
            .unwrap();
        let cfg = GptConfig {
            vocab: 64,
            seq_len: 16,
            layers: 12,
            heads: 2,
            width: 16,
            dropout: 0.0,
            seed: 3,
            dtype: DType::F32,
            ..GptConfig::default()
        };
        let model = Gpt::new(
            &cfg,
            &GptLayout::Mesh(NamedMesh::of(placement.clone(), &[DP, TP]).unwrap()),
        )
        .unwrap();
        model
            .set_precision(&MixedPrecision::bf16_mixed(DType::F32).unwrap())
            .unwrap();
        let params = model.parameters();
        let n = params.len();
        let mut opt = AdamW::new(params, AdamWOptions::default());
        let (b, t) = (2, cfg.seq_len);
        let mut step = |s: u64| {
            let ids = Tensor::from_vec(tokens(b, t, cfg.vocab, s), [b, t + 1])
                .and_then(|x| x.to_global(&placement, NdSbp::new([Sbp::S(0), Sbp::B])))
                .unwrap();
            let (x, y) = (ids.narrow(1, 0, t).unwrap(), ids.narrow(1, 1, t).unwrap());
            opt.zero_grad();
            let loss = model.loss(&x, &y, Pass::Train { step: s }).unwrap();
            loss.backward().unwrap();
            opt.step_with_norm(Some(1.0)).unwrap();
            loss
        };
        step(0);
        enable_trace(0, dir.clone());
        step(1);
        let path = write_rank_trace().unwrap().expect("tracing is on");
        (path, n)
    });
    let (path, n) = out.into_iter().next().unwrap();
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut counts = BTreeMap::new();
    for e in trace["traceEvents"].as_array().unwrap() {
        if e["cat"] == "ops" && e["ph"] == "X" {
            *counts
                .entry(e["name"].as_str().unwrap().to_string())
                .or_insert(0) += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    (counts, n)
}

#[test]
fn a_bf16_mixed_gpt_step_dispatches_one_norm_op_and_no_parameter_casts() {
    let (counts, params) = count_step_ops();
    let total: usize = counts.values().sum();
    let get = |k: &str| counts.get(k).copied().unwrap_or(0);
    println!("ops in one step: {total} ({params} parameters): {counts:?}");
    // The norm: one multi-tensor op, no per-tensor squares or sums of squares.
    assert_eq!(get("sum_squares"), 1, "{counts:?}");
    assert_eq!(get("square"), 0, "{counts:?}");
    assert_eq!(get("adamw_multi"), 1, "{counts:?}");
    assert_eq!(get("sum"), 0, "{counts:?}");
    // No parameter is cast in the forward pass, nor any gradient for the norm: the casts left
    // are the backward's casts of the parameters' bf16 gradients to f32, one per parameter
    // (the cast path had 3 per parameter and 39 more).
    let casts = get("cast") + get("cast_parts");
    assert_eq!(casts, params, "{counts:?}");
    // Every LayerNorm's weight and bias gradients come from its fused backward: no
    // element-wise x-hat products or row sums over activations.
    assert_eq!(get("sub"), 0, "{counts:?}");
    assert_eq!(get("mul"), 0, "{counts:?}");
    assert_eq!(get("layer_norm_backward"), 0, "{counts:?}");
    // The Q, K and V projections' input gradients are summed by their products (the second
    // and third add the gradient so far as their C operand), and the residual stream's
    // gradient from the next block comes into its norm's backward kernel: no add per block
    // (the three left: the positions' embedding, the tied embedding's two gradients, the clip
    // ratio).
    assert_eq!(get("matmul_t_acc"), 24, "{counts:?}");
    assert!(get("add") <= 3, "{counts:?}");
    assert!(total < 600, "{total} ops: {counts:?}");
}
