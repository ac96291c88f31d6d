//! `Placement`: device type plus an n-d mesh of distinct ranks, and all of its index math.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::{DeviceType, PlacementError};

#[derive(Debug, PartialEq, Eq, Hash)]
struct Inner {
    device: DeviceType,
    shape: Vec<usize>,
    /// Ranks in row-major mesh order: coordinate (i, j) is `ranks[i * shape[1] + j]`.
    ranks: Vec<usize>,
    /// Rows of the strides of `shape` (row-major).
    strides: Vec<usize>,
    /// `(rank, index into ranks)` sorted by rank: the rank lookup table. Its size follows the
    /// number of ranks, never the largest rank id.
    pos: Vec<(usize, usize)>,
}

/// A device type and an n-d mesh of distinct ranks. Cheap to clone (shared).
#[derive(Clone)]
pub struct Placement(Arc<Inner>);

impl Placement {
    /// A 1-d placement over `ranks`, in the order given.
    pub fn new_1d(
        device: DeviceType,
        ranks: impl Into<Vec<usize>>,
    ) -> Result<Self, PlacementError> {
        let ranks = ranks.into();
        let n = ranks.len();
        Self::new(device, vec![n], ranks)
    }

    /// An n-d placement of mesh `shape` holding `ranks` in row-major order.
    pub fn new(
        device: DeviceType,
        shape: impl Into<Vec<usize>>,
        ranks: impl Into<Vec<usize>>,
    ) -> Result<Self, PlacementError> {
        let shape = shape.into();
        let ranks = ranks.into();
        if shape.is_empty() || shape.contains(&0) {
            return Err(PlacementError::EmptyMesh { shape });
        }
        let Some(expected) = shape.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s)) else {
            return Err(PlacementError::MeshTooLarge { shape });
        };
        if expected != ranks.len() {
            return Err(PlacementError::ShapeMismatch {
                expected,
                got: ranks.len(),
                shape,
                ranks,
            });
        }
        let mut pos: Vec<(usize, usize)> = ranks.iter().copied().zip(0..).collect();
        pos.sort_unstable();
        if let Some(w) = pos.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(PlacementError::DuplicateRank {
                rank: w[0].0,
                ranks,
            });
        }
        let mut strides = vec![1; shape.len()];
        for a in (0..shape.len().saturating_sub(1)).rev() {
            strides[a] = strides[a + 1] * shape[a + 1];
        }
        Ok(Placement(Arc::new(Inner {
            device,
            shape,
            ranks,
            strides,
            pos,
        })))
    }

    /// A 1-d placement over ranks `0..n`.
    pub fn range(device: DeviceType, n: usize) -> Result<Self, PlacementError> {
        Self::new_1d(device, (0..n).collect::<Vec<_>>())
    }

    pub fn device(&self) -> DeviceType {
        self.0.device
    }
    /// The mesh shape, one extent per mesh axis.
    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    /// Number of mesh axes.
    pub fn ndim(&self) -> usize {
        self.0.shape.len()
    }
    /// Ranks in row-major mesh order.
    pub fn ranks(&self) -> &[usize] {
        &self.0.ranks
    }
    pub fn num_ranks(&self) -> usize {
        self.0.ranks.len()
    }
    /// Whether `rank` is inside the placement.
    pub fn contains(&self, rank: usize) -> bool {
        self.index_of(rank).is_some()
    }
    /// Position of `rank` in row-major mesh order.
    pub fn index_of(&self, rank: usize) -> Option<usize> {
        let pos = &self.0.pos;
        pos.binary_search_by_key(&rank, |&(r, _)| r)
            .ok()
            .map(|i| pos[i].1)
    }
    /// Mesh coordinate of `rank`, or None when the rank lies outside.
    pub fn coord_of(&self, rank: usize) -> Option<Vec<usize>> {
        let idx = self.index_of(rank)?;
        Some(self.coord_of_index(idx))
    }
    /// Mesh coordinate of the rank at row-major position `idx`.
    pub fn coord_of_index(&self, idx: usize) -> Vec<usize> {
        self.0
            .shape
            .iter()
            .zip(&self.0.strides)
            .map(|(&s, &st)| (idx / st) % s)
            .collect()
    }
    /// Rank at mesh coordinate `coord`.
    pub fn rank_at(&self, coord: &[usize]) -> Result<usize, PlacementError> {
        if coord.len() != self.ndim() || coord.iter().zip(self.shape()).any(|(c, s)| c >= s) {
            return Err(PlacementError::CoordOutOfRange {
                coord: coord.to_vec(),
                shape: self.shape().to_vec(),
            });
        }
        let idx: usize = coord.iter().zip(&self.0.strides).map(|(c, s)| c * s).sum();
        Ok(self.0.ranks[idx])
    }

    fn check_axis(&self, axis: usize) -> Result<(), PlacementError> {
        if axis >= self.ndim() {
            return Err(PlacementError::AxisOutOfRange {
                axis,
                ndim: self.ndim(),
                placement: self.to_string(),
            });
        }
        Ok(())
    }

    /// All rank groups along mesh `axis`: each group varies the coordinate of `axis` and fixes
    /// the others. These are the sub-groups a per-axis collective runs in. Groups are ordered by
    /// the row-major position of their first member; members by their coordinate on `axis`.
    pub fn axis_groups(&self, axis: usize) -> Result<Vec<Vec<usize>>, PlacementError> {
        self.check_axis(axis)?;
        let n = self.shape()[axis];
        let st = self.0.strides[axis];
        let mut groups = Vec::with_capacity(self.num_ranks() / n);
        for idx in 0..self.num_ranks() {
            if (idx / st).is_multiple_of(n) {
                groups.push((0..n).map(|k| self.0.ranks[idx + k * st]).collect());
            }
        }
        Ok(groups)
    }

    /// The group along mesh `axis` that contains `rank` (None when the rank is outside).
    pub fn axis_group_of(
        &self,
        rank: usize,
        axis: usize,
    ) -> Result<Option<Vec<usize>>, PlacementError> {
        self.check_axis(axis)?;
        let Some(idx) = self.index_of(rank) else {
            return Ok(None);
        };
        let n = self.shape()[axis];
        let st = self.0.strides[axis];
        let base = idx - ((idx / st) % n) * st;
        Ok(Some((0..n).map(|k| self.0.ranks[base + k * st]).collect()))
    }

    /// The sub-mesh obtained by fixing mesh `axis` at `index` (one fewer axis; a 1-d placement
    /// gives a 1-d placement of one rank).
    pub fn sub_mesh(&self, axis: usize, index: usize) -> Result<Placement, PlacementError> {
        self.check_axis(axis)?;
        if index >= self.shape()[axis] {
            let mut coord = vec![0; self.ndim()];
            coord[axis] = index;
            return Err(PlacementError::CoordOutOfRange {
                coord,
                shape: self.shape().to_vec(),
            });
        }
        let ranks: Vec<usize> = (0..self.num_ranks())
            .filter(|&i| self.coord_of_index(i)[axis] == index)
            .map(|i| self.0.ranks[i])
            .collect();
        let mut shape: Vec<usize> = self.shape().to_vec();
        shape.remove(axis);
        if shape.is_empty() {
            shape.push(1);
        }
        Placement::new(self.device(), shape, ranks)
    }

    /// The same ranks and device, reshaped to another mesh shape.
    pub fn reshaped(&self, shape: impl Into<Vec<usize>>) -> Result<Placement, PlacementError> {
        Placement::new(self.device(), shape, self.ranks().to_vec())
    }

    /// The same mesh on another device type.
    pub fn with_device(&self, device: DeviceType) -> Placement {
        if device == self.device() {
            return self.clone();
        }
        Placement(Arc::new(Inner {
            device,
            shape: self.0.shape.clone(),
            ranks: self.0.ranks.clone(),
            strides: self.0.strides.clone(),
            pos: self.0.pos.clone(),
        }))
    }

    /// Checks that every rank lies inside a world of `world_size` ranks.
    pub fn check_world(&self, world_size: usize) -> Result<(), PlacementError> {
        match self.ranks().iter().find(|&&r| r >= world_size) {
            Some(&rank) => Err(PlacementError::RankOutsideWorld {
                placement: self.to_string(),
                rank,
                world_size,
            }),
            None => Ok(()),
        }
    }

    /// Whether both placements hold the same ranks in the same mesh on the same device.
    pub fn same_as(&self, other: &Placement) -> bool {
        self == other
    }

    /// Whether both name the same set of ranks (in any order or shape).
    pub fn same_rank_set(&self, other: &Placement) -> bool {
        self.num_ranks() == other.num_ranks() && self.ranks().iter().all(|&r| other.contains(r))
    }

    /// The nested rank list, e.g. `[[0, 1], [2, 3]]`.
    pub fn ranks_text(&self) -> String {
        let mut s = String::new();
        self.write_level(&mut s, 0, 0);
        s
    }

    fn write_level(&self, out: &mut String, axis: usize, base: usize) {
        out.push('[');
        let n = self.shape()[axis];
        let st = self.0.strides[axis];
        for k in 0..n {
            if k > 0 {
                out.push_str(", ");
            }
            if axis + 1 == self.ndim() {
                out.push_str(&self.0.ranks[base + k].to_string());
            } else {
                self.write_level(out, axis + 1, base + k * st);
            }
        }
        out.push(']');
    }
}

