//! Parsing placements from text such as `cuda:[[0,1],[2,3]]` or `cpu:[0,1,2]`.

use std::str::FromStr;

use crate::{DeviceType, Placement, PlacementError};

/// The deepest list nesting the parser accepts: far more mesh axes than any machine has, and
/// shallow enough that the recursive descent cannot exhaust the stack.
pub const MAX_NESTING: usize = 64;

/// A nested list of ranks as written.
enum Nested {
    Rank(usize),
    List(Vec<Nested>),
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    depth: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, detail: impl Into<String>) -> PlacementError {
        PlacementError::Parse {
            text: self.text.to_string(),
            pos: self.pos,
            detail: detail.into(),
        }
    }
    fn skip_ws(&mut self) {
        while self.pos < self.bytes.len() && self.bytes[self.pos].is_ascii_whitespace() {
            self.pos += 1;
        }
    }
    fn value(&mut self) -> Result<Nested, PlacementError> {
        self.skip_ws();
        match self.bytes.get(self.pos) {
            Some(b'[') => {
                if self.depth >= MAX_NESTING {
                    return Err(PlacementError::TooDeep {
                        limit: MAX_NESTING,
                        pos: self.pos,
                    });
                }
                self.depth += 1;
                let list = self.list();
                self.depth -= 1;
                list
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.pos;
                while self.pos < self.bytes.len() && self.bytes[self.pos].is_ascii_digit() {
                    self.pos += 1;
                }
                self.text[start..self.pos]
                    .parse()
                    .map(Nested::Rank)
                    .map_err(|_| self.err("rank does not fit in usize"))
            }
            _ => Err(self.err("expected a rank or '['")),
        }
    }
}

impl Parser<'_> {
    /// A list whose opening `[` is at the current position.
    fn list(&mut self) -> Result<Nested, PlacementError> {
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.bytes.get(self.pos) == Some(&b']') {
            self.pos += 1;
            return Ok(Nested::List(items));
        }
        loop {
            items.push(self.value()?);
            self.skip_ws();
            match self.bytes.get(self.pos) {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Nested::List(items));
                }
                _ => return Err(self.err("expected ',' or ']'")),
            }
        }
    }
}

/// Shape of a nested list, checking that it is rectangular.
fn shape_of(
    n: &Nested,
    text: &str,
    out: &mut Vec<usize>,
    ranks: &mut Vec<usize>,
) -> Result<(), PlacementError> {
    fn walk(
        n: &Nested,
        depth: usize,
        shape: &mut Vec<Option<usize>>,
        ranks: &mut Vec<usize>,
        text: &str,
    ) -> Result<(), PlacementError> {
        match n {
            Nested::Rank(r) => {
                if depth != shape.len() {
                    return Err(PlacementError::Ragged {
                        text: text.to_string(),
                        detail: format!(
                            "rank {r} at nesting depth {depth}, expected depth {}",
                            shape.len()
                        ),
                    });
                }
                ranks.push(*r);
                Ok(())
            }
            Nested::List(items) => {
                if depth >= shape.len() {
                    return Err(PlacementError::Ragged {
                        text: text.to_string(),
                        detail: format!("a list at depth {depth}, where ranks were expected"),
                    });
                }
                match shape[depth] {
                    Some(len) if len != items.len() => {
                        return Err(PlacementError::Ragged {
                            text: text.to_string(),
                            detail: format!(
                                "a list of {} items at depth {depth} where the first had {len}",
                                items.len()
                            ),
                        })
                    }
                    _ => shape[depth] = Some(items.len()),
                }
                for it in items {
                    walk(it, depth + 1, shape, ranks, text)?;
                }
                Ok(())
            }
        }
    }
    // Depth from the first path down the list.
    let mut depth = 0;
    let mut cur = n;
    while let Nested::List(items) = cur {
        depth += 1;
        match items.first() {
            Some(first) => cur = first,
            None => break,
        }
    }
    let mut shape = vec![None; depth];
    walk(n, 0, &mut shape, ranks, text)?;
    out.extend(shape.into_iter().map(|s| s.unwrap_or(0)));
    Ok(())
}

impl FromStr for Placement {
    type Err = PlacementError;

    /// Parses `device:[ranks]`, e.g. `cuda:[[0,1],[2,3]]`. Whitespace is allowed.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let Some((dev, rest)) = text.split_once(':') else {
            return Err(PlacementError::Parse {
                text: text.to_string(),
                pos: 0,
                detail: "expected `device:[ranks]`".into(),
            });
        };
        let device: DeviceType = dev.parse()?;
        let mut p = Parser {
            text,
            bytes: text.as_bytes(),
            pos: dev.len() + 1,
            depth: 0,
        };
        let nested = p.value()?;
        p.skip_ws();
        if p.pos != text.len() {
            return Err(p.err("trailing characters"));
        }
        if !matches!(nested, Nested::List(_)) {
            return Err(p.err("ranks must be written as a list"));
        }
        let _ = rest;
        let mut shape = Vec::new();
        let mut ranks = Vec::new();
        shape_of(&nested, text, &mut shape, &mut ranks)?;
        Placement::new(device, shape, ranks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for t in [
            "cuda:[[0, 1], [2, 3]]",
            "cpu:[3, 1, 2]",
            "cpu:[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]",
        ] {
            let p: Placement = t.parse().unwrap();
            assert_eq!(p.to_string(), t);
        }
        let p: Placement = "cuda:[[0,1],[2,3]]".parse().unwrap();
        assert_eq!(p.shape(), &[2, 2]);
    }

    #[test]
    fn errors_name_the_value() {
        let e = "cpu:[[0,1],[2]]".parse::<Placement>().unwrap_err();
        assert!(matches!(e, PlacementError::Ragged { .. }), "{e}");
        let e = "cpu:[0,0]".parse::<Placement>().unwrap_err();
        assert!(e.to_string().contains("rank 0"), "{e}");
        let e = "cpu:[]".parse::<Placement>().unwrap_err();
        assert!(matches!(e, PlacementError::EmptyMesh { .. }), "{e}");
        let e = "tpu:[0]".parse::<Placement>().unwrap_err();
        assert!(e.to_string().contains("tpu"), "{e}");
        let e = "cpu:[0,[1]]".parse::<Placement>().unwrap_err();
        assert!(matches!(e, PlacementError::Ragged { .. }), "{e}");
    }
}
