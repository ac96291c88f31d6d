//! An update queued before the host reads anything (`queue_clipped`: clipped by the gradients'
//! clip ratio computed on the device, then `commit`) gives bit for bit the update clipped on
//! the host (`apply(clip_factor(norm))`): a GPT with bf16 compute copies trained both ways,
//! clipping active and inactive, one rank and in-process meshes (DP2, TP2, DP2xTP2, ZeRO-2,
//! ZeRO-3). `step_queued`, which never reads the norm, gives the same bits, and the same NaN
//! parameters as the host's NaN clip factor after a step whose gradients hold an infinity or
//! a NaN. A queued update is dropped by `discard` (the parameters stay as they were) and by
//! `apply`, and `commit` without one is a typed error.

mod common;

use common::{bits, on_mesh, step_batch, tiny_gpt, window_tokens};
use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::Pass;
use oxiflow_models::nn::Module;
use oxiflow_models::optim::{clip_factor, norm_of, AdamW, AdamWOptions, Optimizer, StepNorm, Zero};
use oxiflow_tensor::Tensor;

const STEPS: u64 = 3;

/// The pattern of the token ids the steps train on ([`window_tokens`]).
const TOKENS: (u64, u64, u64) = (7, 13, 5);

/// How a step's update is made.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Update {
    /// The norm read, then `apply(clip_factor(norm))`.
    Host,
    /// `queue_clipped`, the norm read, then `commit`.
    Queued,
    /// `step_queued`, the norm never read.
    Unread,
}

/// Losses and final parameters (bits) of `STEPS` steps on `mesh` with ZeRO `stage`, clipped
/// to `max_norm`, updated as `how`; the last step's loss is scaled by `poison` when given (an
/// infinity or a NaN makes its gradients non-finite; 1e155 on an f64 model, their sum of
/// squares alone): the GPT is then f64 throughout, else f32 computing in bf16.
fn train(
    mesh: Option<[usize; 2]>,
    stage: u8,
    max_norm: f64,
    how: Update,
    poison: Option<f64>,
) -> Vec<Vec<u64>> {
    let f64_model = poison.is_some_and(f64::is_finite);
    on_mesh(mesh, |placement| {
        let dtype = if f64_model { DType::F64 } else { DType::F32 };
        let (model, cfg) = tiny_gpt(&placement, dtype, 5);
        let zero = match stage {
            0 => Zero::OFF,
            s => Zero::new(s, 0).unwrap(),
        };
        let mut opt = AdamW::new(model.parameters(), AdamWOptions::default())
            .with_zero(zero)
            .unwrap();
        let mut out = Vec::new();
        for s in 0..STEPS {
            let (x, y) = step_batch(&cfg, s, TOKENS, &placement);
            opt.zero_grad();
            let mut loss = model.loss(&x, &y, Pass::Train { step: s }).unwrap();
            if let (Some(f), true) = (poison, s == STEPS - 1) {
                loss = loss.mul_scalar(f).unwrap();
            }
            loss.backward().unwrap();
            match how {
                Update::Host => {
                    let norm = opt.prepare().unwrap();
                    opt.apply(clip_factor(norm, Some(max_norm))).unwrap();
                }
                Update::Queued => {
                    let sum = opt.prepare_queued().unwrap();
                    assert!(opt.queue_clipped(&sum, Some(max_norm)).unwrap());
                    assert_eq!(
                        norm_of(sum.read().unwrap()).is_finite(),
                        poison.is_none() || s != STEPS - 1
                    );
                    opt.commit().unwrap();
                }
                Update::Unread => {
                    let norm = opt.step_queued(Some(max_norm)).unwrap();
                    assert!(matches!(norm, StepNorm::Queued(_)), "{norm:?}");
                }
            }
            out.push(bits(&loss));
        }
        assert_eq!(opt.step_count(), STEPS);
        out.extend(model.parameters().iter().map(|p| bits(&p.value())));
        out
    })
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
            let host = train(mesh, stage, max_norm, Update::Host, None);
            for how in [Update::Queued, Update::Unread] {
                let queued = train(mesh, stage, max_norm, how, None);
                assert_eq!(
                    host, queued,
                    "{how:?} {mesh:?} ZeRO-{stage} clipped to {max_norm}"
                );
            }
        }
    }
    // The clip changes the update: the test can tell the two norms apart.
    assert_ne!(
        train(None, 0, 0.05, Update::Unread, None),
        train(None, 0, 100.0, Update::Unread, None)
    );
}

#[test]
fn an_unread_step_with_a_non_finite_norm_gives_the_host_clip_factor_s_nan() {
    for (mesh, stage) in [(None, 0), (Some([2, 1]), 0), (Some([2, 2]), 3)] {
        for poison in [f64::INFINITY, f64::NAN, 1e155] {
            let host = train(mesh, stage, 1.0, Update::Host, Some(poison));
            let unread = train(mesh, stage, 1.0, Update::Unread, Some(poison));
            assert_eq!(host, unread, "{mesh:?} ZeRO-{stage}, loss times {poison}");
            // The poisoned step left NaN parameters, which the comparison saw.
            let nan = f64::NAN.to_bits();
            assert!(host[STEPS as usize..].iter().flatten().any(|&b| b == nan));
        }
    }
}

#[test]
fn a_queued_update_is_dropped_by_discard_and_apply() {
    let (model, cfg) = tiny_gpt(&None, DType::F32, 5);
    let mut opt = AdamW::new(model.parameters(), AdamWOptions::default());
    let ids =
        Tensor::from_vec(window_tokens(2, cfg.seq_len, cfg.vocab, 0, TOKENS), [2, 9]).unwrap();
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
