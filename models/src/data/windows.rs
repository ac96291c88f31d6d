//! Where a step's windows come from: `Windows::Random` draws each row's position from (seed,
//! step, row) over an in-memory token sequence (`WindowSampler`); `Windows::Sequential` reads
//! consecutive windows of token shards (`ShardWindows`) from a resumable position: row `r` of
//! step `s` is window `origin.windows + (s - origin.step) * batch + r` of the split. Both give
//! every data-parallel rank its rows of the same global batch.

use std::ops::Range;
use std::sync::Arc;

use super::batches::{Batch, WindowSampler};
use super::error::DataError;
use super::shards::ShardSet;

/// The windows of one split (training or held-out) of a shard set: window `i` of a shard
/// holds its ids `[i T, (i + 1) T]` (T + 1 ids, the last one the next window's first), so no
/// window crosses shards; the split is a range of the set's windows, read cyclically.
#[derive(Clone, Debug)]
pub struct ShardWindows {
    set: Arc<ShardSet>,
    seq_len: usize,
    /// Windows before each shard.
    before: Vec<u64>,
    part: Range<u64>,
}

impl ShardWindows {
    /// The training and held-out windows of `set` for `seq_len`: the last `heldout_fraction`
    /// of the windows (at least one) are held out, or `heldout` provides them.
    pub fn split(
        set: Arc<ShardSet>,
        seq_len: usize,
        heldout_fraction: f64,
        heldout: Option<Arc<ShardSet>>,
    ) -> Result<(ShardWindows, ShardWindows), DataError> {
        let all = ShardWindows::whole(set, seq_len)?;
        if let Some(h) = heldout {
            let h = ShardWindows::whole(h, seq_len)?;
            return Ok((all, h));
        }
        let n = all.part.end;
        let held = ((n as f64 * heldout_fraction).ceil() as u64).max(1);
        if n < held + 1 {
            return Err(DataError::Sampling {
                op: "token windows",
                detail: format!(
                    "{}: {n} window(s) of {} ids cannot be split into training and held-out \
                     windows: give more data, shorter windows or separate held-out data",
                    all.set.pattern,
                    seq_len + 1
                ),
            });
        }
        let mut train = all.clone();
        train.part = 0..n - held;
        let mut heldout = all;
        heldout.part = n - held..n;
        Ok((train, heldout))
    }

    /// Every window of `set`.
    pub fn whole(set: Arc<ShardSet>, seq_len: usize) -> Result<ShardWindows, DataError> {
        if seq_len == 0 {
            return Err(DataError::Sampling {
                op: "token windows",
                detail: "a window must hold at least 1 id".into(),
            });
        }
        let mut before = Vec::with_capacity(set.shards().len());
        let mut n = 0u64;
        for s in set.shards() {
            before.push(n);
            n += (s.len().saturating_sub(1) / seq_len) as u64;
        }
        if n == 0 {
            return Err(DataError::Sampling {
                op: "token windows",
                detail: format!(
                    "{}: no shard holds a window of {} ids (a window and the id after it; {} \
                     ids in {} shards)",
                    set.pattern,
                    seq_len + 1,
                    set.tokens(),
                    set.shards().len()
                ),
            });
        }
        Ok(ShardWindows {
            set,
            seq_len,
            before,
            part: 0..n,
        })
    }

    /// Tokens per window (inputs; the targets are shifted by one).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Number of windows in the split.
    pub fn len(&self) -> u64 {
        self.part.end - self.part.start
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (shard index, first id, epoch) of window `n` of the split (counted cyclically).
    pub fn locate(&self, n: u64) -> (usize, usize, u64) {
        let len = self.len().max(1);
        let w = self.part.start + n % len;
        let shard = self.before.partition_point(|&b| b <= w).saturating_sub(1);
        let first = (w - self.before[shard]) as usize * self.seq_len;
        (shard, first, n / len)
    }

    /// The path of shard `i`.
    pub fn shard_path(&self, i: usize) -> String {
        self.set
            .shards()
            .get(i)
            .map_or_else(String::new, |s| s.path().display().to_string())
    }

    /// Windows `first..first + rows` of the split as a batch.
    pub fn batch(&self, first: u64, rows: usize) -> Result<Batch, DataError> {
        let t = self.seq_len;
        Batch::of_windows("ShardWindows::batch", rows, t, |r, window| {
            let (shard, at, _) = self.locate(first + r as u64);
            self.set.shards()[shard].read_into(at, t + 1, window)
        })
    }
}

/// A resumable position of a sequential stream: at step `step`, `windows` windows were read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamOrigin {
    pub step: u64,
    pub windows: u64,
}

