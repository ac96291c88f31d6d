//! Test harness: builds per-rank pieces of a known global array for any layout (P components
//! with random integer noise, B copies equal), runs boxing on the in-process backend (one
//! thread per rank), and reassembles the global value from the target pieces.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use oxiflow_boxing::{
    build_plan_with, execute, BoxingError, BoxingPlanner, HostData, HostPiece, Plan, Strategy,
};
use oxiflow_collectives::InProcessWorld;
use oxiflow_dtype::DType;
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{GlobalLayout, NdSbp, ReduceOp, Sbp, Shape};

/// A tiny deterministic generator (splitmix64) so tests need no extra dependency.
pub struct SplitMix(pub u64);
impl SplitMix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Integer-valued in -50..50.
    pub fn val(&mut self) -> f64 {
        self.below(100) as f64 - 50.0
    }
}

pub fn cpu(shape: &[usize], ranks: &[usize]) -> Placement {
    Placement::new(DeviceType::Cpu, shape.to_vec(), ranks.to_vec()).unwrap()
}

fn strides(shape: &Shape) -> Vec<usize> {
    shape.strides().to_vec()
}

/// Extracts the box `region` of a row-major global array.
pub fn extract(global: &[f64], shape: &Shape, region: &[std::ops::Range<usize>]) -> Vec<f64> {
    let st = strides(shape);
    let n: usize = region.iter().map(|r| r.len()).product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let mut idx: Vec<usize> = region.iter().map(|r| r.start).collect();
    loop {
        let off: usize = idx.iter().zip(&st).map(|(i, s)| i * s).sum();
        out.push(global[off]);
        let mut d = idx.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < region[d].end {
                break;
            }
            idx[d] = region[d].start;
        }
    }
}

/// Calls `f(flat_global_offset, i)` for the i-th element of `region` in row-major order.
fn for_each_in(shape: &Shape, region: &[std::ops::Range<usize>], mut f: impl FnMut(usize, usize)) {
    let st = strides(shape);
    let n: usize = region.iter().map(|r| r.len()).product();
    if n == 0 {
        return;
    }
    let mut idx: Vec<usize> = region.iter().map(|r| r.start).collect();
    for i in 0..n {
        let off: usize = idx.iter().zip(&st).map(|(a, s)| a * s).sum();
        f(off, i);
        let mut d = idx.len();
        while d > 0 {
            d -= 1;
            idx[d] += 1;
            if idx[d] < region[d].end {
                break;
            }
            idx[d] = region[d].start;
        }
    }
}

pub fn to_host(shape: Shape, v: Vec<f64>, dtype: DType) -> HostPiece {
    HostPiece::new(shape, HostData::F64(v).to_dtype(dtype)).unwrap()
}

pub fn from_host(p: &HostPiece) -> Vec<f64> {
    match p.data.to_dtype(DType::F64) {
        HostData::F64(v) => v,
        other => panic!("to_dtype(f64) gave {}", other.dtype()),
    }
}

pub fn partial_key(nd: &NdSbp, coord: &[usize]) -> Vec<usize> {
    nd.iter()
        .zip(coord)
        .filter(|(s, _)| s.is_partial())
        .map(|(_, &c)| c)
        .collect()
}

fn op_of(nd: &NdSbp) -> Option<ReduceOp> {
    nd.iter().find_map(|s| s.partial_op())
}

