//! `RuntimeSplit`: an `S(dim)` on one mesh axis whose part sizes are data, known only at run
//! time (the tokens routed to the experts of each rank of an `ep` axis). The nd-SBP still says
//! `S(dim)` on that axis, so signature inference reasons about it as about any split; the
//! sizes travel beside it. The op that makes such a tensor (an expert-parallel dispatch)
//! exchanges its per-rank counts over the axis's ranks, builds this value from them, and takes
//! each rank's region from it instead of from the balanced splitter.

use crate::{GlobalLayout, Region, Sbp, SbpError, Shape};

/// A layout whose split on one mesh axis has the given part sizes, one per rank along it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeSplit {
    layout: GlobalLayout,
    axis: usize,
    dim: usize,
    sizes: Vec<usize>,
}

impl RuntimeSplit {
    /// `layout` with its split on mesh `axis` cut into `sizes` (the rank at coordinate `i`
    /// along the axis holding `sizes[i]` rows of the split dim). The axis must be `S(dim)`, the
    /// only axis splitting `dim`, with one size per rank along it summing to the dim's length.
    pub fn new(layout: &GlobalLayout, axis: usize, sizes: Vec<usize>) -> Result<Self, SbpError> {
        let err = |detail: String| SbpError::RuntimeSplit {
            layout: layout.to_string(),
            axis,
            detail,
        };
        let sbps = layout.nd_sbp().as_slice();
        let dim = match sbps.get(axis) {
            Some(Sbp::Split(d)) => *d,
            Some(s) => return Err(err(format!("the axis is {s}, not a split"))),
            None => return Err(err(format!("the layout has {} mesh axes", sbps.len()))),
        };
        if let Some(other) = (0..sbps.len()).find(|&a| a != axis && sbps[a] == Sbp::Split(dim)) {
            return Err(err(format!(
                "mesh axis {other} splits dim {dim} too: a run-time split is the dim's only one"
            )));
        }
        let ranks = layout.placement().shape()[axis];
        if sizes.len() != ranks {
            return Err(err(format!(
                "{} sizes {sizes:?} for the {ranks} ranks along the axis",
                sizes.len()
            )));
        }
        let len = layout.shape().dim(dim);
        let total = sizes.iter().try_fold(0usize, |n, s| n.checked_add(*s));
        if total != Some(len) {
            return Err(err(format!(
                "sizes {sizes:?} do not add up to the {len} rows of dim {dim}"
            )));
        }
        Ok(RuntimeSplit {
            layout: layout.clone(),
            axis,
            dim,
            sizes,
        })
    }

    pub fn layout(&self) -> &GlobalLayout {
        &self.layout
    }

    /// The mesh axis whose split has run-time sizes.
    pub fn axis(&self) -> usize {
        self.axis
    }

    /// The tensor dim it splits.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The rows of `dim` held at each coordinate along the axis.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Global index ranges held by the rank at mesh coordinate `coord`: the layout's region,
    /// with the split dim cut at the run-time sizes.
    pub fn region_at(&self, coord: &[usize]) -> Region {
        let mut region = self.layout.region_at(coord);
        let i = coord[self.axis];
        let start: usize = self.sizes[..i].iter().sum();
        region[self.dim] = start..start + self.sizes[i];
        region
    }

    /// Local shape of the rank at mesh coordinate `coord`.
    pub fn local_shape_at(&self, coord: &[usize]) -> Shape {
        Shape::new(self.region_at(coord).iter().map(|r| r.len()))
    }
}
