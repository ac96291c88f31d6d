//! `MeshLayout`: a job's ordered list of named axes (resolved from the requested sizes and the
//! world size) and the placement of each pipeline stage, as a `NamedMesh`: a placement whose
//! axes carry their kind, so code asks "which axis splits the heads" instead of naming numbers.

use std::fmt;

use crate::axes::{axes_text, AxisKind, AxisRole, MeshAxis};
use crate::{DeviceType, Placement, PlacementError};

/// Refuses a size-0 axis, an axis named twice and a role split over two axes.
fn check_axes(axes: &[MeshAxis]) -> Result<(), PlacementError> {
    for (i, a) in axes.iter().enumerate() {
        if a.size == 0 {
            return Err(PlacementError::EmptyAxis {
                name: a.name().into(),
            });
        }
        for b in &axes[..i] {
            if b.name() == a.name() {
                return Err(PlacementError::DuplicateAxis {
                    name: a.name().into(),
                    axes: axes_text(axes),
                });
            }
            if let Some(role) = a.kind.roles.iter().find(|r| b.kind.splits(**r)) {
                return Err(PlacementError::RoleTwice {
                    role: role.to_string(),
                    first: b.name().into(),
                    second: a.name().into(),
                });
            }
        }
    }
    Ok(())
}

/// A job's mesh: named axes in order (the first varies slowest over the ranks), each with its
/// size; every role on at most one axis, the pipeline axis (if any) first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshLayout {
    axes: Vec<MeshAxis>,
}

impl MeshLayout {
    /// The layout of `axes`, or why they do not make one.
    pub fn new(axes: Vec<MeshAxis>) -> Result<MeshLayout, PlacementError> {
        check_axes(&axes)?;
        if let Some(a) = axes
            .iter()
            .skip(1)
            .find(|a| a.kind.splits(AxisRole::Stages))
        {
            return Err(PlacementError::StagesNotFirst {
                name: a.name().into(),
                axes: axes_text(&axes),
            });
        }
        Ok(MeshLayout { axes })
    }

    /// The layout of `requested` (kind and size, in mesh order) over `world` ranks: at most
    /// one size left out (None), which is the world size over the others' product.
    pub fn resolve(
        requested: &[(AxisKind, Option<usize>)],
        world: usize,
    ) -> Result<MeshLayout, PlacementError> {
        let mut open = requested.iter().filter(|(_, s)| s.is_none());
        let inferred = open.next().map(|(k, _)| k.name);
        if let Some((second, _)) = open.next() {
            return Err(PlacementError::InferTwice {
                first: inferred.unwrap_or_default().into(),
                second: second.name.into(),
            });
        }
        let given: Vec<MeshAxis> = requested
            .iter()
            .filter_map(|(k, s)| s.map(|s| MeshAxis::new(*k, s)))
            .collect();
        check_axes(&given)?;
        let others = given.iter().try_fold(1usize, |n, a| n.checked_mul(a.size));
        let axes: Vec<MeshAxis> = requested
            .iter()
            .map(|(k, s)| match (s, others) {
                (Some(s), _) => Ok(MeshAxis::new(*k, *s)),
                (None, Some(n)) if world.is_multiple_of(n) => Ok(MeshAxis::new(*k, world / n)),
                (None, _) => Err(PlacementError::AxesDoNotDivide {
                    axes: given.iter().filter(|a| a.shown()).copied().collect(),
                    world,
                }),
            })
            .collect::<Result<_, _>>()?;
        let layout = MeshLayout::new(axes)?;
        if layout.num_ranks() != Some(world) {
            return Err(PlacementError::AxesNotWorld {
                axes: layout.axes.iter().filter(|a| a.shown()).copied().collect(),
                world,
            });
        }
        Ok(layout)
    }

    /// The axes in mesh order.
    pub fn axes(&self) -> &[MeshAxis] {
        &self.axes
    }

    /// The axis that splits `role`, if any.
    pub fn axis(&self, role: AxisRole) -> Option<&MeshAxis> {
        self.axes.iter().find(|a| a.kind.splits(role))
    }

    /// The size of the axis that splits `role` (1: no such axis).
    pub fn size(&self, role: AxisRole) -> usize {
        self.axis(role).map_or(1, |a| a.size)
    }