/// The windows of a step's batch.
#[derive(Clone, Debug)]
pub enum Windows {
    /// Positions drawn from (seed, step, row) over `tokens[part]`.
    Random {
        sampler: WindowSampler,
        tokens: Arc<[u32]>,
        part: Range<usize>,
    },
    /// Consecutive shard windows from `origin`, `batch` per step.
    Sequential {
        windows: ShardWindows,
        batch: usize,
        origin: StreamOrigin,
    },
}

impl Windows {
    /// Rows `rows` of step `step`'s batch.
    pub fn rows(&self, step: u64, rows: Range<usize>) -> Result<Batch, DataError> {
        match self {
            Windows::Random {
                sampler,
                tokens,
                part,
            } => {
                let tokens = tokens
                    .get(part.clone())
                    .ok_or_else(|| DataError::Sampling {
                        op: "Windows::rows",
                        detail: format!("part {part:?} of {} tokens", tokens.len()),
                    })?;
                sampler.rows(tokens, step, rows)
            }
            Windows::Sequential { windows, batch, .. } => {
                if rows.end > *batch || rows.start > rows.end {
                    return Err(DataError::Sampling {
                        op: "Windows::rows",
                        detail: format!("rows {rows:?} of a batch of {batch}"),
                    });
                }
                let first = self.windows_before(step)? + rows.start as u64;
                windows.batch(first, rows.len())
            }
        }
    }

    /// Windows read before step `step` (sequential streams).
    pub fn windows_before(&self, step: u64) -> Result<u64, DataError> {
        match self {
            Windows::Random { sampler, .. } => Ok(step.saturating_mul(sampler.batch() as u64)),
            Windows::Sequential { batch, origin, .. } => step
                .checked_sub(origin.step)
                .and_then(|d| d.checked_mul(*batch as u64))
                .and_then(|d| d.checked_add(origin.windows))
                .ok_or_else(|| DataError::Sampling {
                    op: "Windows::rows",
                    detail: format!(
                        "step {step} is before the stream's origin step {} or past its end",
                        origin.step
                    ),
                }),
        }
    }

    /// Continues a sequential stream at `origin` (a checkpoint's position).
    pub fn resume_at(&mut self, at: StreamOrigin) {
        if let Windows::Sequential { origin, .. } = self {
            *origin = at;
        }
    }

    /// Where step `step` starts, for people: `shard PATH id N epoch E` (sequential streams).
    pub fn describe_position(&self, step: u64) -> Option<String> {
        let Windows::Sequential { windows, .. } = self else {
            return None;
        };
        let n = self.windows_before(step).ok()?;
        let (shard, at, epoch) = windows.locate(n);
        Some(format!(
            "shard {} id {at} epoch {epoch}",
            windows.shard_path(shard)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::IdWidth;
    use super::super::shards::{write_shard, ShardFormat};
    use super::*;

    #[test]
    fn windows_run_through_the_shards_in_order_and_wrap() {
        let d = std::env::temp_dir().join(format!("oxiflow-windows-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        // Shard a: 9 ids (2 windows of 4 + 1), shard b: 5 ids (1 window).
        for (name, ids) in [("a.bin", 0..9), ("b.bin", 100..105)] {
            let ids: Vec<u32> = ids.collect();
            write_shard(&d.join(name), ShardFormat::Llmc, IdWidth::U16, &ids).unwrap();
        }
        let set = Arc::new(
            ShardSet::open(d.join("*.bin").to_str().unwrap(), ShardFormat::Auto, 200).unwrap(),
        );
        let all = ShardWindows::whole(set, 4).unwrap();
        assert_eq!(all.len(), 3);
        let b = all.batch(0, 4).unwrap();
        assert_eq!(
            b.inputs,
            vec![0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102, 103, 0, 1, 2, 3]
        );
        assert_eq!(&b.targets[..4], &[1, 2, 3, 4]);
        assert_eq!(all.locate(4), (0, 4, 1));
        let w = Windows::Sequential {
            windows: all,
            batch: 2,
            origin: StreamOrigin {
                step: 5,
                windows: 1,
            },
        };
        // Step 6 starts at window 1 + 2 = 3, the first window of the second epoch.
        assert_eq!(w.rows(6, 0..1).unwrap().inputs, vec![0, 1, 2, 3]);
        assert!(w.rows(4, 0..1).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
