//! Plans: the steps of one boxing transition with their groups and bytes, `explain`, and the
//! cached `BoxingPlanner` that builds them.

use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, RwLock};

use oxiflow_dtype::DType;
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{GlobalLayout, NdSbp, Shape};
use rustc_hash::{FxHashMap, FxHasher};

use crate::search::axis_plan;
use crate::step::{partial_op, Step, StepKind};
use crate::strategy::p2p_intersections::plan_p2p;
use crate::BoxingError;

/// How a plan moves data overall.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Nothing to do.
    Identity,
    /// Single-axis collectives and local steps on the same placement.
    PerAxis,
    /// Point-to-point moves of slice intersections.
    PointToPoint,
}

/// A boxing plan: the same on every rank.
#[derive(Clone, Debug)]
pub struct Plan {
    pub from: GlobalLayout,
    pub to: GlobalLayout,
    pub dtype: DType,
    pub strategy: Strategy,
    pub steps: Vec<Step>,
}

impl Plan {
    /// The plan of `steps` from `from` to `to`.
    fn of(
        from: &GlobalLayout,
        to: &GlobalLayout,
        dtype: DType,
        strategy: Strategy,
        steps: Vec<Step>,
    ) -> Plan {
        let (from, to) = (from.clone(), to.clone());
        Plan {
            from,
            to,
            dtype,
            strategy,
            steps,
        }
    }
    /// Sum over steps of the most bytes a rank receives (the cost the planner minimises;
    /// device copies are not network bytes and do not count).
    pub fn bytes_max(&self) -> u64 {
        self.network_steps().map(|s| s.bytes_max).sum()
    }
    /// Bytes received summed over all ranks and steps.
    pub fn bytes_total(&self) -> u64 {
        self.network_steps().map(|s| s.bytes_total).sum()
    }
    /// The (sender, receiver) world-rank pairs of the plan's one-way steps (between disjoint
    /// placements), sorted: the channels `open_one_way` opens ahead of a run.
    pub fn one_way_pairs(&self) -> Vec<(usize, usize)> {
        let mut pairs: Vec<(usize, usize)> = self
            .steps
            .iter()
            .filter(|s| crate::strategy::p2p_intersections::is_one_way(s))
            .filter_map(|s| match &s.kind {
                StepKind::P2p(p) => Some(p.one_way_pairs()),
                _ => None,
            })
            .flatten()
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        pairs
    }
    fn network_steps(&self) -> impl Iterator<Item = &Step> {
        self.steps
            .iter()
            .filter(|s| !matches!(s.kind, StepKind::DeviceCopy { .. }))
    }

    /// The plan as text: one line per step with its groups, nd-SBPs and bytes.
    pub fn explain(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "boxing {} {}: {} {} -> {} {}",
            self.from.shape(),
            self.dtype,
            self.from.placement(),
            self.from.nd_sbp(),
            self.to.placement(),
            self.to.nd_sbp()
        );
        let _ = writeln!(
            s,
            "  strategy {:?}, {} step(s), bytes received: max {} per rank, total {}",
            self.strategy,
            self.steps.len(),
            self.bytes_max(),
            self.bytes_total()
        );
        for (i, st) in self.steps.iter().enumerate() {
            let _ = writeln!(s, "  step {}: {}", i + 1, st.describe());
            let _ = writeln!(
                s,
                "    {} -> {} | groups {:?} | bytes max {} per rank, total {}",
                st.before.nd_sbp(),
                st.after.nd_sbp(),
                st.groups,
                st.bytes_max,
                st.bytes_total
            );
            if let StepKind::P2p(p) = &st.kind {
                let remote = p.transfers.iter().filter(|t| t.src != t.dst).count();
                let _ = writeln!(
                    s,
                    "    union {:?}: {} transfer(s), {} remote{}",
                    p.union,
                    p.transfers.len(),
                    remote,
                    match p.reduce {
                        Some(op) => format!(", reducing P({}) sources", op.as_str()),
                        None => String::new(),
                    }
                );
            }
        }
        s
    }
}

/// Validates a transition; identical on every rank, no communication.
pub fn validate(from: &GlobalLayout, to: &GlobalLayout) -> Result<(), BoxingError> {
    if from.shape() != to.shape() {
        return Err(BoxingError::ShapeMismatch {
            from: from.to_string(),
            to: to.to_string(),
            from_shape: from.shape().to_string(),
            to_shape: to.shape().to_string(),
        });
    }
    for l in [from, to] {
        if partial_op(l.nd_sbp()).is_err() {
            return Err(BoxingError::MixedPartial {
                layout: l.to_string(),
                nd_sbp: l.nd_sbp().to_string(),
            });
        }
    }
    Ok(())
}