    /// The product of the sizes (None when it overflows).
    fn num_ranks(&self) -> Option<usize> {
        self.axes
            .iter()
            .try_fold(1usize, |n, a| n.checked_mul(a.size))
    }

    /// The axes of each stage's placement: all but the pipeline axis, those of size 1 only
    /// when their kind keeps them.
    fn stage_axes(&self) -> Vec<MeshAxis> {
        self.axes
            .iter()
            .filter(|a| !a.kind.splits(AxisRole::Stages) && a.shown())
            .copied()
            .collect()
    }

    /// The placement of each pipeline stage on `device`: stage `s` on ranks `s n..(s + 1) n`
    /// for the `n` ranks of a stage, laid out over the stage's axes in mesh order (refused
    /// when the ranks do not fit in `usize`).
    pub fn stages(&self, device: DeviceType) -> Result<Vec<NamedMesh>, PlacementError> {
        self.world(device)?;
        let axes = self.stage_axes();
        let n = axes.iter().map(|a| a.size).product::<usize>();
        (0..self.size(AxisRole::Stages))
            .map(|s| {
                let p = Placement::new(
                    device,
                    axes.iter().map(|a| a.size).collect::<Vec<_>>(),
                    (s * n..(s + 1) * n).collect::<Vec<_>>(),
                )?;
                NamedMesh::new(p, axes.clone())
            })
            .collect()
    }

    /// Every rank of the job as a 1-d placement on `device`.
    pub fn world(&self, device: DeviceType) -> Result<Placement, PlacementError> {
        let n = self
            .num_ranks()
            .ok_or_else(|| PlacementError::MeshTooLarge {
                shape: self.axes.iter().map(|a| a.size).collect(),
            })?;
        Placement::range(device, n)
    }
}

impl fmt::Display for MeshLayout {
    /// `[pp 1, dp 2, cp 2, tp 1]`: every axis with its size, in mesh order.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text: Vec<String> = self
            .axes
            .iter()
            .map(|a| format!("{} {}", a.name(), a.size))
            .collect();
        write!(f, "[{}]", text.join(", "))
    }
}

/// A placement whose axes are named: axis `i` of the placement is `axes()[i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedMesh {
    placement: Placement,
    axes: Vec<MeshAxis>,
}

impl NamedMesh {
    /// `placement` with `axes` (one per placement axis, of the same sizes, each role on one
    /// axis at most).
    pub fn new(placement: Placement, axes: Vec<MeshAxis>) -> Result<NamedMesh, PlacementError> {
        let sizes: Vec<usize> = axes.iter().map(|a| a.size).collect();
        if sizes != placement.shape() {
            return Err(PlacementError::AxesNotMesh {
                axes: axes_text(&axes),
                placement: placement.to_string(),
            });
        }
        check_axes(&axes)?;
        Ok(NamedMesh { placement, axes })
    }

    /// `placement` with its axes of `kinds` in order, their sizes the placement's.
    pub fn of(placement: Placement, kinds: &[AxisKind]) -> Result<NamedMesh, PlacementError> {
        if kinds.len() != placement.ndim() {
            return Err(PlacementError::AxesNotMesh {
                axes: kinds.iter().map(|k| k.name).collect::<Vec<_>>().join(" x "),
                placement: placement.to_string(),
            });
        }
        let axes = kinds
            .iter()
            .zip(placement.shape())
            .map(|(k, &n)| MeshAxis::new(*k, n))
            .collect();
        NamedMesh::new(placement, axes)
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The axes in placement order.
    pub fn axes(&self) -> &[MeshAxis] {
        &self.axes
    }

    /// The placement axis that splits `role`, if any.
    pub fn axis(&self, role: AxisRole) -> Option<usize> {
        self.axes.iter().position(|a| a.kind.splits(role))
    }

    /// The size of the axis that splits `role` (1: no such axis).
    pub fn size(&self, role: AxisRole) -> usize {
        self.axis(role).map_or(1, |i| self.axes[i].size)
    }

    /// `rank`'s coordinate along the axis that splits `role` (0 without such an axis; None
    /// for a rank outside the placement).
    pub fn coord(&self, rank: usize, role: AxisRole) -> Option<usize> {
        let coord = self.placement.coord_of(rank)?;
        Some(self.axis(role).map_or(0, |i| coord[i]))
    }
}

impl fmt::Display for NamedMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.placement, axes_text(&self.axes))
    }
}
