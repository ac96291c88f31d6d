//! What a run carries across a resume so that its closing lines and plot are the whole run's:
//! the last losses its final loss averages, and its loss curves (one point per step, thinned to
//! at most `MAX_POINTS` by doubling the stride, so a run and its resumed continuation draw the
//! same points), kept in its checkpoints' metadata as text that gives every value back bit for
//! bit (`loss.recent = "2.5 2.25"`, `curve.train = "1:2.5 2:2.25"`).

use std::collections::VecDeque;

use oxiflow_models::checkpoint::Metadata;

use crate::error::TrainError;

/// Losses the final loss averages.
pub const RECENT: usize = 10;
/// Points of the training curve kept at most.
const MAX_POINTS: usize = 4096;
const KEYS: [&str; 4] = [
    "loss.recent",
    "curve.stride",
    "curve.train",
    "curve.heldout",
];

/// See the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct History {
    recent: VecDeque<f64>,
    pub train: Vec<(u64, f64)>,
    pub heldout: Vec<(u64, f64)>,
    /// Steps between points of the training curve.
    stride: u64,
}

impl Default for History {
    fn default() -> History {
        History {
            recent: VecDeque::new(),
            train: Vec::new(),
            heldout: Vec::new(),
            stride: 1,
        }
    }
}

impl History {
    /// The history a checkpoint's metadata carries (empty for one saved without it).
    pub fn from_metadata(meta: &Metadata) -> Result<History, TrainError> {
        let [recent, stride, train, heldout] = KEYS;
        let h = History {
            recent: losses(meta, recent)?.into(),
            stride: match meta.get(stride) {
                Some(v) => v.parse().map_err(|_| unreadable(stride, v))?,
                None => 1,
            },
            train: points(meta, train)?,
            heldout: points(meta, heldout)?,
        };
        if h.stride == 0 || h.recent.len() > RECENT || h.train.len() > MAX_POINTS {
            return Err(TrainError::Config {
                detail: format!(
                    "the checkpoint's metadata {stride}/{recent}/{train} are out of range \
                     (stride {}, {} recent losses, {} points)",
                    h.stride,
                    h.recent.len(),
                    h.train.len()
                ),
            });
        }
        Ok(h)
    }

    /// The history as checkpoint metadata.
    pub fn to_metadata(&self) -> Metadata {
        let [recent, stride, train, heldout] = KEYS;
        let curve = |pts: &[(u64, f64)]| {
            pts.iter()
                .map(|(s, l)| format!("{s}:{l:?}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let recent_text = self.recent.iter().map(|l| format!("{l:?}"));
        Metadata::from([
            (
                recent.to_string(),
                recent_text.collect::<Vec<_>>().join(" "),
            ),
            (stride.to_string(), self.stride.to_string()),
            (train.to_string(), curve(&self.train)),
            (heldout.to_string(), curve(&self.heldout)),
        ])
    }

    /// The training loss of `step` (a step whose update was kept).
    pub fn loss(&mut self, step: u64, loss: f64) {
        self.recent.push_back(loss);
        if self.recent.len() > RECENT {
            self.recent.pop_front();
        }
        if step.is_multiple_of(self.stride) {
            self.train.push((step, loss));
        }
        if self.train.len() > MAX_POINTS {
            self.stride *= 2;
            let stride = self.stride;
            self.train.retain(|(s, _)| s.is_multiple_of(stride));
        }
    }

    /// The held-out loss of `step` (a non-finite one is not a point of the curve).
    pub fn heldout(&mut self, step: u64, loss: f64) {
        if loss.is_finite() {
            self.heldout.push((step, loss));
        }
    }

    /// The mean of the last `RECENT` losses of the run (NaN before any).
    pub fn final_loss(&self) -> f64 {
        match self.recent.len() {
            0 => f64::NAN,
            n => self.recent.iter().sum::<f64>() / n as f64,
        }
    }
}

fn unreadable(key: &str, value: &str) -> TrainError {
    let shown: String = value.chars().take(80).collect();
    TrainError::Config {
        detail: format!("the checkpoint's metadata {key} is not readable: {shown:?}"),
    }
}

/// The losses of metadata `key` (none when absent).
fn losses(meta: &Metadata, key: &str) -> Result<Vec<f64>, TrainError> {
    let Some(v) = meta.get(key) else {
        return Ok(Vec::new());
    };
    v.split_whitespace()
        .map(|x| x.parse::<f64>().map_err(|_| unreadable(key, v)))
        .collect()
}

/// The (step, loss) points of metadata `key` (none when absent).
fn points(meta: &Metadata, key: &str) -> Result<Vec<(u64, f64)>, TrainError> {
    let Some(v) = meta.get(key) else {
        return Ok(Vec::new());
    };
    v.split_whitespace()
        .map(|p| {
            let (s, l) = p.split_once(':').ok_or_else(|| unreadable(key, v))?;
            Ok((
                s.parse().map_err(|_| unreadable(key, v))?,
                l.parse().map_err(|_| unreadable(key, v))?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_history_is_the_uninterrupted_one() {
        let loss = |s: u64| 1.0 / (s as f64 + 1.0);
        let mut whole = History::default();
        let mut first = History::default();
        for s in 1..=9000 {
            whole.loss(s, loss(s));
            if s <= 5000 {
                first.loss(s, loss(s));
            }
        }
        let mut resumed = History::from_metadata(&first.to_metadata()).unwrap();
        assert_eq!(resumed, first);
        for s in 5001..=9000 {
            resumed.loss(s, loss(s));
        }
        assert_eq!(resumed, whole);
        assert!(whole.train.len() <= MAX_POINTS && whole.stride == 4);
        assert_eq!(
            whole.final_loss(),
            (8991..=9000).map(loss).sum::<f64>() / 10.0
        );
    }
}
