//! Candidate table of attention ops over `[B, T, H, D]` operands (queries, keys, values, outputs
//! and their gradients) beside per-head statistics `[B, H, T]` (the log-sum-exp).

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

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

/// The layouts of fused attention over `[B, T, H, D]` with `[B, H, T]` statistics: the batch
/// split, the heads split, or all whole.
pub const HEAD_LAYOUTS: [(Sbp, Sbp); 3] = [
    (Sbp::S(0), Sbp::S(0)),
    (Sbp::S(2), Sbp::S(1)),
    (Sbp::B, Sbp::B),
];

/// [`HEAD_LAYOUTS`] and the sequence split (context-parallel attention, whose kernel exchanges
/// key/value blocks between the ranks of that axis).
pub const SEQUENCE_LAYOUTS: [(Sbp, Sbp); 4] = [
    (Sbp::S(0), Sbp::S(0)),
    (Sbp::S(2), Sbp::S(1)),
    (Sbp::S(1), Sbp::S(2)),
    (Sbp::B, Sbp::B),
];

/// Fused attention's forward (q, k, v) -> (o `[B, T, H, Dv]`, lse `[B, H, T]`) on `layouts`.
pub fn fused_attention(o: Shape, lse: Shape, layouts: &[(Sbp, Sbp)], mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [o, lse]);
    attention_candidates(&mut r, 3, 2, None, Some(1), layouts);
    r
}

/// Its backward (q, k, v, o, dO, lse) -> (dq, dk, dv) on `layouts`, and linear in dO: a partial
/// dO gives partial gradients.
pub fn fused_attention_backward(qkv: [&Shape; 3], layouts: &[(Sbp, Sbp)], mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, qkv.map(Shape::clone));
    attention_candidates(&mut r, 6, 3, Some(5), None, layouts);
    r.push(
        &[Sbp::B, Sbp::B, Sbp::B, Sbp::B, Sbp::P, Sbp::B],
        &[Sbp::P, Sbp::P, Sbp::P],
    );
    r
}

/// The attention probabilities softmax(q k^T scale) `[B, H, T, S]` of q `[B, H, T, D]` and k
/// `[B, H, S, D]` (S == T when causal): the batch split, the heads split (every operand and
/// the output alike), or all whole; the softmax over keys stays within the rank's (batch, head)
/// pairs. No P: not linear.
pub fn attention_probs(
    q: &Shape,
    k: &Shape,
    causal: bool,
    mode: RuleMode,
) -> Result<Rules, String> {
    let four = |what: &str, s: &Shape, dims: &str| {
        if s.ndim() == 4 {
            Ok(())
        } else {
            Err(format!("{what} must be 4-d {dims}, got {s}"))
        }
    };
    four("q", q, "[B, H, T, D]")?;
    four("k", k, "[B, H, S, D]")?;
    let (qd, kd) = (q.dims(), k.dims());
    if qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] {
        return Err(format!(
            "k must be [B, H, S, D] for q [B, H, T, D] (same B, H, D), got q {q} and k {k}"
        ));
    }
    if causal && qd[2] != kd[2] {
        return Err(format!(
            "causal attention needs as many keys as queries (S == T), got q {q} and k {k}"
        ));
    }
    let mut r = Rules::new(mode, [Shape::new([qd[0], qd[1], qd[2], kd[2]])]);
    for sbp in [Sbp::S(0), Sbp::S(1), Sbp::B] {
        r.push_uniform(2, 1, sbp);
    }
    Ok(r)
}

/// Decoding attention (q `[B, 1, H, D]`, the cached keys and values `[B, P, G, D]`, the new
/// position's key and value `[B, 1, G, D]`, the position `[1]`) -> o `[B, 1, H, D]`: the batch
/// split or the heads split on every operand but the position (broadcast), or all whole. A
/// heads split keeps whole groups of the `kv_heads` key/value heads on each rank.
pub fn decode_attention(o: Shape, kv_heads: usize, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [o]);
    for s in [Sbp::S(0), Sbp::S(2), Sbp::B] {
        r.push(&[s, s, s, s, s, Sbp::B], &[s]);
    }
    r.with_even_split(1, 2, kv_heads)
}