/// The local piece of every rank of `layout` for the global array `global`: S/B as sliced; P
/// components carry random integer noise that reduces back to `global`.
pub fn make_pieces(
    layout: &GlobalLayout,
    global: &[f64],
    dtype: DType,
    rng: &mut SplitMix,
) -> BTreeMap<usize, HostPiece> {
    let shape = layout.shape();
    let pl = layout.placement();
    let nd = layout.nd_sbp();
    let n = shape.numel();
    // One global array per P component.
    let mut comps: BTreeMap<Vec<usize>, Vec<f64>> = BTreeMap::new();
    for idx in 0..pl.num_ranks() {
        comps
            .entry(partial_key(nd, &pl.coord_of_index(idx)))
            .or_default();
    }
    let keys: Vec<Vec<usize>> = comps.keys().cloned().collect();
    match op_of(nd) {
        None => {
            comps.insert(keys[0].clone(), global.to_vec());
        }
        Some(ReduceOp::Sum) => {
            // 16-bit floats hold integers exactly only up to 256: smaller noise keeps every
            // partial sum exact.
            let spread = if dtype.is_half() { 9 } else { 100 };
            let mut rest = global.to_vec();
            for k in keys.iter().skip(1) {
                let noise: Vec<f64> = (0..n)
                    .map(|_| rng.below(spread) as f64 - (spread / 2) as f64)
                    .collect();
                rest.iter_mut().zip(&noise).for_each(|(r, x)| *r -= x);
                comps.insert(k.clone(), noise);
            }
            comps.insert(keys[0].clone(), rest);
        }
        Some(op) => {
            // One component (chosen at random) holds the value, the others lower (max) /
            // higher (min) values.
            let holder = rng.below(keys.len() as u64) as usize;
            for (i, k) in keys.iter().enumerate() {
                let v = if i == holder {
                    global.to_vec()
                } else {
                    global
                        .iter()
                        .map(|&x| {
                            if op == ReduceOp::Max {
                                x - rng.below(5) as f64
                            } else {
                                x + rng.below(5) as f64
                            }
                        })
                        .collect()
                };
                comps.insert(k.clone(), v);
            }
        }
    }
    pieces_of_components(layout, &comps, dtype)
}

/// The local piece of every rank of `layout` whose P component (keyed by `partial_key`) is
/// the global array `comps[key]`.
pub fn pieces_of_components(
    layout: &GlobalLayout,
    comps: &BTreeMap<Vec<usize>, Vec<f64>>,
    dtype: DType,
) -> BTreeMap<usize, HostPiece> {
    let (shape, pl, nd) = (layout.shape(), layout.placement(), layout.nd_sbp());
    let mut out = BTreeMap::new();
    for (idx, &r) in pl.ranks().iter().enumerate() {
        let coord = pl.coord_of_index(idx);
        let comp = &comps[&partial_key(nd, &coord)];
        let region = layout.region_at(&coord);
        out.insert(
            r,
            to_host(
                layout.local_shape_at(&coord),
                extract(comp, shape, &region),
                dtype,
            ),
        );
    }
    out
}

/// Reassembles the global value of `layout` from its pieces. Errors (as text) when a piece is
/// missing or has the wrong shape, or when B copies disagree.
pub fn reassemble(
    layout: &GlobalLayout,
    pieces: &BTreeMap<usize, HostPiece>,
) -> Result<Vec<f64>, String> {
    let shape = layout.shape();
    let pl = layout.placement();
    let nd = layout.nd_sbp();
    let n = shape.numel();
    let mut comps: BTreeMap<Vec<usize>, Vec<Option<f64>>> = BTreeMap::new();
    for (idx, &r) in pl.ranks().iter().enumerate() {
        let coord = pl.coord_of_index(idx);
        let piece = pieces
            .get(&r)
            .ok_or(format!("rank {r} has no target piece"))?;
        let expect = layout.local_shape_at(&coord);
        if piece.shape != expect {
            return Err(format!(
                "rank {r}: piece shape {} expected {}",
                piece.shape, expect
            ));
        }
        let vals = from_host(piece);
        let comp = comps
            .entry(partial_key(nd, &coord))
            .or_insert_with(|| vec![None; n]);
        let region = layout.region_at(&coord);
        let mut err = None;
        for_each_in(shape, &region, |off, i| match comp[off] {
            Some(v) if v != vals[i] => {
                err = Some(format!(
                    "rank {r}: B copies disagree at {off}: {v} vs {}",
                    vals[i]
                ))
            }
            _ => comp[off] = Some(vals[i]),
        });
        if let Some(e) = err {
            return Err(e);
        }
    }
    let op = op_of(nd);
    let mut acc: Option<Vec<f64>> = None;
    for (k, c) in comps {
        let c: Vec<f64> = c
            .into_iter()
            .enumerate()
            .map(|(i, v)| v.ok_or(format!("component {k:?} misses element {i}")))
            .collect::<Result<_, _>>()?;
        acc = Some(match acc {
            None => c,
            Some(a) => a
                .iter()
                .zip(&c)
                .map(|(&x, &y)| match op {
                    Some(ReduceOp::Max) => x.max(y),
                    Some(ReduceOp::Min) => x.min(y),
                    _ => x + y,
                })
                .collect(),
        });
    }
    Ok(acc.unwrap_or_default())
}

