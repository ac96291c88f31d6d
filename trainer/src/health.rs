//! `HealthGuard`: the step hook that watches the numbers. A step whose loss or gradient norm
//! is NaN or infinite stops the run before its update (an error naming the step and the first
//! non-finite tensor, so no checkpoint ever holds it) or, under `NonFinitePolicy::Skip`, has its
//! update dropped (`MAX_SKIPS_IN_A_ROW` such steps in a row stop the run: then the parameters
//! themselves are the problem). A loss above `spike_factor` times the lowest loss so far warns
//! once as it crosses. Every rank sees the same loss and norm, so every rank decides alike.

use crate::error::TrainError;
use crate::trainer::{StepHook, StepStats, Verdict};

/// Non-finite steps in a row after which a skipping run stops.
pub const MAX_SKIPS_IN_A_ROW: u64 = 10;

/// The weight of a new loss in the smoothed loss.
const SMOOTHING: f64 = 0.1;

/// What a non-finite step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonFinitePolicy {
    Stop,
    Skip,
}

/// The loop's health checks (see the module's documentation).
pub struct HealthGuard {
    policy: NonFinitePolicy,
    spike_factor: f64,
    /// This rank prints the warnings.
    lead: bool,
    /// The smoothed loss of the finite steps so far.
    smoothed: Option<f64>,
    /// The lowest smoothed loss so far and its step.
    lowest: Option<(f64, u64)>,
    /// The last step's smoothed loss was above the spike threshold.
    above: bool,
    skips_in_a_row: u64,
}

impl HealthGuard {
    pub fn new(policy: NonFinitePolicy, spike_factor: f64, lead: bool) -> HealthGuard {
        HealthGuard {
            policy,
            spike_factor,
            lead,
            smoothed: None,
            lowest: None,
            above: false,
            skips_in_a_row: 0,
        }
    }

    /// What was not finite in `s`, for the messages.
    fn describe(s: &StepStats) -> String {
        let what = if s.loss.is_finite() {
            format!("gradient norm {} (loss {})", s.grad_norm, s.loss)
        } else {
            format!("loss {} (gradient norm {})", s.loss, s.grad_norm)
        };
        let first = s.non_finite.as_deref().unwrap_or("not found");
        format!("non-finite {what}; the first non-finite tensor: {first}")
    }
}

impl StepHook for HealthGuard {
    fn skips_only_non_finite(&self) -> bool {
        true
    }
    fn before_update(&mut self, s: &StepStats) -> Result<Verdict, TrainError> {
        if s.loss.is_finite() && s.grad_norm.is_finite() {
            self.skips_in_a_row = 0;
            let smoothed = self
                .smoothed
                .map_or(s.loss, |m| m + SMOOTHING * (s.loss - m));
            self.smoothed = Some(smoothed);
            let lowest = *self.lowest.get_or_insert((smoothed, s.step));
            let above = smoothed > self.spike_factor * lowest.0 && lowest.0 > 0.0;
            if above && !self.above && self.lead {
                tracing::warn!(
                    "step {}: loss {} (smoothed {smoothed:.6}) is above {} x the lowest smoothed loss so far ({:.6} at step {}); the run may be diverging",
                    s.step,
                    s.loss,
                    self.spike_factor,
                    lowest.0,
                    lowest.1
                );
            }
            self.above = above;
            if smoothed < lowest.0 {
                self.lowest = Some((smoothed, s.step));
            }
            return Ok(Verdict::Update);
        }
        let what = Self::describe(s);
        match self.policy {
            NonFinitePolicy::Stop => Err(TrainError::NonFinite {
                step: s.step,
                detail: format!(
                    "{what}; stopped before the update, so no checkpoint holds this step \
                     (--on-nonfinite skip would skip it)"
                ),
            }),
            NonFinitePolicy::Skip if self.skips_in_a_row + 1 >= MAX_SKIPS_IN_A_ROW => {
                Err(TrainError::NonFinite {
                    step: s.step,
                    detail: format!(
                        "{what}; {MAX_SKIPS_IN_A_ROW} non-finite steps in a row: stopped \
                         before the update (the parameters themselves may be the problem)"
                    ),
                })
            }
            NonFinitePolicy::Skip => {
                self.skips_in_a_row += 1;
                Ok(Verdict::Skip)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, loss: f64, grad_norm: f64) -> StepStats {
        StepStats {
            step,
            loss,
            grad_norm,
            non_finite: (!loss.is_finite() || !grad_norm.is_finite())
                .then(|| "the gradient of w".to_string()),
            ..StepStats::default()
        }
    }

    #[test]
    fn stop_names_the_step_and_the_tensor() {
        let mut g = HealthGuard::new(NonFinitePolicy::Stop, 4.0, false);
        assert_eq!(
            g.before_update(&step(1, 2.0, 1.0)).unwrap(),
            Verdict::Update
        );
        let e = g.before_update(&step(2, 2.0, f64::NAN)).unwrap_err();
        assert_eq!(e.exit_code(), 3);
        let msg = e.to_string();
        assert!(
            msg.starts_with("step 2: non-finite gradient norm NaN"),
            "{msg}"
        );
        assert!(msg.contains("the gradient of w"), "{msg}");
    }

    #[test]
    fn skip_skips_until_too_many_in_a_row() {
        let mut g = HealthGuard::new(NonFinitePolicy::Skip, 4.0, false);
        for n in 1..MAX_SKIPS_IN_A_ROW {
            let v = g.before_update(&step(n, f64::INFINITY, 1.0)).unwrap();
            assert_eq!(v, Verdict::Skip);
        }
        // A finite step resets the count.
        let v = g.before_update(&step(50, 1.0, 1.0)).unwrap();
        assert_eq!(v, Verdict::Update);
        for n in 1..MAX_SKIPS_IN_A_ROW {
            assert_eq!(
                g.before_update(&step(50 + n, f64::NAN, 1.0)).unwrap(),
                Verdict::Skip
            );
        }
        let e = g.before_update(&step(99, f64::NAN, 1.0)).unwrap_err();
        assert!(
            e.to_string().contains("10 non-finite steps in a row"),
            "{e}"
        );
    }

    #[test]
    fn the_smoothed_loss_sets_the_bar_and_warns_once_per_excursion() {
        let mut g = HealthGuard::new(NonFinitePolicy::Stop, 4.0, false);
        // One easy batch among ordinary ones does not set the bar.
        for (n, l) in [(1, 1.0), (2, 0.01), (3, 1.0), (4, 1.0)] {
            g.before_update(&step(n, l, 1.0)).unwrap();
        }
        let lowest = g.lowest.unwrap().0;
        assert!(lowest > 0.8, "{lowest}");
        assert!(!g.above);
        // A loss that blows up crosses at once (the lr 1000 case).
        g.before_update(&step(5, 1e7, 1.0)).unwrap();
        assert!(g.above);
        g.before_update(&step(6, 1e7, 1.0)).unwrap();
        assert!(g.above);
    }
}
