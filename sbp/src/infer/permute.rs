//! Candidate table of permute (transpose is a permute).

use super::{RuleMode, Rules, PARTIALS};
use crate::{Sbp, Shape};

/// Output dim i is input dim perm[i]: S(perm[i]) -> S(i); B->B; any P->P.
pub fn permute(perm: &[usize], x: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let n = x.ndim();
    let mut seen = vec![false; n];
    let valid = perm.len() == n
        && perm.iter().all(|&p| {
            let fresh = p < n && !seen[p];
            if fresh {
                seen[p] = true;
            }
            fresh
        });
    if !valid {
        return Err(format!(
            "{perm:?} is not a permutation of the {n} dims of input {x}"
        ));
    }
    let mut r = Rules::new(mode, [Shape::new(perm.iter().map(|&p| x.dim(p)))]);
    for (i, &p) in perm.iter().enumerate() {
        r.push(&[Sbp::S(p)], &[Sbp::S(i)]);
    }
    r.push(&[Sbp::Broadcast], &[Sbp::Broadcast]);
    for m in PARTIALS {
        r.push(&[m], &[m]);
    }
    Ok(r)
}
