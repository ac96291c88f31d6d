//! `Sbp`: how one mesh axis relates the local pieces to the global value.

use std::fmt;
use std::str::FromStr;

use crate::SbpError;

/// The reduction a partial value is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

impl ReduceOp {
    pub fn as_str(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// SBP of one mesh axis: split a tensor dim, broadcast, or partial (reduce pending).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Sbp {
    Split(usize),
    Broadcast,
    Partial(ReduceOp),
}

impl Sbp {
    pub const B: Sbp = Sbp::Broadcast;
    pub const P: Sbp = Sbp::Partial(ReduceOp::Sum);
    #[allow(non_snake_case)]
    pub const fn S(dim: usize) -> Sbp {
        Sbp::Split(dim)
    }
    pub fn is_split(self) -> bool {
        matches!(self, Sbp::Split(_))
    }
    pub fn split_dim(self) -> Option<usize> {
        match self {
            Sbp::Split(d) => Some(d),
            _ => None,
        }
    }
    pub fn is_broadcast(self) -> bool {
        self == Sbp::Broadcast
    }
    pub fn is_partial(self) -> bool {
        matches!(self, Sbp::Partial(_))
    }
    pub fn partial_op(self) -> Option<ReduceOp> {
        match self {
            Sbp::Partial(op) => Some(op),
            _ => None,
        }
    }
}

impl fmt::Display for Sbp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sbp::Split(d) => write!(f, "S({d})"),
            Sbp::Broadcast => f.write_str("B"),
            Sbp::Partial(ReduceOp::Sum) => f.write_str("P"),
            Sbp::Partial(op) => write!(f, "P({})", op.as_str()),
        }
    }
}

impl FromStr for Sbp {
    type Err = SbpError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let err = |d: &str| SbpError::Parse {
            text: s.to_string(),
            detail: d.to_string(),
        };
        match t {
            "B" => return Ok(Sbp::Broadcast),
            "P" | "P(sum)" => return Ok(Sbp::P),
            "P(max)" => return Ok(Sbp::Partial(ReduceOp::Max)),
            "P(min)" => return Ok(Sbp::Partial(ReduceOp::Min)),
            _ => {}
        }
        let inner = t
            .strip_prefix("S(")
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(|| err("expected S(d), B, P, P(max) or P(min)"))?;
        inner
            .trim()
            .parse()
            .map(Sbp::Split)
            .map_err(|_| err("split dim is not a non-negative integer"))
    }
}