/// Builds a plan without the cache.
pub fn build_plan(
    from: &GlobalLayout,
    to: &GlobalLayout,
    dtype: DType,
) -> Result<Plan, BoxingError> {
    validate(from, to)?;
    let mut steps = Vec::new();
    let (fd, td) = (from.placement().device(), to.placement().device());
    let strategy;
    if fd == td {
        strategy = plan_same_device(from, to, dtype, &mut steps)?;
    } else if td == DeviceType::Cuda {
        // Copy first so the communication runs on the device.
        let moved = GlobalLayout::new(
            from.shape().clone(),
            &from.placement().with_device(td),
            from.nd_sbp().clone(),
        )?;
        steps.push(crate::strategy::device_copy::plan(from, &moved, dtype));
        strategy = plan_same_device(&moved, to, dtype, &mut steps)?;
    } else {
        let staged = GlobalLayout::new(
            to.shape().clone(),
            &to.placement().with_device(fd),
            to.nd_sbp().clone(),
        )?;
        strategy = plan_same_device(from, &staged, dtype, &mut steps)?;
        steps.push(crate::strategy::device_copy::plan(&staged, to, dtype));
    }
    let strategy = if steps.is_empty() {
        Strategy::Identity
    } else {
        strategy
    };
    Ok(Plan::of(from, to, dtype, strategy, steps))
}

/// A plan forced to one strategy on one placement (tests and benchmarks compare strategies):
/// `PerAxis` is the searched per-axis plan, `PointToPoint` the intersection plan. Errors when
/// the placements or devices differ.
pub fn build_plan_with(
    from: &GlobalLayout,
    to: &GlobalLayout,
    dtype: DType,
    strategy: Strategy,
) -> Result<Plan, BoxingError> {
    validate(from, to)?;
    if from.placement() != to.placement() {
        return Err(BoxingError::Local {
            op: format!("build_plan_with({strategy:?})"),
            detail: format!(
                "{} and {} are different placements",
                from.placement(),
                to.placement()
            ),
        });
    }
    let steps = match strategy {
        Strategy::Identity => Vec::new(),
        Strategy::PerAxis => axis_plan(from, to.nd_sbp(), dtype)?,
        Strategy::PointToPoint => vec![plan_p2p(from, to, dtype)],
    };
    Ok(Plan::of(from, to, dtype, strategy, steps))
}

fn plan_same_device(
    from: &GlobalLayout,
    to: &GlobalLayout,
    dtype: DType,
    steps: &mut Vec<Step>,
) -> Result<Strategy, BoxingError> {
    if from == to {
        return Ok(Strategy::Identity);
    }
    if from.placement() != to.placement() {
        steps.push(plan_p2p(from, to, dtype));
        return Ok(Strategy::PointToPoint);
    }
    let axis_steps = axis_plan(from, to.nd_sbp(), dtype)?;
    let axis_cost: u64 = axis_steps.iter().map(|s| s.bytes_max).sum();
    if axis_cost > 0 {
        let p2p = plan_p2p(from, to, dtype);
        // Ties go to the collectives.
        if p2p.bytes_max < axis_cost {
            steps.push(p2p);
            return Ok(Strategy::PointToPoint);
        }
    }
    steps.extend(axis_steps);
    Ok(Strategy::PerAxis)
}

/// Builds and caches plans by (from, to, dtype). Shared by all ops of a process.
#[derive(Default)]
pub struct BoxingPlanner {
    cache: RwLock<FxHashMap<u64, Vec<Arc<Plan>>>>,
}

fn key_hash(from: &GlobalLayout, to: &GlobalLayout, dtype: DType) -> u64 {
    let mut h = FxHasher::default();
    from.hash(&mut h);
    to.hash(&mut h);
    dtype.hash(&mut h);
    h.finish()
}

impl BoxingPlanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// The plan for `from -> to` of `dtype`, from the cache when present.
    pub fn plan(
        &self,
        from: &GlobalLayout,
        to: &GlobalLayout,
        dtype: DType,
    ) -> Result<Arc<Plan>, BoxingError> {
        let h = key_hash(from, to, dtype);
        {
            let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
            if let Some(bucket) = cache.get(&h) {
                if let Some(p) = bucket
                    .iter()
                    .find(|p| p.dtype == dtype && p.from == *from && p.to == *to)
                {
                    return Ok(p.clone());
                }
            }
        }
        let plan = Arc::new(build_plan(from, to, dtype)?);
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        let bucket = cache.entry(h).or_default();
        if let Some(p) = bucket
            .iter()
            .find(|p| p.dtype == dtype && p.from == *from && p.to == *to)
        {
            return Ok(p.clone());
        }
        bucket.push(plan.clone());
        Ok(plan)
    }

    /// Validates the parts of both layouts (nd-SBP length, split dims against the shape) and
    /// plans; every error is a `BoxingError`.
    pub fn plan_parts(
        &self,
        shape: &Shape,
        from: (&Placement, &NdSbp),
        to: (&Placement, &NdSbp),
        dtype: DType,
    ) -> Result<Arc<Plan>, BoxingError> {
        let f = GlobalLayout::new(shape.clone(), from.0, from.1.clone())?;
        let t = GlobalLayout::new(shape.clone(), to.0, to.1.clone())?;
        self.plan(&f, &t, dtype)
    }

    /// Number of cached plans.
    pub fn len(&self) -> usize {
        self.cache
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(Vec::len)
            .sum()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
