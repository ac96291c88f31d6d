//! How one rank's call of context attention runs on CUDA: each member's block cut into runs of
//! consecutive token positions of one length, the pairs of runs the causal mask leaves any key
//! of, and the layout of the call's one scratch buffer.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use oxiflow_tensor::{OutSpec, Peers};

use super::{CpAttention, Dims, Pass, RankCall};

/// Consecutive token positions `pos .. pos + len` held at rows `at .. at + len` of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub at: usize,
    pub pos: usize,
    pub len: usize,
}

/// The maximal runs of consecutive positions in `pos`.
fn runs_of(pos: &[usize]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for (i, &p) in pos.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.pos + r.len == p => r.len += 1,
            _ => out.push(Run {
                at: i,
                pos: p,
                len: 1,
            }),
        }
    }
    out
}

/// The most runs a call cuts its sequence into.
pub(super) const MAX_RUNS: usize = 64;

/// Each block's runs of consecutive positions, cut into pieces of one length (the largest that
/// divides every run), so any two meet as a square block; None beyond [`MAX_RUNS`] pieces.
fn equal_runs(positions: &[Vec<usize>]) -> Option<Vec<Vec<Run>>> {
    let runs: Vec<Vec<Run>> = positions.iter().map(|p| runs_of(p)).collect();
    let gcd = |a: usize, b: usize| {
        let (mut a, mut b) = (a, b);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let len = runs.iter().flatten().fold(0, |g, r| gcd(g, r.len));
    let total: usize = runs.iter().flatten().map(|r| r.len / len.max(1)).sum();
    if total > MAX_RUNS {
        return None;
    }
    Some(
        runs.iter()
            .map(|rs| {
                rs.iter()
                    .flat_map(|r| {
                        (0..r.len / len).map(move |i| Run {
                            at: r.at + i * len,
                            pos: r.pos + i * len,
                            len,
                        })
                    })
                    .collect()
            })
            .collect(),
    )
}

/// How query run `q` attends to key run `k`: `None` when the mask hides every key, else whether
/// the call is causal (the run with itself). Runs of a permutation's positions are equal or
/// disjoint; anything else is an error.
fn pairing(causal: bool, q: Run, k: Run) -> std::result::Result<Option<bool>, String> {
    if !causal {
        Ok(Some(false))
    } else if (k.pos, k.len) == (q.pos, q.len) {
        Ok(Some(true))
    } else if k.pos + k.len <= q.pos {
        Ok(Some(false))
    } else if k.pos >= q.pos + q.len {
        Ok(None)
    } else {
        Err(format!(
            "query positions {}..{} and key positions {}..{} overlap in part",
            q.pos,
            q.pos + q.len,
            k.pos,
            k.pos + k.len
        ))
    }
}

/// One rank's call: sizes, the ring and each member's runs.
pub(super) struct Plan<'a> {
    pub dims: Dims,
    pub peers: &'a Peers,
    pub runs: Vec<Vec<Run>>,
    pub rows: Vec<usize>,
    pub causal: bool,
    pub scale: f32,
}

impl<'a> Plan<'a> {
    /// The plan of `op` on local q, k, v of these shapes; the same checks on every member.
    pub(super) fn new(
        op: &'a CpAttention,
        q: &[usize],
        k: &[usize],
        v: &[usize],
    ) -> std::result::Result<Plan<'a>, String> {
        let RankCall {
            dims,
            peers,
            block_pos: positions,
        } = op.rank_call(q, k, v)?;
        if dims.d != dims.dv || dims.d > 256 {
            return Err(format!(
                "the fused attention on CUDA takes value heads as wide as key heads, at most 256 \
                 wide: got {} and {}",
                dims.d, dims.dv
            ));
        }
        let seq_len: usize = positions.iter().map(Vec::len).sum();
        let runs = equal_runs(&positions).ok_or_else(|| {
            format!(
                "the fused attention on CUDA takes blocks of equal length, but {} tokens over \
                 {} ranks in {:?} order do not cut into at most {MAX_RUNS} equal runs: use a \
                 sequence length that splits evenly (a multiple of twice the ranks in the \
                 load-balanced order)",
                seq_len,
                peers.len(),
                op.attrs.order,
            )
        })?;
        let causal = op.attrs.causal;
        for qr in runs.iter().flatten() {
            for kr in runs.iter().flatten() {
                pairing(causal, *qr, *kr)?;
            }
        }
        Ok(Plan {
            dims,
            peers,
            rows: positions.iter().map(Vec::len).collect(),
            runs,
            causal,
            scale: op.attrs.scale.get() as f32,
        })
    }

    pub(super) fn members(&self) -> usize {
        self.peers.len()
    }

    /// The block held at ring step `s` (step 0: this rank's own).
    pub(super) fn block_at(&self, s: usize) -> usize {
        let n = self.members();
        (self.peers.me() + n - s % n) % n
    }

    /// This rank's query runs against block `blk`'s key runs that the mask leaves any key of,
    /// with whether each call is causal.
    pub(super) fn pairs(&self, blk: usize) -> Vec<(Run, Run, bool)> {
        let mine = &self.runs[self.peers.me()];
        mine.iter()
            .flat_map(|&q| self.runs[blk].iter().map(move |&k| (q, k)))
            .filter_map(|(q, k)| match pairing(self.causal, q, k) {
                Ok(Some(causal)) => Some((q, k, causal)),
                _ => None,
            })
            .collect()
    }

    fn max_run(&self) -> usize {
        self.runs.iter().flatten().map(|r| r.len).max().unwrap_or(0)
    }

    pub(super) fn ratio(&self) -> usize {
        self.dims.h / self.dims.hkv.max(1)
    }
}

