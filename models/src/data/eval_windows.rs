//! `EvalWindows`: every whole window of `seq_len + 1` tokens of a token sequence or of each
//! shard of a set, non-overlapping (window `i` of a part holds its ids `[i (T + 1), (i + 1)
//! (T + 1))`; a window never crosses shards; the tail shorter than a window is left out), in
//! order: what an evaluation over all the data reads, each window's first token context only.

use std::sync::Arc;

use super::batches::Batch;
use super::error::DataError;
use super::shards::ShardSet;

/// Where the windows' tokens are.
#[derive(Clone, Debug)]
enum Tokens {
    Shards(Arc<ShardSet>),
    Memory(Arc<[u32]>),
}

/// The windows of an evaluation (see the module docs).
#[derive(Clone, Debug)]
pub struct EvalWindows {
    tokens: Tokens,
    seq_len: usize,
    /// Windows before each part (a shard, or the one sequence), and after the last.
    before: Vec<u64>,
}

impl EvalWindows {
    /// The windows of every shard of `set`.
    pub fn of_shards(set: Arc<ShardSet>, seq_len: usize) -> Result<EvalWindows, DataError> {
        let lens: Vec<usize> = set.shards().iter().map(|s| s.len()).collect();
        EvalWindows::new(Tokens::Shards(set), &lens, seq_len)
    }

    /// The windows of one token sequence.
    pub fn of_tokens(tokens: Arc<[u32]>, seq_len: usize) -> Result<EvalWindows, DataError> {
        let len = tokens.len();
        EvalWindows::new(Tokens::Memory(tokens), &[len], seq_len)
    }

    fn new(tokens: Tokens, lens: &[usize], seq_len: usize) -> Result<EvalWindows, DataError> {
        let op = "EvalWindows";
        let w = seq_len
            .checked_add(1)
            .filter(|_| seq_len > 0)
            .ok_or(DataError::Sampling {
                op,
                detail: format!("seq_len {seq_len}: windows need at least 2 tokens"),
            })?;
        let mut before = vec![0u64];
        for &len in lens {
            let last = before.last().copied().unwrap_or(0);
            before.push(last + (len / w) as u64);
        }
        let n = before.last().copied().unwrap_or(0);
        if n == 0 {
            return Err(DataError::Sampling {
                op,
                detail: format!(
                    "no whole window of {w} tokens in {} tokens",
                    lens.iter().sum::<usize>()
                ),
            });
        }
        Ok(EvalWindows {
            tokens,
            seq_len,
            before,
        })
    }

    /// Tokens per window (inputs; the targets are shifted by one).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Number of windows.
    pub fn len(&self) -> u64 {
        self.before.last().copied().unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Windows `first..first + rows` as a batch (each must exist).
    pub fn batch(&self, first: u64, rows: usize) -> Result<Batch, DataError> {
        let t = self.seq_len;
        let end = first.saturating_add(rows as u64);
        if end > self.len() {
            return Err(DataError::Sampling {
                op: "EvalWindows::batch",
                detail: format!("windows {first}..{end} of {}", self.len()),
            });
        }
        Batch::of_windows("EvalWindows::batch", rows, t, |r, window| {
            let n = first + r as u64;
            let part = self.before.partition_point(|&b| b <= n) - 1;
            let at = (n - self.before[part]) as usize * (t + 1);
            match &self.tokens {
                Tokens::Shards(set) => set.shards()[part].read_into(at, t + 1, window),
                Tokens::Memory(ids) => {
                    window.extend(ids[at..at + t + 1].iter().map(|&id| i64::from(id)));
                    Ok(())
                }
            }
        })
    }
}
