//! Equivalence of the classifier's loss curve across layouts (ranks as threads): local (1 rank),
//! DP=4, TP=4 and DP=2 x TP=2 train the same function from the same seed.

use std::time::Duration;

use oxiflow::run_ranks;
use oxiflow::trainer::tasks::mlp::{classifier as new_classifier, ClassifierConfig as TrainConfig};

const STEPS: usize = 50;

fn curve(mesh: Option<(usize, usize)>) -> Vec<f64> {
    let cfg = TrainConfig {
        mesh,
        seed: 7,
        ..TrainConfig::default()
    };
    let run = |_rank: usize| -> Vec<f64> {
        let mut c = new_classifier(&cfg).expect("model");
        (0..STEPS)
            .map(|_| c.train_step().expect("step").loss)
            .collect()
    };
    match mesh {
        None => run(0),
        Some((d, t)) => {
            let all = run_ranks(d * t, Duration::from_secs(60), run);
            for r in &all[1..] {
                assert_eq!(r, &all[0], "every rank sees the same loss");
            }
            all[0].clone()
        }
    }
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1e-12))
        .fold(0.0, f64::max)
}

#[test]
fn loss_curves_match_across_layouts() {
    let reference = curve(None);
    assert!(
        reference[STEPS - 1] < 0.5 * reference[0],
        "training makes progress: {reference:?}"
    );
    for mesh in [(1, 1), (4, 1), (1, 4), (2, 2)] {
        let c = curve(Some(mesh));
        let d = max_rel(&reference, &c);
        eprintln!(
            "mesh {mesh:?}: first {:.6} last {:.6} max rel diff {d:.3e}",
            c[0],
            c[STEPS - 1]
        );
        assert!(
            d < 1e-4,
            "mesh {mesh:?} differs by {d:e}: {c:?} vs {reference:?}"
        );
    }
}
