//! Decoding with fused projections (`Gpt::decode_weights`: q/k/v as one product, a SwiGLU
//! MLP's gate and up as one) against the separate projections: each fixture of
//! `tests/fixtures/hf` in f64, after its prompt, gives the same logits and keys and values at
//! every step of `Gpt::decode_at` (within 1e-12), locally and on a tensor-parallel mesh of 2
//! CPU ranks; the fixtures with rotary positions fuse q/k/v (Mistral's one key/value head only
//! where it is not replicated over the axis) and gate/up, GPT-2 (learned positions, GELU)
//! neither. Weights refreshed after a parameter changes give the new
//! parameter's logits (written in place on a device; the CPU writes new tensors).

mod common;

use common::model;

use std::time::Duration;

use oxiflow_models::nn::gpt::{BlockMlp, DecodeWeights, Gpt, GptLayout};
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::{no_grad, run_ranks, Tensor};

/// Ids `[B, T]` on the model's first stage (broadcast), or local.
fn ids(v: &[i64], b: usize, p: Option<&Placement>) -> Tensor {
    let t = Tensor::from_vec(v.to_vec(), [b, v.len() / b]).unwrap();
    match p {
        Some(p) => t.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
        None => t,
    }
}

fn worst(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Four decoding steps after a prompt of 3 tokens (batch 2), fused and separate side by
/// side; returns how many blocks fused q/k/v and gate/up.
fn fused_equals_separate(name: &str, m: &Gpt, p: Option<&Placement>) -> (usize, usize) {
    let _ng = no_grad();
    let mut cache = m.new_cache();
    m.decode(&ids(&[5, 17, 3, 9, 9, 9], 2, p), &mut cache)
        .unwrap();
    let fixed = m.fix_cache(&cache, 8).unwrap();
    let fused = m.decode_weights(None).unwrap();
    let blocks = fused.fused_blocks();
    let separate = DecodeWeights::default();
    for step in 0..4 {
        let at = Tensor::from_vec(vec![(3 + step) as i64], [1]).unwrap();
        let at = match p {
            Some(p) => at.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
            None => at,
        };
        let x = ids(&[11 + step as i64, 40], 2, p);
        let (a, ra) = m.decode_at(&x, &at, &fixed.kv, &fused).unwrap();
        let (b, rb) = m.decode_at(&x, &at, &fixed.kv, &separate).unwrap();
        let w = worst(&a, &b);
        assert!(w < 1e-12, "{name} step {step}: logits differ by {w:e}");
        for ((ka, va), (kb, vb)) in ra.iter().zip(&rb) {
            assert!(worst(ka, kb) < 1e-12 && worst(va, vb) < 1e-12, "{name}");
        }
    }
    blocks
}

#[test]
fn fused_projections_decode_as_the_separate_ones() {
    // Blocks fusing (q/k/v, gate/up) on one rank and under TP2: 2 blocks each.
    for (name, local, tp2) in [
        ("llama", (2, 2), (2, 2)),
        ("qwen2", (2, 2), (2, 2)),
        ("mistral", (2, 2), (0, 2)),
        ("gpt2", (0, 0), (0, 0)),
    ] {
        let m = model(name, &GptLayout::Local);
        assert_eq!(fused_equals_separate(name, &m, None), local, "{name}");
        let got = run_ranks(2, Duration::from_secs(120), |_| {
            let p = Placement::new(DeviceType::Cpu, vec![1, 2], vec![0, 1]).unwrap();
            let layout = GptLayout::Mesh(NamedMesh::of(p.clone(), &[DP, TP]).unwrap());
            let m = model(name, &layout);
            fused_equals_separate(name, &m, Some(&p))
        });
        for fused in got {
            assert_eq!(fused, tp2, "{name} tp 2");
        }
    }
}

#[test]
fn refreshed_weights_follow_the_parameters() {
    let _ng = no_grad();
    let m = model("qwen2", &GptLayout::Local);
    let w = m.decode_weights(None).unwrap();
    // Per block a q/k/v weight and bias, then per block a gate/up weight.
    assert_eq!(w.tensors().len(), 3 * m.blocks.len());
    // A changed query projection (weight and bias) and gate of the first block.
    let q = &m.blocks[0].attn.q;
    let BlockMlp::Dense(mlp) = &m.blocks[0].mlp else {
        panic!("qwen2's MLP is dense");
    };
    let gate = &mlp.gate.as_ref().unwrap().weight;
    for p in [&q.weight, q.bias.as_ref().unwrap(), gate] {
        let v = p.value();
        p.set_value(&v.mul_scalar(1.5).unwrap()).unwrap();
    }
    let w = m.decode_weights(Some(w)).unwrap();
    let mut cache = m.new_cache();
    m.decode(&ids(&[5, 17, 3], 1, None), &mut cache).unwrap();
    let fixed = m.fix_cache(&cache, 5).unwrap();
    let at = Tensor::from_vec(vec![3i64], [1]).unwrap();
    let x = ids(&[11], 1, None);
    let (a, _) = m.decode_at(&x, &at, &fixed.kv, &w).unwrap();
    let (b, _) = m
        .decode_at(&x, &at, &fixed.kv, &DecodeWeights::default())
        .unwrap();
    assert!(worst(&a, &b) < 1e-12, "{:e}", worst(&a, &b));
}
