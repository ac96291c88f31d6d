//! `GlobalLayout`: (global shape, placement, nd-SBP) and the index math of each rank's piece.

use std::fmt;
use std::ops::Range;

use oxiflow_placement::Placement;
use smallvec::SmallVec;

use crate::{BalancedSplitter, NdSbp, Sbp, SbpError, Shape};

/// Index ranges, one per tensor dim.
pub type Region = SmallVec<[Range<usize>; 6]>;

/// How a global tensor is laid out over the ranks of its placement. Validated on construction:
/// the nd-SBP has one entry per mesh axis and every split dim exists in the shape.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct GlobalLayout {
    shape: Shape,
    placement: Placement,
    nd_sbp: NdSbp,
}

impl GlobalLayout {
    pub fn new(
        shape: impl Into<Shape>,
        placement: &Placement,
        nd_sbp: impl Into<NdSbp>,
    ) -> Result<Self, SbpError> {
        let shape = shape.into();
        let nd_sbp = nd_sbp.into();
        check_nd_sbp(&shape, placement, &nd_sbp)?;
        Ok(GlobalLayout {
            shape,
            placement: placement.clone(),
            nd_sbp,
        })
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn placement(&self) -> &Placement {
        &self.placement
    }
    pub fn nd_sbp(&self) -> &NdSbp {
        &self.nd_sbp
    }

    /// Global index ranges held by the rank at mesh coordinate `coord`: axes apply in order,
    /// axis 0 outermost; each split divides the range that the earlier axes left on its dim.
    pub fn region_at(&self, coord: &[usize]) -> Region {
        let mut region: Region = self.shape.dims().iter().map(|&n| 0..n).collect();
        for (axis, sbp) in self.nd_sbp.iter().enumerate() {
            if let Sbp::Split(d) = sbp {
                let r = &region[d];
                let part =
                    BalancedSplitter::new(r.len(), self.placement.shape()[axis]).range(coord[axis]);
                region[d] = r.start + part.start..r.start + part.end;
            }
        }
        region
    }

    /// Global index ranges held by `rank`; None when the rank is outside the placement.
    pub fn region_of(&self, rank: usize) -> Option<Region> {
        let idx = self.placement.index_of(rank)?;
        Some(self.region_at(&self.placement.coord_of_index(idx)))
    }

    /// Local shape of the rank at mesh coordinate `coord`.
    pub fn local_shape_at(&self, coord: &[usize]) -> Shape {
        Shape::new(self.region_at(coord).iter().map(|r| r.len()))
    }

    /// Local shape of `rank`; None when the rank is outside the placement.
    pub fn local_shape(&self, rank: usize) -> Option<Shape> {
        self.region_of(rank)
            .map(|r| Shape::new(r.iter().map(|x| x.len())))
    }

    /// Whether the rank at `coord` holds the "real" value on every P axis, i.e. its coordinate
    /// is 0 on all partial axes. Used when materialising P from a whole value.
    pub fn is_partial_root(&self, coord: &[usize]) -> bool {
        self.nd_sbp
            .iter()
            .enumerate()
            .all(|(a, s)| !s.is_partial() || coord[a] == 0)
    }

    /// The same layout with another nd-SBP (validated).
    pub fn with_nd_sbp(&self, nd_sbp: impl Into<NdSbp>) -> Result<Self, SbpError> {
        GlobalLayout::new(self.shape.clone(), &self.placement, nd_sbp)
    }

    /// Global shape derived from the local shape of the rank at `coord`, as `to_global` does
    /// from local pieces: the inverse of the balanced splitter, assuming every rank's piece has
    /// the shape the splitter gives. With uneven splits this is ambiguous, so callers that need
    /// exactness gather the local shapes (see `global_shape_from_locals`).
    pub fn global_shape_from_locals(
        local_shapes: &[Shape],
        placement: &Placement,
        nd_sbp: &NdSbp,
    ) -> Result<Shape, SbpError> {
        check_nd_len(placement, nd_sbp)?;
        let first = local_shapes.first().cloned().unwrap_or_default();
        let mut dims = first.to_vec();
        for (d, n) in dims.iter_mut().enumerate() {
            if !nd_sbp.splits_dim(d) {
                continue;
            }
            // Sum the sizes over the ranks whose coordinate is 0 on every axis that does not
            // split dim d: those ranks together cover dim d exactly once.
            *n = 0;
            for (idx, s) in local_shapes.iter().enumerate() {
                let coord = placement.coord_of_index(idx);
                let covers = nd_sbp
                    .iter()
                    .enumerate()
                    .all(|(a, sbp)| sbp == Sbp::Split(d) || coord[a] == 0);
                if covers {
                    *n += s.dims().get(d).copied().unwrap_or(0);
                }
            }
        }
        Ok(Shape::new(dims))
    }
}

/// An nd-SBP of one SBP per mesh axis of `placement`.
fn check_nd_len(placement: &Placement, nd_sbp: &NdSbp) -> Result<(), SbpError> {
    if nd_sbp.len() == placement.ndim() {
        return Ok(());
    }
    Err(SbpError::NdLengthMismatch {
        nd_sbp: nd_sbp.to_string(),
        placement: placement.to_string(),
        expected: placement.ndim(),
        got: nd_sbp.len(),
    })
}

/// Validates an nd-SBP against a shape and placement.
pub fn check_nd_sbp(shape: &Shape, placement: &Placement, nd_sbp: &NdSbp) -> Result<(), SbpError> {
    check_nd_len(placement, nd_sbp)?;
    for sbp in nd_sbp.iter() {
        if let Sbp::Split(d) = sbp {
            if d >= shape.ndim() {
                return Err(SbpError::SplitDimOutOfRange {
                    sbp: sbp.to_string(),
                    nd_sbp: nd_sbp.to_string(),
                    dim: d,
                    ndim: shape.ndim(),
                    shape: shape.to_string(),
                });
            }
        }
    }
    Ok(())
}

impl fmt::Display for GlobalLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {} as {}", self.shape, self.placement, self.nd_sbp)
    }
}
impl fmt::Debug for GlobalLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxiflow_placement::DeviceType;

    #[test]
    fn nested_split_matches_design() {
        let p2 = Placement::new(DeviceType::Cpu, [2, 2], [0, 1, 2, 3]).unwrap();
        let l = GlobalLayout::new([6], &p2, [Sbp::S(0), Sbp::S(0)]).unwrap();
        let rows: Vec<usize> = (0..4).map(|r| l.local_shape(r).unwrap().dim(0)).collect();
        assert_eq!(rows, vec![2, 1, 2, 1]);
        let starts: Vec<usize> = (0..4).map(|r| l.region_of(r).unwrap()[0].start).collect();
        assert_eq!(starts, vec![0, 2, 3, 5]);
        let p1 = Placement::range(DeviceType::Cpu, 4).unwrap();
        let l = GlobalLayout::new([6], &p1, Sbp::S(0)).unwrap();
        let rows: Vec<usize> = (0..4).map(|r| l.local_shape(r).unwrap().dim(0)).collect();
        assert_eq!(rows, vec![2, 2, 1, 1]);
        assert_eq!(l.local_shape(9), None);
    }

    #[test]
    fn global_shape_inverse() {
        let p = Placement::new(DeviceType::Cpu, [2, 3], [0, 1, 2, 3, 4, 5]).unwrap();
        let nd = NdSbp::new([Sbp::S(1), Sbp::S(0)]);
        let l = GlobalLayout::new([7, 5], &p, nd.clone()).unwrap();
        let locals: Vec<Shape> = (0..6).map(|r| l.local_shape(r).unwrap()).collect();
        assert_eq!(
            GlobalLayout::global_shape_from_locals(&locals, &p, &nd).unwrap(),
            Shape::from([7, 5])
        );
    }
}
