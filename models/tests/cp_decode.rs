//! Decoding with the key/value cache split over a context-parallel axis against one rank, in
//! f64 on the fixtures of `tests/fixtures/hf` (Llama, Qwen2, Mistral: rotary positions and
//! grouped-query heads; GPT-2: learned positions): a prompt (padded to whole load-balanced
//! chunks where it does not cut into them) through `Gpt::decode_prompt`, its cache fixed with
//! the positions split over the axis in equal blocks, then decoding steps, each step's keys and
//! values pushed into the cache; the logits of the prompt and of every step equal one rank's
//! within 1e-10, on CP2, CP3 and CP2 x TP2 meshes of CPU ranks. Each rank holds only its block
//! of the cache's positions.

mod common;

use common::model;

use std::time::Duration;

use oxiflow_models::nn::gpt::{DecodeWeights, Gpt, GptLayout};
use oxiflow_ops::context_parallel::SeqOrder;
use oxiflow_placement::{DeviceType, NamedMesh, Placement, CP, TP};
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::{no_grad, run_ranks, Tensor};

/// Ids `[B, T]` (rows `v` of `t` tokens) as the model's activations lie: on a mesh, in its
/// sequence order and laid out as its activations; else local.
fn ids(m: &Gpt, v: &[i64], t: usize) -> Tensor {
    let b = v.len() / t;
    let Some(p) = m.layout.placement() else {
        return Tensor::from_vec(v.to_vec(), [b, t]).unwrap();
    };
    let v = m.layout.seq_order().reorder_rows(v, t);
    let nd = m.layout.activation_sbp(oxiflow_sbp::Sbp::B).unwrap();
    Tensor::from_vec(v, [b, t])
        .unwrap()
        .to_global(p, NdSbp::broadcast(p.ndim()))
        .unwrap()
        .to_global(p, nd)
        .unwrap()
}

/// The logits of a 5-token prompt (batch 2) and of 6 decoding steps after it, each step's
/// keys and values pushed into a cache of 12 positions; and this rank's share of the cache's
/// positions.
fn decode(m: &Gpt) -> (Vec<Vec<f64>>, usize) {
    let _ng = no_grad();
    let prompt = [5i64, 17, 3, 9, 2, 4, 4, 8, 1, 30];
    let padded = match m.layout.seq_order() {
        SeqOrder::Natural => 5,
        SeqOrder::Balanced { ranks } => 5usize.next_multiple_of(2 * ranks),
    };
    let mut rows = Vec::new();
    for r in prompt.chunks(5) {
        rows.extend_from_slice(r);
        rows.resize(rows.len() + padded - 5, 0);
    }
    let mut cache = m.new_cache();
    let first = m
        .decode_prompt(&ids(m, &rows, padded), 5, &mut cache)
        .unwrap();
    let mut logits = vec![first.to_vec::<f64>().unwrap()];
    let mut fixed = m.fix_cache(&cache, 12).unwrap();
    let share = fixed.kv[0].0.local_shape().dim(1);
    let weights = m
        .decode_weights(None)
        .unwrap_or_else(|_| DecodeWeights::default());
    for step in 0..6 {
        let pos = Tensor::from_vec(vec![(5 + step) as i64], [1]).unwrap();
        let pos = match m.layout.placement() {
            Some(p) => pos.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
            None => pos,
        };
        let x = ids(m, &[11 + step as i64, 40 - step as i64], 1);
        let (l, new) = m.decode_at(&x, &pos, &fixed.kv, &weights).unwrap();
        logits.push(l.to_vec::<f64>().unwrap());
        let laid: Vec<(Tensor, Tensor)> = new
            .iter()
            .zip(&fixed.kv)
            .map(|((k, v), (ck, cv))| {
                (
                    oxiflow_ops::decode::rows_beside(k, ck, 1).unwrap(),
                    oxiflow_ops::decode::rows_beside(v, cv, 1).unwrap(),
                )
            })
            .collect();
        fixed.push(&laid).unwrap();
    }
    (logits, share)
}

fn worst(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs() / q.abs().max(1.0))
        })
        .fold(0.0, f64::max)
}

#[test]
fn a_cache_split_over_cp_decodes_as_one_rank() {
    for name in ["llama", "qwen2", "mistral", "gpt2"] {
        let (want, whole) = decode(&model(name, &GptLayout::Local));
        assert_eq!(whole, 12, "{name}");
        for (mesh, axes) in [
            (vec![2], vec![CP]),
            (vec![3], vec![CP]),
            (vec![2, 2], vec![CP, TP]),
        ] {
            let n: usize = mesh.iter().product();
            let cp = mesh[0];
            let got = run_ranks(n, Duration::from_secs(120), |_| {
                let p = Placement::new(DeviceType::Cpu, mesh.clone(), (0..n).collect::<Vec<_>>())
                    .unwrap();
                let layout = GptLayout::Mesh(NamedMesh::of(p, &axes).unwrap());
                decode(&model(name, &layout))
            });
            for (rank, (logits, share)) in got.into_iter().enumerate() {
                let w = worst(&logits, &want);
                assert!(
                    w < 1e-10,
                    "{name} {mesh:?} rank {rank}: logits differ by {w:e}"
                );
                assert_eq!(share, 12usize.div_ceil(cp), "{name} {mesh:?} rank {rank}");
            }
        }
    }
}
