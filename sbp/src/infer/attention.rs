//! Candidate table of attention ops over `[B, T, H, D]` operands (queries, keys, values, outputs
//! and their gradients) beside per-head statistics `[B, H, T]` (the log-sum-exp).

use super::Rules;
use crate::Sbp;

/// Pushes one candidate per `(data, stats)` pair of `layouts`: every input and output takes
/// `data` but the statistics, input `stats_in` or output `stats_out`, which take `stats`
/// (e.g. `(S(0), S(0))` for the batch, `(S(2), S(1))` for the heads, `(B, B)`).
pub fn attention_candidates(
    rules: &mut Rules,
    n_in: usize,
    n_out: usize,
    stats_in: Option<usize>,
    stats_out: Option<usize>,
    layouts: &[(Sbp, Sbp)],
) {
    for &(data, stats) in layouts {
        let pick = |i: usize, at: Option<usize>| if at == Some(i) { stats } else { data };
        let ins: Vec<Sbp> = (0..n_in).map(|i| pick(i, stats_in)).collect();
        let outs: Vec<Sbp> = (0..n_out).map(|i| pick(i, stats_out)).collect();
        rules.push(&ins, &outs);
    }
}
