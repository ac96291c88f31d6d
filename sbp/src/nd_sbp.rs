//! `NdSbp`: one `Sbp` per mesh axis, written `(S(0), B)`.

use std::fmt;
use std::str::FromStr;

use smallvec::SmallVec;

use crate::{Sbp, SbpError};

/// One SBP per mesh axis, axis 0 first (outermost).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NdSbp(SmallVec<[Sbp; 4]>);

impl NdSbp {
    pub fn new(sbps: impl IntoIterator<Item = Sbp>) -> Self {
        NdSbp(sbps.into_iter().collect())
    }
    /// The same SBP on each of `ndim` axes.
    pub fn uniform(sbp: Sbp, ndim: usize) -> Self {
        NdSbp(std::iter::repeat_n(sbp, ndim).collect())
    }
    pub fn broadcast(ndim: usize) -> Self {
        Self::uniform(Sbp::Broadcast, ndim)
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn as_slice(&self) -> &[Sbp] {
        &self.0
    }
    pub fn iter(&self) -> impl Iterator<Item = Sbp> + '_ {
        self.0.iter().copied()
    }
    /// A copy with axis `axis` set to `sbp`.
    pub fn with_axis(&self, axis: usize, sbp: Sbp) -> Self {
        let mut v = self.clone();
        v.0[axis] = sbp;
        v
    }
    pub fn set(&mut self, axis: usize, sbp: Sbp) {
        self.0[axis] = sbp;
    }
    pub fn has_partial(&self) -> bool {
        self.0.iter().any(|s| s.is_partial())
    }
    /// Whether two mesh axes hold different partial reductions (e.g. `(P, P(max))`), a layout
    /// no boxing can produce or consume.
    pub fn mixes_partials(&self) -> bool {
        let mut ops = self.0.iter().filter_map(|s| match s {
            Sbp::Partial(op) => Some(*op),
            _ => None,
        });
        match ops.next() {
            Some(first) => ops.any(|op| op != first),
            None => false,
        }
    }
    pub fn is_all_broadcast(&self) -> bool {
        self.0.iter().all(|s| s.is_broadcast())
    }
    /// Whether some axis splits tensor dim `dim`.
    pub fn splits_dim(&self, dim: usize) -> bool {
        self.0.contains(&Sbp::Split(dim))
    }
}

impl std::ops::Index<usize> for NdSbp {
    type Output = Sbp;
    fn index(&self, i: usize) -> &Sbp {
        &self.0[i]
    }
}

impl From<Sbp> for NdSbp {
    fn from(s: Sbp) -> Self {
        NdSbp::new([s])
    }
}
impl<const N: usize> From<[Sbp; N]> for NdSbp {
    fn from(s: [Sbp; N]) -> Self {
        NdSbp::new(s)
    }
}
impl From<&[Sbp]> for NdSbp {
    fn from(s: &[Sbp]) -> Self {
        NdSbp::new(s.iter().copied())
    }
}
impl From<Vec<Sbp>> for NdSbp {
    fn from(s: Vec<Sbp>) -> Self {
        NdSbp::new(s)
    }
}
impl From<&NdSbp> for NdSbp {
    fn from(s: &NdSbp) -> Self {
        s.clone()
    }
}

impl fmt::Display for NdSbp {
    /// One axis prints bare (`S(0)`); several print as a tuple (`(S(0), B)`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.len() == 1 {
            return write!(f, "{}", self.0[0]);
        }
        f.write_str("(")?;
        for (i, s) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{s}")?;
        }
        f.write_str(")")
    }
}

impl fmt::Debug for NdSbp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for NdSbp {
    type Err = SbpError;
    /// Parses `S(0)`, `(S(0), B)` or `S(0), B`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let inner = match t.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
            Some(inner) if !t.starts_with("S(") || t.matches('(').count() > 1 => inner,
            _ => t,
        };
        // Split on commas at depth 0.
        let mut parts = Vec::new();
        let (mut depth, mut start) = (0i32, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&inner[start..]);
        let sbps = parts
            .into_iter()
            .map(|p| p.parse::<Sbp>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| match e {
                SbpError::Parse { detail, .. } => SbpError::Parse {
                    text: s.to_string(),
                    detail,
                },
                e => e,
            })?;
        Ok(NdSbp::new(sbps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReduceOp;

    #[test]
    fn print_and_parse() {
        let n = NdSbp::new([Sbp::S(0), Sbp::B]);
        assert_eq!(n.to_string(), "(S(0), B)");
        assert_eq!("(S(0), B)".parse::<NdSbp>().unwrap(), n);
        assert_eq!("S(1)".parse::<NdSbp>().unwrap(), NdSbp::from(Sbp::S(1)));
        assert_eq!(
            "(P(max), S(2), P)".parse::<NdSbp>().unwrap(),
            NdSbp::new([Sbp::Partial(ReduceOp::Max), Sbp::S(2), Sbp::P])
        );
        assert!("(S(x), B)".parse::<NdSbp>().is_err());
    }
}