/// One boxing case: from, to, dtype and the global array.
pub struct Case {
    pub from: GlobalLayout,
    pub to: GlobalLayout,
    pub dtype: DType,
    pub global: Vec<f64>,
    pub seed: u64,
    /// Force a strategy (same placement only) instead of the planner's choice.
    pub force: Option<Strategy>,
}

impl Case {
    /// `global` (of `shape` on `pl`) boxed from `sbps.0` to `sbps.1`, in a dtype and with a
    /// seed drawn from `rng` (in that order), the strategy forced to `force`.
    pub fn on(
        pl: &Placement,
        shape: &Shape,
        sbps: (impl Into<NdSbp>, impl Into<NdSbp>),
        global: &[f64],
        rng: &mut SplitMix,
        force: Option<Strategy>,
    ) -> Case {
        Case {
            from: GlobalLayout::new(shape.clone(), pl, sbps.0).unwrap(),
            to: GlobalLayout::new(shape.clone(), pl, sbps.1).unwrap(),
            dtype: dtype_of(rng.next()),
            global: global.to_vec(),
            seed: rng.next(),
            force,
        }
    }

    /// [`Case::on`] of `sbps` under each of `forces`, in that order.
    pub fn each_force(
        pl: &Placement,
        shape: &Shape,
        sbps: (&NdSbp, &NdSbp),
        global: &[f64],
        rng: &mut SplitMix,
        forces: &[Option<Strategy>],
    ) -> Vec<Case> {
        forces
            .iter()
            .map(|&force| {
                let pair = (sbps.0.clone(), sbps.1.clone());
                Case::on(pl, shape, pair, global, rng, force)
            })
            .collect()
    }
}

