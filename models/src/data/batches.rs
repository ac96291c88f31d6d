//! `WindowSampler`: batches of `seq_len + 1`-token windows at positions drawn from
//! (seed, step, row) by the counter-based RNG, so the global batch of a step is the same for
//! every layout and a data-parallel rank builds only its own rows.

use std::ops::Range;

use oxiflow_tensor::rng::uniform;

use super::error::DataError;

/// Rows of a batch: `inputs[r]` are the window's first `seq_len` tokens, `targets[r]` the
/// next-token targets (the window shifted by one); row-major `[rows, seq_len]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub rows: usize,
    pub seq_len: usize,
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
}

/// Draws batches of `batch` windows of `seq_len + 1` tokens from a token sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowSampler {
    seed: u64,
    batch: usize,
    seq_len: usize,
    starts: usize,
}

impl Batch {
    /// A batch of `rows` windows of `seq_len + 1` ids, window `r` written by `read(r, window)`
    /// into the emptied `window`. A size that overflows or that the system refuses is an
    /// error, not an abort.
    pub(crate) fn of_windows(
        op: &'static str,
        rows: usize,
        seq_len: usize,
        mut read: impl FnMut(usize, &mut Vec<i64>) -> Result<(), DataError>,
    ) -> Result<Batch, DataError> {
        let refuse = |why: String| DataError::Sampling {
            op,
            detail: format!("{rows} windows of {seq_len} token ids: {why}"),
        };
        let n = rows
            .checked_mul(seq_len)
            .ok_or_else(|| refuse("the size overflows".into()))?;
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        inputs
            .try_reserve_exact(n)
            .and_then(|()| targets.try_reserve_exact(n))
            .map_err(|e| refuse(format!("cannot allocate them: {e}")))?;
        let mut window = Vec::with_capacity(seq_len + 1);
        for r in 0..rows {
            window.clear();
            read(r, &mut window)?;
            inputs.extend_from_slice(&window[..seq_len]);
            targets.extend_from_slice(&window[1..]);
        }
        Ok(Batch {
            rows,
            seq_len,
            inputs,
            targets,
        })
    }
}

impl WindowSampler {
    /// A sampler over `len` tokens; needs `len > seq_len` (at least one window).
    pub fn new(len: usize, seed: u64, batch: usize, seq_len: usize) -> Result<Self, DataError> {
        let op = "token windows";
        if batch == 0 || seq_len == 0 {
            return Err(DataError::Sampling {
                op,
                detail: format!("batch {batch} and seq_len {seq_len} must be at least 1"),
            });
        }
        if len <= seq_len {
            return Err(DataError::Sampling {
                op,
                detail: format!(
                    "{len} tokens hold no window of {} tokens ({seq_len} and the one after \
                     them): give more data or shorter windows",
                    seq_len + 1
                ),
            });
        }
        Ok(WindowSampler {
            seed,
            batch,
            seq_len,
            starts: len - seq_len,
        })
    }

    /// Rows per batch.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Tokens per window (inputs; the targets are shifted by one).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Where row `row` of step `step`'s batch starts.
    pub fn window_start(&self, step: u64, row: usize) -> usize {
        let index = step
            .wrapping_mul(self.batch as u64)
            .wrapping_add(row as u64);
        let u = uniform(self.seed, index);
        ((u * self.starts as f64) as usize).min(self.starts - 1)
    }

    /// Rows `rows` of step `step`'s batch drawn from `tokens` (the sequence this sampler was
    /// made for).
    pub fn rows(&self, tokens: &[u32], step: u64, rows: Range<usize>) -> Result<Batch, DataError> {
        let op = "WindowSampler::rows";
        if rows.end > self.batch
            || rows.start > rows.end
            || tokens.len() != self.starts + self.seq_len
        {
            return Err(DataError::Sampling {
                op,
                detail: format!(
                    "rows {rows:?} of a batch of {} from {} tokens (the sampler was made for {})",
                    self.batch,
                    tokens.len(),
                    self.starts + self.seq_len
                ),
            });
        }
        let t = self.seq_len;
        Batch::of_windows(op, rows.len(), t, |r, window| {
            let s = self.window_start(step, rows.start + r);
            window.extend(tokens[s..s + t + 1].iter().map(|&x| i64::from(x)));
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn shards_make_up_the_whole_batch(
            seed in 0u64..1000, step in 0u64..1000, dp in 1usize..5, per in 1usize..4
        ) {
            let tokens: Vec<u32> = (0..200u32).collect();
            let s = WindowSampler::new(tokens.len(), seed, dp * per, 8).unwrap();
            let whole = s.rows(&tokens, step, 0..dp * per).unwrap();
            let mut joined = Vec::new();
            for d in 0..dp {
                joined.extend(s.rows(&tokens, step, d * per..(d + 1) * per).unwrap().inputs);
            }
            prop_assert_eq!(&joined, &whole.inputs);
            for r in 0..dp * per {
                let i = &whole.inputs[r * 8..(r + 1) * 8];
                let t = &whole.targets[r * 8..(r + 1) * 8];
                prop_assert_eq!(&i[1..], &t[..7]);
            }
        }
    }

    #[test]
    fn too_short_corpora_are_refused() {
        assert!(WindowSampler::new(8, 0, 1, 8).is_err());
        assert!(WindowSampler::new(9, 0, 1, 8).is_ok());
        let s = WindowSampler::new(9, 0, 2, 8).unwrap();
        assert!(s.rows(&[0; 9], 0, 0..3).is_err());
        assert!(s.rows(&[0; 10], 0, 0..1).is_err());
    }
}
