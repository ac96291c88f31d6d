//! The layout a tensor was saved under, as the manifest records it, and the one rule that turns
//! it into pieces: which rank writes which global region, in which file. `save` plans its
//! pieces with it and validation recomputes them, so a manifest whose regions do not follow its
//! layout (two pieces' regions swapped, a region moved to another file) is refused even when
//! the pieces still tile the tensor.

use std::ops::Range;

use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{GlobalLayout, NdSbp, Region, Sbp, Shape};
use serde::{Deserialize, Serialize};

/// The layout of a tensor saved in pieces: its placement's mesh and ranks and, per mesh axis,
/// `S(d)` or `B` (partial sums are reduced before saving, so never `P`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutEntry {
    /// The mesh shape.
    pub mesh: Vec<usize>,
    /// The world ranks of the mesh in row-major order.
    pub ranks: Vec<usize>,
    /// Per mesh axis: `S(d)` or `B`.
    pub sbp: Vec<String>,
}

/// The data file a rank writes.
pub(crate) fn file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

impl LayoutEntry {
    /// The record of a layout without partial sums.
    pub(crate) fn of(layout: &GlobalLayout) -> LayoutEntry {
        LayoutEntry {
            mesh: layout.placement().shape().to_vec(),
            ranks: layout.placement().ranks().to_vec(),
            sbp: layout.nd_sbp().iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The layout this record describes for a tensor of `shape` (on a CPU placement: the
    /// device does not matter to regions).
    fn layout(&self, shape: &[usize]) -> Result<GlobalLayout, String> {
        let placement = Placement::new(DeviceType::Cpu, self.mesh.clone(), self.ranks.clone())
            .map_err(|e| format!("layout mesh {:?} ranks {:?}: {e}", self.mesh, self.ranks))?;
        let sbps = self
            .sbp
            .iter()
            .map(|s| match s.parse::<Sbp>() {
                Ok(sbp) if !sbp.is_partial() => Ok(sbp),
                Ok(_) => Err(format!(
                    "layout SBP {s}: a saved piece is never a partial sum"
                )),
                Err(e) => Err(format!("layout SBP {s:?}: {e}")),
            })
            .collect::<Result<Vec<Sbp>, String>>()?;
        GlobalLayout::new(
            Shape::new(shape.iter().copied()),
            &placement,
            NdSbp::new(sbps),
        )
        .map_err(|e| format!("layout {:?} of shape {shape:?}: {e}", self.sbp))
    }
}

/// The pieces of a tensor of `shape` saved under `record`: (writing rank, global region), in
/// mesh order. Of the copies along broadcast axes only mesh coordinate 0 writes; empty regions
/// are not written. (A tensor saved whole has no layout record and one piece.)
pub(crate) fn pieces_of(
    shape: &[usize],
    record: &LayoutEntry,
) -> Result<Vec<(usize, Region)>, String> {
    let layout = record.layout(shape)?;
    let sbps: Vec<Sbp> = layout.nd_sbp().iter().collect();
    let placement = layout.placement();
    let mut out = Vec::new();
    for (idx, &rank) in placement.ranks().iter().enumerate() {
        let coord = placement.coord_of_index(idx);
        if sbps
            .iter()
            .zip(&coord)
            .any(|(s, &c)| s.is_broadcast() && c != 0)
        {
            continue;
        }
        let region = layout.region_at(&coord);
        if region.iter().any(Range::is_empty) && !region.is_empty() {
            continue;
        }
        out.push((rank, region));
    }
    Ok(out)
}
