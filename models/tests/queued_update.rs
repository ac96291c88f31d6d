//! An update queued before the host reads anything (`queue_clipped`: clipped by the gradients'
//! clip ratio computed on the device, then `commit`) gives bit for bit the update clipped on
//! the host (`apply(clip_factor(norm))`): a GPT with bf16 compute copies trained both ways,
//! clipping active and inactive, one rank and in-process meshes (DP2, TP2, DP2xTP2, ZeRO-2,
//! ZeRO-3). A queued update is dropped by `discard` (the parameters stay as they were) and by
//! `apply`, and `commit` without one is a typed error.

use std::time::Duration;

use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, Pass};
use oxiflow_models::nn::Module;
use oxiflow_models::optim::{clip_factor, norm_of, AdamW, AdamWOptions, Optimizer, Zero};
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{run_ranks, Tensor};

const STEPS: u64 = 3;

fn tokens(b: usize, t: usize, vocab: usize, step: u64) -> Vec<i64> {
    (0..b * (t + 1))
        .map(|i| ((i as u64 * 7 + step * 13 + i as u64 / 5) % vocab as u64) as i64)
        .collect()
}

fn bits(t: &Tensor) -> Vec<u64> {
    let t = match t.placement() {
        Some(p) => t.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
        None => t.clone(),
    };
    t.cast(DType::F64)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn model_on(placement: &Option<Placement>) -> (Gpt, GptConfig) {
    let cfg = GptConfig {
        vocab: 24,
        seq_len: 8,
        layers: 2,
        heads: 2,
        width: 8,
        dropout: 0.0,
        seed: 5,
        dtype: DType::F32,
        ..GptConfig::default()
    };
    let layout = match placement {
        Some(p) => GptLayout::Mesh(p.clone()),
        None => GptLayout::Local,
    };
    let model = Gpt::new(&cfg, &layout).unwrap();
    model.set_compute_dtype(Some(DType::BF16));
    (model, cfg)
}

/// Losses and final parameters (bits) of `STEPS` steps on `mesh` with ZeRO `stage`, clipped
/// to `max_norm`: `queued` commits updates queued before the norm is read, else the host
/// folds the clip factor.
fn train(mesh: Option<[usize; 2]>, stage: u8, max_norm: f64, queued: bool) -> Vec<Vec<u64>> {
    let n = mesh.map_or(1, |m| m[0] * m[1]);
    let out = run_ranks(n, Duration::from_secs(120), |_| {
        let placement = mesh.map(|m| {
            Placement::range(DeviceType::Cpu, n)
                .and_then(|p| p.reshaped(m))
                .unwrap()
        });
        let (model, cfg) = model_on(&placement);
        let zero = match stage {
            0 => Zero::OFF,
            s => Zero::new(s, 0).unwrap(),
        };
        let mut opt = AdamW::new(model.parameters(), AdamWOptions::default())
            .with_zero(zero)
            .unwrap();
        let (b, t) = (4, cfg.seq_len);
        let mut out = Vec::new();
        for s in 0..STEPS {
            let ids = Tensor::from_vec(tokens(b, t, cfg.vocab, s), [b, t + 1]).unwrap();
            let ids = match &placement {
                Some(p) => ids.to_global(p, NdSbp::new([Sbp::S(0), Sbp::B])).unwrap(),
                None => ids,
            };
            let (x, y) = (ids.narrow(1, 0, t).unwrap(), ids.narrow(1, 1, t).unwrap());
            opt.zero_grad();
            let loss = model.loss(&x, &y, Pass::Train { step: s }).unwrap();
            loss.backward().unwrap();
            let sum = opt.prepare_queued().unwrap();
            if queued {
                assert!(opt.queue_clipped(&sum, Some(max_norm)).unwrap());
                assert!(norm_of(sum.read().unwrap()).is_finite());
                opt.commit().unwrap();
            } else {
                let norm = norm_of(sum.read().unwrap());
                opt.apply(clip_factor(norm, Some(max_norm))).unwrap();
            }
            out.push(bits(&loss));
        }
        out.extend(model.parameters().iter().map(|p| bits(&p.value())));
        out
    });
    out.into_iter().next().unwrap()
}

#[test]
fn a_queued_update_equals_the_host_clipped_one_in_every_layout() {
    for (mesh, stage) in [
        (None, 0),
        (Some([2, 1]), 0),
        (Some([1, 2]), 0),
        (Some([2, 2]), 0),
        (Some([2, 1]), 2),
        (Some([2, 2]), 3),
    ] {
        // 0.05 clips every step; 100 never does.
        for max_norm in [0.05, 100.0] {
            let host = train(mesh, stage, max_norm, false);
            let queued = train(mesh, stage, max_norm, true);
            assert_eq!(host, queued, "{mesh:?} ZeRO-{stage} clipped to {max_norm}");
        }
    }
    // The clip changes the update: the test can tell the two norms apart.
    assert_ne!(train(None, 0, 0.05, true), train(None, 0, 100.0, true));
}

#[test]
fn a_queued_update_is_dropped_by_discard_and_apply() {
    let (model, cfg) = model_on(&None);
    let mut opt = AdamW::new(model.parameters(), AdamWOptions::default());
    let ids = Tensor::from_vec(tokens(2, cfg.seq_len, cfg.vocab, 0), [2, 9]).unwrap();
    let (x, y) = (ids.narrow(1, 0, 8).unwrap(), ids.narrow(1, 1, 8).unwrap());
    let before: Vec<Vec<u64>> = model
        .parameters()
        .iter()
        .map(|p| bits(&p.value()))
        .collect();
    let step = |opt: &mut AdamW| {
        opt.zero_grad();
        let loss = model.loss(&x, &y, Pass::Train { step: 0 }).unwrap();
        loss.backward().unwrap();
        opt.prepare_queued().unwrap()
    };
    let sum = step(&mut opt);
    assert!(opt.queue_clipped(&sum, Some(0.1)).unwrap());
    opt.discard();
    let after: Vec<Vec<u64>> = model
        .parameters()
        .iter()
        .map(|p| bits(&p.value()))
        .collect();
    assert_eq!(before, after, "a discarded update changed the parameters");
    assert_eq!(opt.step_count(), 0);
    let e = opt.commit().unwrap_err().to_string();
    assert!(e.contains("no update was queued"), "{e}");
    // Queued, then replaced by `apply`: one update, and nothing left to commit.
    let sum = step(&mut opt);
    assert!(opt.queue_clipped(&sum, None).unwrap());
    opt.apply(1.0).unwrap();
    assert_eq!(opt.step_count(), 1);
    assert!(opt.commit().is_err());
    let changed: Vec<Vec<u64>> = model
        .parameters()
        .iter()
        .map(|p| bits(&p.value()))
        .collect();
    assert_ne!(before, changed);
}