/// Decoding attention by blocks of the cache (inputs as [`decode_attention`]'s, the caches'
/// P positions in `blocks` equal blocks) -> each block's attended values `o` `[B, C, H, D]` and
/// log-sum-exp `lse` `[B, C, H]`: the batch split or the heads split on every operand but the
/// position (broadcast), the caches split on their positions (whole blocks a rank) beside q,
/// the new key/value and the position whole, the outputs split on their blocks; or all whole.
pub fn decode_attention_parts(o: Shape, lse: Shape, blocks: usize, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [o, lse]);
    for s in [Sbp::S(0), Sbp::S(2), Sbp::B] {
        r.push(&[s, s, s, s, s, Sbp::B], &[s, s]);
    }
    let b = Sbp::B;
    r.push(&[b, Sbp::S(1), Sbp::S(1), b, b, b], &[Sbp::S(1), Sbp::S(1)]);
    r.with_even_split(1, 1, blocks)
}

/// A fused query/key/value projection `[B, T, G, R + 2, D]` (per key/value group: its R query
/// heads, its key, its value) split into q `[B, T, G R, D]` and k, v `[B, T, G, D]`, q and k
/// rotated at positions from a device position (with the frequencies and the position whole):
/// the batch or the groups split (the groups evenly, so each rank's query heads are its
/// groups'), all whole, or a partial input (the split and rotation are linear in it).
pub fn rotary_qkv_at(qkv: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let &[b, t, g, r2, d] = qkv.dims() else {
        return Err(format!("qkv must be [B, T, G, R + 2, D], got {qkv}"));
    };
    if r2 < 3 {
        return Err(format!("qkv {qkv} holds no query head (R + 2 = {r2})"));
    }
    let q = Shape::new([b, t, g * (r2 - 2), d]);
    let kv = Shape::new([b, t, g, d]);
    let mut r = Rules::new(mode, [q, kv.clone(), kv]);
    for s in [Sbp::S(0), Sbp::S(2), Sbp::B, Sbp::P] {
        r.push(&[s, Sbp::B, Sbp::B], &[s, s, s]);
    }
    Ok(r.with_even_split(0, 2, g))
}

/// The rotary embedding of x `[B, T, H, D]` at positions from a device position `[1]` (with
/// the frequencies `[D / 2]`, whole): the batch or the heads split, all whole, or a partial x
/// (the rotation is linear in it). Not a split of T: a rank's rows would need their offset.
pub fn rotary_at(x: &Shape, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [x.clone()]);
    for s in [Sbp::S(0), Sbp::S(2), Sbp::B, Sbp::P] {
        r.push(&[s, Sbp::B, Sbp::B], &[s]);
    }
    r
}

/// The rotary embedding of x `[B, T, H, D]` by cos and sin tables `[T, 1, D]` of its rows'
/// positions: the batch or the heads split with the tables whole, the rows split with the
/// tables' rows split alike (a context-parallel sequence), all whole, or a partial x with whole
/// tables (the rotation is linear in x).
pub fn rotary_tables(x: &Shape, table: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let (&[_, t, _, d], &[tt, 1, td]) = (x.dims(), table.dims()) else {
        return Err(format!(
            "x must be [B, T, H, D] and the tables [T, 1, D], got {x} and {table}"
        ));
    };
    if (tt, td) != (t, d) || d % 2 != 0 {
        return Err(format!(
            "tables {table} do not fit x {x} (they must be [T, 1, D] with an even D)"
        ));
    }
    let mut r = Rules::new(mode, [x.clone()]);
    for s in [Sbp::S(0), Sbp::S(2), Sbp::B, Sbp::P] {
        r.push(&[s, Sbp::B, Sbp::B], &[s]);
    }
    r.push(&[Sbp::S(1), Sbp::S(0), Sbp::S(0)], &[Sbp::S(1)]);
    Ok(r)
}
