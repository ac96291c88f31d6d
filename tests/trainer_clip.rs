//! Global-norm clipping, checked against a hand computation on one rank: the gradient norm the
//! trainer reports in every layout (local, DP=4, TP=4, DP=2 x TP=2; ranks as threads) is
//! sqrt(sum g^2) of the full one-rank gradient, and the clipped step (SGD and AdamW, weight
//! decay on matrices only) equals the update computed by hand from the full gradient scaled
//! by torch's `max_norm / (norm + 1e-6)`.

use std::time::Duration;

use oxiflow::nn::{Module, Pass};
use oxiflow::run_ranks;
use oxiflow::trainer::tasks::mlp::{classifier, ClassifierConfig, OptimizerKind};
use oxiflow::trainer::TrainModel;
use oxiflow::DType;

const LR: f64 = 0.1;
const WD: f64 = 0.05;

fn cfg(mesh: Option<(usize, usize)>, optimizer: OptimizerKind) -> ClassifierConfig {
    ClassifierConfig {
        mesh,
        seed: 4,
        dtype: DType::F64,
        optimizer,
        lr: LR,
        weight_decay: WD,
        ..ClassifierConfig::default()
    }
}

/// The first step's full gradient on one rank: (values, gradients, whether each decays).
fn one_rank_gradient() -> (Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<bool>) {
    let mut t = classifier(&cfg(None, OptimizerKind::Sgd)).unwrap();
    let batch = t.data.train_batch(0, 0, 1).unwrap();
    t.model
        .loss(&batch, Pass::Train { step: 0 })
        .unwrap()
        .backward()
        .unwrap();
    let params = t.model.parameters();
    let values = params
        .iter()
        .map(|p| p.value().to_vec::<f64>().unwrap())
        .collect();
    let grads = params
        .iter()
        .map(|p| p.grad().unwrap().to_vec::<f64>().unwrap())
        .collect();
    let decays = params.iter().map(|p| t.model.decays(p)).collect();
    (values, grads, decays)
}

/// The parameters after one step by hand: the gradient scaled by `c`, then SGD (its first step:
/// the momentum buffer is the gradient) or AdamW (bias-corrected first step).
fn by_hand(opt: OptimizerKind, c: f64) -> Vec<Vec<f64>> {
    let (values, grads, decays) = one_rank_gradient();
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
    values
        .iter()
        .zip(&grads)
        .zip(&decays)
        .map(|((p, g), &d)| {
            let wd = if d { WD } else { 0.0 };
            p.iter()
                .zip(g)
                .map(|(&p, &g)| {
                    let g = c * g;
                    match opt {
                        OptimizerKind::Sgd => p - LR * (g + wd * p),
                        OptimizerKind::AdamW => {
                            let m = (1.0 - b1) * g / (1.0 - b1);
                            let v = (1.0 - b2) * g * g / (1.0 - b2);
                            p * (1.0 - LR * wd) - LR * m / (v.sqrt() + eps)
                        }
                    }
                })
                .collect()
        })
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// One trainer step under `mesh` clipping at `clip`: (reported norm, parameters after).
fn trainer_step(
    mesh: Option<(usize, usize)>,
    opt: OptimizerKind,
    clip: Option<f64>,
) -> (f64, Vec<Vec<f64>>) {
    let body = |_rank: usize| {
        let mut t = classifier(&cfg(mesh, opt)).unwrap();
        t.opts.clip_grad = clip;
        let s = t.train_step().unwrap();
        let after = t
            .model
            .parameters()
            .iter()
            .map(|p| p.value().to_vec::<f64>().unwrap())
            .collect::<Vec<_>>();
        (s.grad_norm, after)
    };
    match mesh {
        None => body(0),
        Some((d, tp)) => {
            let all = run_ranks(d * tp, Duration::from_secs(60), body);
            for r in &all[1..] {
                assert_eq!(r.0, all[0].0, "every rank reports the same norm");
            }
            all.into_iter().next().unwrap()
        }
    }
}

#[test]
fn the_clipped_step_is_the_one_rank_gradient_clipped_in_every_layout() {
    let (_, grads, _) = one_rank_gradient();
    let norm = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
    assert!(norm > 0.1, "{norm}");
    for opt in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        // Clipping to 0.3 of the norm (active), and to 10 times it (inactive).
        for max in [0.3 * norm, 10.0 * norm] {
            let c = (max / (norm + 1e-6)).min(1.0);
            let want = by_hand(opt, c);
            for mesh in [None, Some((4, 1)), Some((1, 4)), Some((2, 2))] {
                let (got_norm, got) = trainer_step(mesh, opt, Some(max));
                let dn = rel(got_norm, norm);
                let dp = got
                    .iter()
                    .flatten()
                    .zip(want.iter().flatten())
                    .map(|(&a, &b)| rel(a, b))
                    .fold(0.0, f64::max);
                eprintln!(
                    "{opt:?} clip {max:.4} (norm {norm:.6}, factor {c:.4}) mesh {mesh:?}: norm rel {dn:.1e}, parameters max rel {dp:.1e}"
                );
                assert!(dn <= 1e-12, "{opt:?} {mesh:?}: norm {got_norm} vs {norm}");
                assert!(dp <= 1e-10, "{opt:?} {mesh:?}: parameters differ by {dp:e}");
            }
        }
    }
}
