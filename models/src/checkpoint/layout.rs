//! The layout a tensor was saved under, as the manifest records it, and the one rule that turns
//! it into pieces: which rank writes which global region, in which file. `save` plans its
//! pieces with it and validation recomputes them, so a manifest whose regions do not follow its
//! layout (two pieces' regions swapped, a region moved to another file) is refused even when
//! the pieces still tile the tensor.

use std::ops::Range;

use oxiflow_placement::{DeviceType, NamedMesh, Placement};
use oxiflow_sbp::{GlobalLayout, NdSbp, Region, Sbp, Shape};
use serde::{Deserialize, Serialize};

/// The layout of a tensor saved in pieces: its placement's mesh and ranks, the names of the mesh
/// axes when the job named them and, per mesh axis, `S(d)` or `B` (partial sums are reduced
/// before saving, so never `P`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutEntry {
    /// The mesh shape.
    pub mesh: Vec<usize>,
    /// The world ranks of the mesh in row-major order.
    pub ranks: Vec<usize>,
    /// Per mesh axis: `S(d)` or `B`.
    pub sbp: Vec<String>,
    /// Per mesh axis: its name (`dp`, `tp`, ...); None for a placement the saving job did not
    /// name (and in checkpoints written before axes had names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axes: Option<Vec<String>>,
}

/// The data file a rank writes.
pub(crate) fn file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

impl LayoutEntry {
    /// The record of a layout without partial sums, its axes named after the one of `meshes`
    /// on its placement.
    pub(crate) fn of(layout: &GlobalLayout, meshes: &[NamedMesh]) -> LayoutEntry {
        let axes = meshes
            .iter()
            .find(|m| m.placement() == layout.placement())
            .map(|m| m.axes().iter().map(|a| a.name().to_string()).collect());
        LayoutEntry {
            mesh: layout.placement().shape().to_vec(),
            ranks: layout.placement().ranks().to_vec(),
            sbp: layout.nd_sbp().iter().map(|s| s.to_string()).collect(),
            axes,
        }
    }

    /// The mesh as messages show it: `[dp 2, tp 2]` with named axes, else `[2, 2]`.
    pub fn mesh_text(&self) -> String {
        match &self.axes {
            Some(names) => {
                let axes: Vec<String> = names
                    .iter()
                    .zip(&self.mesh)
                    .map(|(name, n)| format!("{name} {n}"))
                    .collect();
                format!("[{}]", axes.join(", "))
            }
            None => format!("{:?}", self.mesh),
        }
    }

    /// Refuses axis names that are not one non-empty, distinct name per mesh axis.
    fn check_axes(&self) -> Result<(), String> {
        let Some(names) = &self.axes else {
            return Ok(());
        };
        let bad = if names.len() != self.mesh.len() {
            Some(format!(
                "{} names for {} mesh axes",
                names.len(),
                self.mesh.len()
            ))
        } else if let Some(n) = names.iter().find(|n| n.is_empty()) {
            Some(format!("an empty name {n:?}"))
        } else {
            names
                .iter()
                .enumerate()
                .find(|(i, n)| names[..*i].contains(n))
                .map(|(_, n)| format!("{n} named twice"))
        };
        match bad {
            Some(why) => Err(format!(
                "layout axes {names:?} of mesh {:?}: {why}",
                self.mesh
            )),
            None => Ok(()),
        }
    }

    /// The layout this record describes for a tensor of `shape` (on a CPU placement: the
    /// device does not matter to regions).
    fn layout(&self, shape: &[usize]) -> Result<GlobalLayout, String> {
        self.check_axes()?;
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