impl PartialEq for Placement {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.device == other.0.device
                && self.0.shape == other.0.shape
                && self.0.ranks == other.0.ranks)
    }
}
impl Eq for Placement {}

impl Hash for Placement {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.device.hash(state);
        self.0.shape.hash(state);
        self.0.ranks.hash(state);
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.device(), self.ranks_text())
    }
}

impl fmt::Debug for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Placement({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coords_and_groups_2d() {
        let p = Placement::new(DeviceType::Cuda, [2, 3], [5, 1, 2, 3, 4, 0]).unwrap();
        assert_eq!(p.coord_of(3), Some(vec![1, 0]));
        assert_eq!(p.rank_at(&[0, 2]).unwrap(), 2);
        assert_eq!(p.coord_of(7), None);
        assert_eq!(
            p.axis_groups(0).unwrap(),
            vec![vec![5, 3], vec![1, 4], vec![2, 0]]
        );
        assert_eq!(
            p.axis_groups(1).unwrap(),
            vec![vec![5, 1, 2], vec![3, 4, 0]]
        );
        assert_eq!(p.axis_group_of(4, 0).unwrap(), Some(vec![1, 4]));
        assert_eq!(p.axis_group_of(4, 1).unwrap(), Some(vec![3, 4, 0]));
        assert_eq!(p.sub_mesh(0, 1).unwrap().ranks(), &[3, 4, 0]);
        assert_eq!(p.sub_mesh(1, 2).unwrap().ranks(), &[2, 0]);
        assert_eq!(p.to_string(), "cuda:[[5, 1, 2], [3, 4, 0]]");
    }
}