/// Byte offsets into the one scratch buffer, each 256-byte aligned.
#[derive(Default)]
struct Carve {
    end: usize,
}

impl Carve {
    fn take(&mut self, bytes: usize) -> usize {
        let at = self.end;
        self.end = (at + bytes).next_multiple_of(256);
        at
    }
}

/// The scratch of a call: received K/V blocks per ring step (index 0, the rank's own, unused),
/// repeated heads, one pair's partial results, the f32 accumulator of o (forward) or dQ
/// (backward), and the backward's gradient scratch.
pub(super) struct Layout {
    pub recv: Vec<[usize; 2]>,
    pub repeated: Option<[usize; 2]>,
    pub part: usize,
    pub part_lse: usize,
    pub acc: usize,
    pub grads: Option<GradLayout>,
    pub bytes: usize,
}

/// The backward's per-pair dK/dV and the f32 dK/dV accumulators that travel the ring: entry `s`
/// for the block held at step `s`, and entry `n` for the own block come home (one entry alone
/// without a ring).
pub(super) struct GradLayout {
    pub dk: usize,
    pub dv: usize,
    pub acc: Vec<[usize; 2]>,
}

pub(super) fn layout(p: &Plan<'_>, elem: usize, backward: bool) -> Layout {
    let Dims {
        b, t, h, hkv, d, ..
    } = p.dims;
    let mut c = Carve::default();
    let block = |rows: usize, e: usize| b * rows * hkv * d * e;
    let n = p.members();
    let recv = (0..n)
        .map(|s| match s {
            0 => [0, 0],
            _ => {
                let bytes = block(p.rows[p.block_at(s)], elem);
                [c.take(bytes), c.take(bytes)]
            }
        })
        .collect();
    let max_rows = p.rows.iter().copied().max().unwrap_or(0);
    let repeated = (p.ratio() > 1).then(|| {
        let bytes = b * max_rows * h * d * elem;
        [c.take(bytes), c.take(bytes)]
    });
    let run = p.max_run();
    let part = c.take(b * run * h * d * elem);
    let part_lse = c.take(b * h * run * 4);
    let acc = c.take(b * t * h * d * 4);
    let grads = backward.then(|| {
        let (dk, dv) = (
            c.take(b * run * h * d * elem),
            c.take(b * run * h * d * elem),
        );
        let steps = if n > 1 { n + 1 } else { 1 };
        let acc = (0..steps)
            .map(|s| {
                let bytes = block(p.rows[p.block_at(s)], 4);
                [c.take(bytes), c.take(bytes)]
            })
            .collect();
        GradLayout { dk, dv, acc }
    });
    Layout {
        recv,
        repeated,
        part,
        part_lse,
        acc,
        grads,
        bytes: c.end,
    }
}

/// The one scratch buffer of a call (a word when its plan fails: the kernel reports that).
pub(super) fn scratch(op: &CpAttention, ins: &[OutSpec], _outs: &[OutSpec]) -> Vec<OutSpec> {
    let bytes = match ins {
        [q, k, v, ..] => Plan::new(op, q.shape.dims(), k.shape.dims(), v.shape.dims())
            .map(|p| layout(&p, q.dtype.size(), op.pass == Pass::Backward).bytes)
            .unwrap_or(0),
        _ => 0,
    };
    vec![OutSpec {
        shape: Shape::new([bytes.div_ceil(8).max(1)]),
        dtype: DType::I64,
    }]
}