/// Runs every case in sequence on an in-process world of `world` ranks (one thread per rank,
/// SPMD) and checks each target's global value. Returns a failure description.
pub fn run_cases(world: usize, cases: Vec<Case>) -> Result<(), String> {
    let planner = Arc::new(BoxingPlanner::new());
    let mut plans: Vec<Arc<Plan>> = Vec::new();
    let mut inputs: Vec<BTreeMap<usize, HostPiece>> = Vec::new();
    for c in &cases {
        let plan = match c.force {
            None => planner.plan(&c.from, &c.to, c.dtype),
            Some(s) => build_plan_with(&c.from, &c.to, c.dtype, s).map(Arc::new),
        }
        .map_err(|e| format!("plan {} -> {}: {e}", c.from, c.to))?;
        plans.push(plan);
        inputs.push(make_pieces(
            &c.from,
            &c.global,
            c.dtype,
            &mut SplitMix(c.seed),
        ));
    }
    let comms = InProcessWorld::new(world, Duration::from_secs(30));
    let inputs = Arc::new(inputs);
    let plans = Arc::new(plans);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let inputs = inputs.clone();
            let plans = plans.clone();
            std::thread::spawn(move || -> Vec<Result<Option<HostPiece>, BoxingError>> {
                let mut out = Vec::new();
                for (i, plan) in plans.iter().enumerate() {
                    let res = execute(plan, &comm, inputs[i].get(&r).cloned());
                    let failed = res.is_err();
                    out.push(res);
                    if failed {
                        break;
                    }
                }
                out
            })
        })
        .collect();
    let results: Vec<Vec<_>> = handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect();
    for (i, c) in cases.iter().enumerate() {
        let mut target = BTreeMap::new();
        for (r, res) in results.iter().enumerate() {
            match res.get(i) {
                None => {
                    return Err(format!(
                        "case {i} {} -> {}: rank {r} stopped early",
                        c.from, c.to
                    ))
                }
                Some(Err(e)) => {
                    return Err(format!("case {i} {} -> {}: rank {r}: {e}", c.from, c.to))
                }
                Some(Ok(Some(p))) => {
                    if !c.to.placement().contains(r) {
                        return Err(format!("case {i}: rank {r} outside the target got a piece"));
                    }
                    target.insert(r, p.clone());
                }
                Some(Ok(None)) => {}
            }
        }
        let got = reassemble(&c.to, &target).map_err(|e| {
            format!(
                "case {i} {} -> {} ({}):\n{}\n{e}",
                c.from,
                c.to,
                c.dtype,
                plans[i].explain()
            )
        })?;
        if got != c.global {
            return Err(format!(
                "case {i} {} -> {} ({}): value changed\n{}\nwant {:?}\ngot  {:?}",
                c.from,
                c.to,
                c.dtype,
                plans[i].explain(),
                c.global,
                got
            ));
        }
    }
    Ok(())
}

/// Runs the boxing `from -> to` of `inputs` on an in-process world of `world` ranks (one
/// thread per rank) and returns the target pieces.
pub fn box_pieces(
    world: usize,
    from: &GlobalLayout,
    to: &GlobalLayout,
    dtype: DType,
    inputs: BTreeMap<usize, HostPiece>,
) -> Result<BTreeMap<usize, HostPiece>, String> {
    let plan = BoxingPlanner::new()
        .plan(from, to, dtype)
        .map_err(|e| format!("plan {from} -> {to}: {e}"))?;
    let inputs = Arc::new(inputs);
    let handles: Vec<_> = InProcessWorld::new(world, Duration::from_secs(30))
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let (plan, inputs) = (plan.clone(), inputs.clone());
            std::thread::spawn(move || (r, execute(&plan, &comm, inputs.get(&r).cloned())))
        })
        .collect();
    let mut out = BTreeMap::new();
    for h in handles {
        let (r, res) = h.join().map_err(|_| "rank thread panicked".to_string())?;
        if let Some(p) = res.map_err(|e| format!("{from} -> {to}: rank {r}: {e}"))? {
            out.insert(r, p);
        }
    }
    Ok(out)
}

pub fn random_global(shape: &Shape, rng: &mut SplitMix) -> Vec<f64> {
    (0..shape.numel()).map(|_| rng.val()).collect()
}

/// A random `[d0, d1]` tensor over ranks 0..n of a 1-d mesh: the generator seeded `seed` (past
/// the values), the shape, the placement and the global values.
pub fn random_on_line(
    n: usize,
    (d0, d1): (usize, usize),
    seed: u64,
) -> (SplitMix, Shape, Placement, Vec<f64>) {
    let mut rng = SplitMix(seed);
    let shape = Shape::from([d0, d1]);
    let pl = cpu(&[n], &(0..n).collect::<Vec<_>>());
    let global = random_global(&shape, &mut rng);
    (rng, shape, pl, global)
}

pub fn sbps_2d() -> Vec<Sbp> {
    vec![Sbp::S(0), Sbp::S(1), Sbp::B, Sbp::P]
}

pub fn dtype_of(i: u64) -> DType {
    DType::ALL[(i % DType::ALL.len() as u64) as usize]
}
