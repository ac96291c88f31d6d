//! `InferEngine`: validates an op call, enumerates its n-d candidates, picks the one whose input
//! boxing costs the fewest bytes, and caches the choice in a `SignatureCache`.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use oxiflow_placement::Placement;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::{for_each_nd, rules, OpKind, Rules};
use crate::cost::inference_cost_parts;
use crate::{check_nd_sbp, NdSbp, SbpError, Shape};

/// The chosen nd-SBP of every input and output of one op call, the output shapes, and its cost:
/// the sum over inputs of `inference_cost` (per-rank bytes of boxing the input to it, as
/// `transition_cost` estimates, plus the deferred reduction of any S -> P).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    pub inputs: Vec<NdSbp>,
    pub outputs: Vec<NdSbp>,
    pub output_shapes: Vec<Shape>,
    pub cost: u64,
}

impl fmt::Display for Signature {
    /// `(S(0), B), B -> (S(0), B)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_list(f, &self.inputs)?;
        f.write_str(" -> ")?;
        write_list(f, &self.outputs)
    }
}

fn write_list(f: &mut fmt::Formatter<'_>, xs: &[NdSbp]) -> fmt::Result {
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{x}")?;
    }
    Ok(())
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    op: OpKind,
    inputs: SmallVec<[(Shape, NdSbp); 3]>,
    placement: Placement,
    elem_size: usize,
}

impl CacheKey {
    fn new(
        op: &OpKind,
        inputs: &[(&Shape, &NdSbp)],
        placement: &Placement,
        elem_size: usize,
    ) -> Self {
        CacheKey {
            op: op.clone(),
            inputs: inputs
                .iter()
                .map(|(s, n)| ((*s).clone(), (*n).clone()))
                .collect(),
            placement: placement.clone(),
            elem_size,
        }
    }
}

/// Signatures keyed by (op with attributes, input shapes and nd-SBPs, placement, element
/// size), in an `FxHashMap`. When it reaches its entry limit it is emptied (inference is a pure
/// function, so that changes no result, only speed).
pub struct SignatureCache {
    map: FxHashMap<CacheKey, Arc<Signature>>,
    limit: usize,
}

impl SignatureCache {
    /// The default entry limit.
    pub const DEFAULT_LIMIT: usize = 1 << 20;

