//! `LrSchedule`: the learning rate of each step: a linear warm-up over `warmup` steps (step
//! `s < warmup` gets `lr (s + 1) / warmup`), then constant, or a cosine or straight line from
//! `lr` at step `warmup` down to `min_lr` at step `steps`. A pure function of the step, so a
//! resumed run continues the same schedule.

/// The shape after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decay {
    Constant,
    Cosine,
    Linear,
}

/// A learning-rate schedule over a run of `steps` steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    pub steps: u64,
    pub decay: Decay,
}

impl LrSchedule {
    /// The constant rate `lr`.
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule {
            lr,
            min_lr: lr,
            warmup: 0,
            steps: 1,
            decay: Decay::Constant,
        }
    }

    /// The learning rate of step `step` (0-based: the update that makes step `step + 1`).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.steps.saturating_sub(self.warmup);
        if self.decay == Decay::Constant || span == 0 {
            return self.lr;
        }
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        let shape = match self.decay {
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            _ => 1.0 - progress,
        };
        self.min_lr + (self.lr - self.min_lr) * shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_then_decay_to_the_floor() {
        let s = LrSchedule {
            lr: 1.0,
            min_lr: 0.1,
            warmup: 4,
            steps: 14,
            decay: Decay::Cosine,
        };
        assert_eq!(s.at(0), 0.25);
        assert_eq!(s.at(3), 1.0);
        assert_eq!(s.at(4), 1.0);
        assert!((s.at(9) - 0.55).abs() < 1e-12);
        assert!((s.at(14) - 0.1).abs() < 1e-12);
        assert!((s.at(100) - 0.1).abs() < 1e-12);
        let l = LrSchedule {
            decay: Decay::Linear,
            ..s
        };
        assert!((l.at(9) - 0.55).abs() < 1e-12);
        assert!((l.at(6) - (0.1 + 0.9 * 0.8)).abs() < 1e-12);
        let c = LrSchedule {
            decay: Decay::Constant,
            ..s
        };
        assert_eq!(c.at(13), 1.0);
        assert_eq!(LrSchedule::constant(0.3).at(7), 0.3);
        let all_warm = LrSchedule { warmup: 14, ..s };
        assert_eq!(all_warm.at(13), 1.0);
    }
}
