//! The order of a sequence's tokens along its dim: natural, or the load-balanced causal order of
//! context parallelism (torchtitan, Megatron): the sequence cut into `2C` chunks and the tensor
//! holding, for `c` in `0..C`, chunk `c` then chunk `2C-1-c`, so that an even split of the dim
//! over `C` ranks gives rank `c` one early and one late chunk and every rank the same causal work.
//! Chunk sizes follow the even split of the dim over `C` (`BalancedSplitter`, the one the SBP
//! engine splits by): rank `c`'s share `n_c` holds `ceil(n_c / 2)` tokens of chunk `c` and
//! `floor(n_c / 2)` of chunk `2C-1-c`, so any length is allowed.

use oxiflow_sbp::BalancedSplitter;

/// The order of a sequence's tokens along the tensor's sequence dim (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SeqOrder {
    /// Index `i` holds token `i`.
    Natural,
    /// The load-balanced order for `ranks` context-parallel ranks.
    Balanced { ranks: usize },
}

impl SeqOrder {
    /// The token position held at each index `0..len` of the dim.
    pub fn positions(self, len: usize) -> Vec<usize> {
        let SeqOrder::Balanced { ranks } = self else {
            return (0..len).collect();
        };
        let c = ranks.max(1);
        let split = BalancedSplitter::new(len, c);
        let front = |r: usize| split.size(r).div_ceil(2);
        let back = |r: usize| split.size(r) / 2;
        let fronts: usize = (0..c).map(front).sum();
        let mut out = Vec::with_capacity(len);
        let mut front_start = 0;
        for r in 0..c {
            let back_start = fronts + (r + 1..c).map(back).sum::<usize>();
            out.extend(front_start..front_start + front(r));
            out.extend(back_start..back_start + back(r));
            front_start += front(r);
        }
        out
    }

    /// The index of the dim holding each token position `0..len` (the inverse of `positions`).
    pub fn indices(self, len: usize) -> Vec<usize> {
        let mut inv = vec![0; len];
        for (i, p) in self.positions(len).into_iter().enumerate() {
            inv[p] = i;
        }
        inv
    }

    /// Rows of `len` tokens each, in natural order (row-major), reordered to this order.
    pub fn reorder_rows<T: Copy>(self, rows: &[T], len: usize) -> Vec<T> {
        if self == SeqOrder::Natural || len == 0 {
            return rows.to_vec();
        }
        let positions = self.positions(len);
        rows.chunks(len)
            .flat_map(|row| positions.iter().map(move |&p| row[p]))
            .collect()
    }

    /// The attribute bytes of the order.
    pub(crate) fn key(self, key: &mut Vec<u8>) {
        match self {
            SeqOrder::Natural => key.push(0),
            SeqOrder::Balanced { ranks } => {
                key.push(1);
                key.extend_from_slice(&(ranks as u64).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SeqOrder;

    #[test]
    fn balanced_order_pairs_early_and_late_chunks() {
        // 10 tokens over 2 ranks: shares 5 and 5, chunks 3+2 and 2+3.
        let p = SeqOrder::Balanced { ranks: 2 }.positions(10);
        assert_eq!(p, vec![0, 1, 2, 8, 9, 3, 4, 5, 6, 7]);
        // 7 tokens over 2 ranks: shares 4 and 3 (the engine's split), chunks 2+2 and 2+1.
        let p = SeqOrder::Balanced { ranks: 2 }.positions(7);
        assert_eq!(p, vec![0, 1, 5, 6, 2, 3, 4]);
        for (len, c) in [(13, 4), (8, 4), (3, 2), (0, 3), (17, 3)] {
            let o = SeqOrder::Balanced { ranks: c };
            let mut sorted = o.positions(len);
            sorted.sort_unstable();
            assert_eq!(sorted, (0..len).collect::<Vec<_>>(), "{len} over {c}");
            let inv = o.indices(len);
            assert!(o
                .positions(len)
                .iter()
                .enumerate()
                .all(|(i, &p)| inv[p] == i));
        }
        assert_eq!(SeqOrder::Natural.positions(3), vec![0, 1, 2]);
        let rows =
            SeqOrder::Balanced { ranks: 2 }.reorder_rows(&[10, 11, 12, 13, 20, 21, 22, 23], 4);
        assert_eq!(rows, vec![10, 13, 11, 12, 20, 23, 21, 22]);
    }
}