    pub fn new() -> Self {
        Self::with_limit(Self::DEFAULT_LIMIT)
    }
    pub fn with_limit(limit: usize) -> Self {
        SignatureCache {
            map: FxHashMap::default(),
            limit: limit.max(1),
        }
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn clear(&mut self) {
        self.map.clear();
    }
    fn get(&self, key: &CacheKey) -> Option<Arc<Signature>> {
        self.map.get(key).cloned()
    }
    fn insert(&mut self, key: CacheKey, sig: Arc<Signature>) {
        if self.map.len() >= self.limit {
            self.map.clear();
        }
        self.map.insert(key, sig);
    }
}

impl Default for SignatureCache {
    fn default() -> Self {
        Self::new()
    }
}

/// Signature inference with a cache. `infer` takes `&self` (the cache sits behind a mutex that
/// is held only for the lookup and the insert), so one engine can serve many threads.
///
/// All inputs must share one placement: the tensor layer boxes inputs on different placements
/// to a common one before it calls `infer`.
pub struct InferEngine {
    cache: Mutex<SignatureCache>,
}

impl Default for InferEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl InferEngine {
    pub fn new() -> Self {
        Self::with_cache_limit(SignatureCache::DEFAULT_LIMIT)
    }
    pub fn with_cache_limit(limit: usize) -> Self {
        InferEngine {
            cache: Mutex::new(SignatureCache::with_limit(limit)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SignatureCache> {
        // A poisoned cache is still a valid cache: entries are inserted whole.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of cached signatures.
    pub fn cache_len(&self) -> usize {
        self.lock().len()
    }
    pub fn clear_cache(&self) {
        self.lock().clear();
    }

    /// The signature of `op` on `inputs` (shape and current nd-SBP of each) over `placement`:
    /// the candidate whose input boxing costs the fewest bytes (`inference_cost`, elements of
    /// `elem_size` bytes), ties broken by fewer boxed (input, mesh axis) pairs, then by
    /// candidate order; so inputs that already fit a candidate are never touched, and every
    /// rank picks the same signature. Cached.
    pub fn infer(
        &self,
        op: &OpKind,
        inputs: &[(&Shape, &NdSbp)],
        placement: &Placement,
        elem_size: usize,
    ) -> Result<Arc<Signature>, SbpError> {
        let key = CacheKey::new(op, inputs, placement, elem_size);
        if let Some(sig) = self.lock().get(&key) {
            return Ok(sig);
        }
        let sig = Arc::new(Self::infer_uncached(op, inputs, placement, elem_size)?);
        self.lock().insert(key, sig.clone());
        Ok(sig)
    }

    /// `infer` without the cache.
    pub fn infer_uncached(
        op: &OpKind,
        inputs: &[(&Shape, &NdSbp)],
        placement: &Placement,
        elem_size: usize,
    ) -> Result<Signature, SbpError> {
        let name = op.to_string();
        check_inputs(&name, inputs, placement)?;
        let shapes: SmallVec<[&Shape; 3]> = inputs.iter().map(|(s, _)| *s).collect();
        let r = op_rules(op, &shapes, Some(inputs), placement)?;
        Self::choose(&name, r, inputs, placement, elem_size)
    }

    /// The signature among `rules`' candidates (built in `RuleMode::Candidates` by the op's
    /// rule builder for these input shapes; all-B is added when missing) whose input boxing
    /// costs the fewest bytes, with the tie-breaks of `infer`. Uncached: callers that cache
    /// their own plans use this. `op` names the op in errors.
    pub fn choose(
        op: &str,
        mut rules: Rules,
        inputs: &[(&Shape, &NdSbp)],
        placement: &Placement,
        elem_size: usize,
    ) -> Result<Signature, SbpError> {
        check_inputs(op, inputs, placement)?;
        rules.push_all_broadcast(inputs.len());
        let mesh = placement.shape();
        let mut best: Option<(u64, usize, Vec<NdSbp>, Vec<NdSbp>)> = None;
        for_each_nd(&rules, placement, |ins, outs| {
            let mut cost = 0u64;
            let mut steps = 0usize;
            for ((shape, from), to) in inputs.iter().zip(ins) {
                cost = cost.saturating_add(inference_cost_parts(shape, mesh, from, to, elem_size));
                steps += from.iter().zip(to.iter()).filter(|(a, b)| a != b).count();
                if best.as_ref().is_some_and(|b| cost > b.0) {
                    return;
                }
            }
            if best.as_ref().is_none_or(|b| (cost, steps) < (b.0, b.1)) {
                best = Some((cost, steps, ins.to_vec(), outs.to_vec()));
            }
        });
        let shapes: SmallVec<[&Shape; 3]> = inputs.iter().map(|(s, _)| *s).collect();
        let (cost, _, inputs_nd, outputs) = best.ok_or_else(|| {
            op_error(
                op,
                &shapes,
                Some(inputs),
                placement,
                "no candidate signature",
            )
        })?;
        Ok(Signature {
            inputs: inputs_nd,
            outputs,
            output_shapes: rules.out_shapes().to_vec(),
            cost,
        })
    }

    /// Every n-d candidate of `op` for these input shapes over `placement`, in the order the
    /// engine considers them (cost 0: no current layout is given).
    pub fn candidates(
        op: &OpKind,
        shapes: &[&Shape],
        placement: &Placement,
    ) -> Result<Vec<Signature>, SbpError> {
        let r = op_rules(op, shapes, None, placement)?;
        let mut out = Vec::new();
        for_each_nd(&r, placement, |ins, outs| {
            out.push(Signature {
                inputs: ins.to_vec(),
                outputs: outs.to_vec(),
                output_shapes: r.out_shapes().to_vec(),
                cost: 0,
            })
        });
        Ok(out)
    }

    /// Output shapes of `op` for these input shapes (shape inference alone).
    pub fn output_shapes(op: &OpKind, shapes: &[&Shape]) -> Result<Vec<Shape>, SbpError> {
        rules(op, shapes)
            .map(|r| r.out_shapes().to_vec())
            .map_err(|detail| SbpError::Op {
                op: op.to_string(),
                detail,
                shapes: shape_list(shapes),
                sbps: "-".into(),
                placement: "-".into(),
            })
    }
}

fn op_rules(
    op: &OpKind,
    shapes: &[&Shape],
    inputs: Option<&[(&Shape, &NdSbp)]>,
    placement: &Placement,
) -> Result<Rules, SbpError> {
    rules(op, shapes)
        .map_err(|detail| op_error(&op.to_string(), shapes, inputs, placement, &detail))
}

/// Each input's nd-SBP fits its shape and the placement.
fn check_inputs(
    op: &str,
    inputs: &[(&Shape, &NdSbp)],
    placement: &Placement,
) -> Result<(), SbpError> {
    for (index, (shape, nd)) in inputs.iter().enumerate() {
        check_nd_sbp(shape, placement, nd).map_err(|e| SbpError::Input {
            op: op.to_string(),
            index,
            source: Box::new(e),
        })?;
    }
    Ok(())
}

fn shape_list(shapes: &[&Shape]) -> String {
    let v: Vec<String> = shapes.iter().map(|s| s.to_string()).collect();
    v.join(", ")
}

fn op_error(
    op: &str,
    shapes: &[&Shape],
    inputs: Option<&[(&Shape, &NdSbp)]>,
    placement: &Placement,
    detail: &str,
) -> SbpError {
    let sbps = match inputs {
        Some(inputs) => {
            let v: Vec<String> = inputs.iter().map(|(_, n)| n.to_string()).collect();
            v.join(", ")
        }
        None => "-".into(),
    };
    SbpError::Op {
        op: op.to_string(),
        detail: detail.to_string(),
        shapes: shape_list(shapes),
        sbps,
        placement: placement.to_string(),
    }
}
