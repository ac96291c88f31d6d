//! Eager dispatch, the one path every op takes: metadata checks, then for global operands the
//! cached (signature, boxing plans, local attributes) of the call, boxing of the inputs, the
//! local kernel, and the output's layout; finally the observers (`observe`: autograd, capture,
//! explain, trace), when any is on.
//!
//! Ops on global tensors of different placements fail with `TensorError::Placement` naming both
//! placements (move one explicitly with `to_global(&placement, sbp)`); mixing local and global
//! operands fails with `TensorError::Mixed`. All checks use metadata only and run before any
//! communication, so every rank raises the same error.

use std::sync::{Arc, Mutex, MutexGuard};

use oxiflow_boxing::{execute, Plan, Strategy};
use oxiflow_dtype::DType;
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{GlobalLayout, NdSbp, Region, SbpError, Shape};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use oxiflow_sbp::{InferEngine, RuleMode};

use crate::context::Context;
use crate::cpu::CpuPiece;
use crate::device::{backend_for, registered_backends};
use crate::executor::{backend_id, run_kernel, run_kernel_one};
use crate::observe::{self, BoxingEvent, GlobalCall, OpCall};
use crate::op::{full_region, meta_err, CallSite, Inferred, LocalAt, Op, OutSpec};
use crate::storage::{Device, Storage};
use crate::tensor::{
    check_not_mixed, devices_text, placements_text, sbps_text, shapes_text, Tensor,
};
use crate::{Result, TensorError};

/// Cache key of a global op call: op with attributes, each input's (shape, nd-SBP, dtype), and
/// the placement. The context holding the cache fixes the rank.
#[derive(Clone, PartialEq, Eq, Hash)]
struct DispatchKey {
    op: Op,
    inputs: SmallVec<[(Shape, NdSbp, DType); 3]>,
    placement: Placement,
}

/// What a cached global op call does on this rank.
struct DispatchPlan {
    /// Boxing plan of each input; None when the input already has the signature's layout.
    boxing: SmallVec<[Option<Arc<Plan>>; 3]>,
    /// The op with this rank's local attributes.
    local_op: Op,
    /// Each output's layout and dtype.
    outs: SmallVec<[(GlobalLayout, DType); 1]>,
    /// This rank's piece shape and dtype of each output; None outside the placement.
    out_local: Option<SmallVec<[OutSpec; 1]>>,
}

/// A context's dispatch plans, kept in its cache slot.
#[derive(Default)]
struct PlanCache(Mutex<FxHashMap<DispatchKey, Arc<DispatchPlan>>>);

/// The plans of `ctx`, or a typed error naming `op` when its cache slot holds something else.
fn plans<'a>(
    op: &'static str,
    ctx: &'a Context,
) -> Result<MutexGuard<'a, FxHashMap<DispatchKey, Arc<DispatchPlan>>>> {
    let cache = ctx
        .cache::<PlanCache>()
        .ok_or_else(|| TensorError::Kernel {
            op,
            detail: "the context's cache slot holds no dispatch plans".into(),
        })?;
    Ok(cache.0.lock().unwrap_or_else(|e| e.into_inner()))
}

impl Context {
    /// Number of cached dispatch plans.
    pub fn dispatch_cache_len(&self) -> usize {
        plans("dispatch_cache_len", self).map_or(0, |p| p.len())
    }
}

pub(crate) fn sbp_err(
    op: &'static str,
    e: SbpError,
    inputs: &[&Tensor],
    placement: &Placement,
) -> TensorError {
    TensorError::Sbp {
        op,
        shapes: shapes_text(inputs),
        sbps: sbps_text(inputs),
        placement: placement.to_string(),
        detail: e.to_string(),
    }
}

/// The outputs of one op call (most ops have one).
type Outputs = SmallVec<[Tensor; 1]>;

/// How many outputs the caller takes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    One,
    All,
}

/// Runs a single-output `op` on `inputs` (all local or all global) and returns its output.
pub fn dispatch(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
    let out = run_op(op, inputs, Want::One)?;
    out.into_iter().next().ok_or_else(|| TensorError::Kernel {
        op: "dispatch",
        detail: "an op gave no output".into(),
    })
}

/// Runs `op` on `inputs` (all local or all global) and returns every output, in order. Outputs
/// an op marks as not differentiable (statistics saved for its backward) get no autograd
/// history.
pub fn dispatch_multi(op: Op, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    Ok(run_op(op, inputs, Want::All)?.into_vec())
}

fn run_op(op: Op, inputs: &[&Tensor], want: Want) -> Result<Outputs> {
    let Some(first) = inputs.first() else {
        return Err(TensorError::Shape {
            op: op.name(),
            shapes: String::new(),
            sbps: String::new(),
            detail: "no inputs".into(),
        });
    };
    let global = first.is_global();
    check_not_mixed(op.name(), inputs)?;
    let (lo, hi) = op.arity();
    if inputs.len() < lo || inputs.len() > hi {
        return Err(TensorError::Shape {
            op: op.name(),
            shapes: shapes_text(inputs),
            sbps: sbps_text(inputs),
            detail: format!("takes {lo}..={hi} inputs, got {}", inputs.len()),
        });
    }
    let observed = observe::any_on();
    if observed {
        observe::starting();
    }
    if global {
        dispatch_global(&op, inputs, want, observed)
    } else {
        dispatch_local(&op, inputs, want, observed)
    }
}

/// Shape, dtype and (in `Candidates` mode) SBP rules of `op` on `inputs`, with one dtype per
/// output shape and as many outputs as the caller takes.
pub(crate) fn infer(op: &Op, inputs: &[&Tensor], mode: RuleMode, want: Want) -> Result<Inferred> {
    let shapes: SmallVec<[&Shape; 3]> = inputs.iter().map(|t| t.shape()).collect();
    let dtypes: SmallVec<[DType; 3]> = inputs.iter().map(|t| t.dtype()).collect();
    let inferred = op
        .infer(&shapes, &dtypes, mode)
        .map_err(|e| meta_err(op, e, inputs))?;
    let n = inferred.rules.out_shapes().len();
    let bad = if n != inferred.dtypes.len() || n == 0 {
        Some(format!(
            "{n} output shapes and {} output dtypes",
            inferred.dtypes.len()
        ))
    } else if want == Want::One && n != 1 {
        Some(format!("{n} outputs: run it with dispatch_multi"))
    } else {
        None
    };
    match bad {
        Some(detail) => Err(TensorError::Kernel {
            op: op.name(),
            detail,
        }),
        None => Ok(inferred),
    }
}

fn check_devices(op: &Op, inputs: &[&Tensor]) -> Result<Device> {
    let dev = inputs[0].device();
    if inputs.iter().any(|t| t.device() != dev) {
        return Err(TensorError::Device {
            op: op.name(),
            devices: devices_text(inputs),
            shapes: shapes_text(inputs),
            detail: "operands live on different devices".into(),
        });
    }
    Ok(dev)
}

/// A typed error unless `op`, when an extern op, has a kernel on `device`'s backend for the
/// inputs' dtypes: metadata only, so every rank of a global call decides alike.
fn check_kernel(op: &Op, inputs: &[&Tensor], device: DeviceType) -> Result<()> {
    let Op::Extern(e) = op else {
        return Ok(());
    };
    let dtypes: SmallVec<[DType; 3]> = inputs.iter().map(|t| t.dtype()).collect();
    e.check_kernel(backend_id(op.name(), device)?, &dtypes)
}

fn dispatch_local(op: &Op, inputs: &[&Tensor], want: Want, observed: bool) -> Result<Outputs> {
    let device = check_devices(op, inputs)?;
    let Inferred { rules, dtypes } = infer(op, inputs, RuleMode::ShapesOnly, want)?;
    check_kernel(op, inputs, device.device_type())?;
    let mut pieces: SmallVec<[&Storage; 3]> = SmallVec::new();
    for t in inputs {
        match t.storage() {
            Some(s) => pieces.push(s),
            None => {
                return Err(TensorError::Kernel {
                    op: op.name(),
                    detail: "local tensor without storage".into(),
                })
            }
        }
    }
    let shapes: SmallVec<[&Shape; 3]> = inputs.iter().map(|t| t.shape()).collect();
    if let ([dtype], [shape]) = (dtypes.as_slice(), rules.out_shapes()) {
        let out = OutSpec {
            shape: shape.clone(),
            dtype: *dtype,
        };
        let local = local_call(op, &shapes, &out.shape);
        let local_op = local.as_ref().unwrap_or(op);
        let storage = run_kernel_one(local_op, &pieces, device, &out)?;
        // The executor allocated the piece from `out`, so it has `out`'s shape.
        if !observed {
            return Ok(smallvec::smallvec![Tensor::from_storage_of_shape(
                storage, out.shape
            )]);
        }
        let outs: Outputs =
            smallvec::smallvec![Tensor::from_storage_of_shape(storage, out.shape.clone())];
        let specs = std::slice::from_ref(&out);
        observe_local(op, local_op, inputs, device, specs, &outs);
        return Ok(outs);
    }
    let specs: SmallVec<[OutSpec; 1]> = rules
        .out_shapes()
        .iter()
        .zip(&dtypes)
        .map(|(shape, &dtype)| OutSpec {
            shape: shape.clone(),
            dtype,
        })
        .collect();
    let local = local_call(op, &shapes, &specs[0].shape);
    let local_op = local.as_ref().unwrap_or(op);
    let pieces = run_kernel(local_op, &pieces, device, &specs)?;
    let outs: Outputs = pieces
        .into_iter()
        .zip(&specs)
        .map(|(p, spec)| Tensor::from_storage_of_shape(p, spec.shape.clone()))
        .collect();
    if observed {
        observe_local(op, local_op, inputs, device, &specs, &outs);
    }
    Ok(outs)
}

/// Tells the observers of a local op call.
#[cold]
fn observe_local(
    op: &Op,
    local_op: &Op,
    inputs: &[&Tensor],
    device: Device,
    specs: &[OutSpec],
    outs: &[Tensor],
) {
    observe::op(&OpCall {
        op,
        local_op,
        inputs,
        outputs: outs,
        device,
        out_specs: Some(specs),
        global: None,
    });
}

/// Tells the observers of a global op call: the signature and boxing from `plan`, the pieces
/// boxing made (`boxed`).
#[cold]
fn observe_global(
    op: &Op,
    plan: &DispatchPlan,
    inputs: &[&Tensor],
    boxed: &[Option<Arc<Storage>>],
    ctx: &Context,
    outs: &[Tensor],
) {
    observe::op(&OpCall {
        op,
        local_op: &plan.local_op,
        inputs,
        outputs: outs,
        device: inputs[0].device(),
        out_specs: plan.out_local.as_deref(),
        global: Some(GlobalCall {
            boxing: &plan.boxing,
            boxed,
            outputs: &plan.outs,
            ctx,
        }),
    });
}

/// The op of a local call: whole tensors, no regions, so every start reads 0.
pub(crate) fn local_call(op: &Op, shapes: &[&Shape], out0: &Shape) -> Option<Op> {
    op.local(&LocalAt {
        global_inputs: shapes,
        input_regions: &[],
        out_global: out0,
        out_region: &Region::new(),
        out_local: out0,
        site: None,
    })
}

fn build_plan(
    op: &Op,
    inputs: &[&Tensor],
    ctx: &Context,
    placement: &Placement,
    want: Want,
) -> Result<DispatchPlan> {
    let Inferred { rules, dtypes } = infer(op, inputs, RuleMode::Candidates, want)?;
    check_kernel(op, inputs, placement.device())?;
    let layouts: SmallVec<[&GlobalLayout; 3]> = inputs.iter().filter_map(|t| t.layout()).collect();
    let sig_in: SmallVec<[(&Shape, &NdSbp); 3]> =
        layouts.iter().map(|l| (l.shape(), l.nd_sbp())).collect();
    let elem = inputs.iter().map(|t| t.dtype().size()).max().unwrap_or(4);
    let sig = InferEngine::choose(op.name(), rules, &sig_in, placement, elem)
        .map_err(|e| sbp_err(op.name(), e, inputs, placement))?;
    if sig.outputs.len() != dtypes.len() || sig.output_shapes.len() != dtypes.len() {
        return Err(TensorError::Sbp {
            op: op.name(),
            shapes: shapes_text(inputs),
            sbps: sbps_text(inputs),
            placement: placement.to_string(),
            detail: format!(
                "signature has {} outputs of {} shapes for {} dtypes",
                sig.outputs.len(),
                sig.output_shapes.len(),
                dtypes.len()
            ),
        });
    }
    let mut outs: SmallVec<[(GlobalLayout, DType); 1]> = SmallVec::new();
    for ((nd, shape), &dtype) in sig.outputs.iter().zip(&sig.output_shapes).zip(&dtypes) {
        let layout = GlobalLayout::new(shape.clone(), placement, nd.clone())
            .map_err(|e| sbp_err(op.name(), e, inputs, placement))?;
        outs.push((layout, dtype));
    }
    let mut boxing = SmallVec::new();
    for (i, l) in layouts.iter().enumerate() {
        let target = &sig.inputs[i];
        if target == l.nd_sbp() {
            boxing.push(None);
            continue;
        }
        let to = l
            .with_nd_sbp(target.clone())
            .map_err(|e| sbp_err(op.name(), e, inputs, placement))?;
        let plan =
            ctx.planner()
                .plan(l, &to, inputs[i].dtype())
                .map_err(|e| TensorError::Boxing {
                    op: op.name(),
                    from: l.to_string(),
                    to: to.to_string(),
                    detail: e.to_string(),
                })?;
        boxing.push(if plan.strategy == Strategy::Identity {
            None
        } else {
            Some(plan)
        });
    }
    let out_local: Option<SmallVec<[OutSpec; 1]>> = outs
        .iter()
        .map(|(l, dtype)| {
            l.local_shape(ctx.rank()).map(|shape| OutSpec {
                shape,
                dtype: *dtype,
            })
        })
        .collect();
    let shapes: SmallVec<[&Shape; 3]> = inputs.iter().map(|t| t.shape()).collect();
    // Local attributes read where this rank's pieces sit (output 0 for the output's).
    let out0 = &outs[0].0;
    let local_op = match (&out_local, out0.region_of(ctx.rank())) {
        (Some(out_pieces), Some(out_region)) => {
            let mut regions: SmallVec<[Region; 3]> = SmallVec::new();
            for (l, target) in layouts.iter().zip(&sig.inputs) {
                let region = l
                    .with_nd_sbp(target.clone())
                    .map_err(|e| sbp_err(op.name(), e, inputs, placement))?
                    .region_of(ctx.rank())
                    .unwrap_or_else(|| full_region(l.shape()));
                regions.push(region);
            }
            op.local(&LocalAt {
                global_inputs: &shapes,
                input_regions: &regions,
                out_global: out0.shape(),
                out_region: &out_region,
                out_local: &out_pieces[0].shape,
                site: Some(CallSite {
                    world: ctx.world(),
                    rank: ctx.rank(),
                    placement,
                    input_sbps: &sig.inputs,
                }),
            })
        }
        _ => None,
    }
    .unwrap_or_else(|| op.clone());
    Ok(DispatchPlan {
        boxing,
        local_op,
        outs,
        out_local,
    })
}

/// Runs a boxing plan on a tensor's piece; returns the new piece (None outside the target).
/// A registered device backend whose world this is runs it (device buffers); otherwise it runs
/// on the host, reading the tensor's CPU storage in place, so a piece the plan leaves unchanged
/// comes back as the same storage.
pub fn run_boxing(
    op: &'static str,
    plan: &Arc<Plan>,
    ctx: &Context,
    piece: Option<&Arc<Storage>>,
    device: Device,
) -> Result<Option<Arc<Storage>>> {
    let out = run_plan(op, plan, ctx, piece, device)?;
    observe::boxing(&BoxingEvent {
        op,
        plan,
        input: piece,
        output: out.as_ref(),
        device,
        ctx,
    });
    Ok(out)
}

fn run_plan(
    op: &'static str,
    plan: &Plan,
    ctx: &Context,
    piece: Option<&Arc<Storage>>,
    device: Device,
) -> Result<Option<Arc<Storage>>> {
    for backend in registered_backends() {
        if let Some(out) = backend.run_boxing(op, plan, ctx.world(), piece.map(|p| &**p)) {
            return out.map(|s| s.map(Arc::new));
        }
    }
    let host = piece.map(CpuPiece::from_storage).transpose()?;
    let out = execute(plan, ctx.world(), host).map_err(|e| TensorError::Boxing {
        op,
        from: plan.from.to_string(),
        to: plan.to.to_string(),
        detail: e.to_string(),
    })?;
    let Some(out) = out else {
        return Ok(None);
    };
    let storage = out.into_storage()?;
    match plan.to.placement().device() {
        DeviceType::Cpu => Ok(Some(storage)),
        DeviceType::Cuda => {
            let ordinal = match device {
                Device::Cuda(i) => i,
                Device::Cpu => 0,
            };
            let host = storage.cpu(op)?;
            let uploaded = backend_for(op, Device::Cuda(ordinal))?.from_host(host, ordinal)?;
            Ok(Some(Arc::new(Storage::Device(uploaded))))
        }
    }
}

/// The cached plan of a global call of `op` on `inputs` (built on the first call): its
/// signature's boxing of each input, the local op and the outputs' layouts.
fn global_plan<'t>(
    op: &Op,
    inputs: &[&'t Tensor],
    want: Want,
) -> Result<(Arc<DispatchPlan>, &'t Context)> {
    let (Some(placement), Some(ctx)) = (inputs[0].placement(), inputs[0].context()) else {
        return Err(TensorError::Kernel {
            op: op.name(),
            detail: "global tensor without layout".into(),
        });
    };
    let dev = placement.device();
    if inputs
        .iter()
        .any(|t| t.placement().is_some_and(|p| p.device() != dev))
    {
        return Err(TensorError::Device {
            op: op.name(),
            devices: placements_text(inputs),
            shapes: shapes_text(inputs),
            detail: format!(
                "operands are on different device types (nd-SBPs {})",
                sbps_text(inputs)
            ),
        });
    }
    if inputs.iter().any(|t| t.placement() != Some(placement)) {
        return Err(TensorError::Placement {
            op: op.name(),
            placements: placements_text(inputs),
            shapes: shapes_text(inputs),
            sbps: sbps_text(inputs),
        });
    }
    let key = DispatchKey {
        op: op.clone(),
        inputs: inputs
            .iter()
            .filter_map(|t| {
                t.layout()
                    .map(|l| (l.shape().clone(), l.nd_sbp().clone(), t.dtype()))
            })
            .collect(),
        placement: placement.clone(),
    };
    let cached = plans(op.name(), ctx)?.get(&key).cloned();
    let plan = match cached {
        Some(p) => p,
        None => {
            let p = Arc::new(build_plan(op, inputs, ctx, placement, want)?);
            plans(op.name(), ctx)?.insert(key, p.clone());
            p
        }
    };
    Ok((plan, ctx))
}

/// How a global call of an op runs into given tensors (see `in_place::dispatch_into`).
pub(crate) enum CallInto {
    /// Inference boxes an input or gives an output another layout than its target's: why.
    Refused(String),
    /// This rank holds no piece: nothing to run here.
    Outside,
    /// This rank runs the local op on its pieces.
    Local(Op),
}

/// How the global call of `op` on `inputs` runs with its outputs written over `targets`
/// (global tensors): only with the signature inference picks taking every input as it is and
/// giving every output its target's layout.
pub(crate) fn global_call_into(
    op: &Op,
    inputs: &[&Tensor],
    targets: &[&Tensor],
) -> Result<CallInto> {
    let (plan, _) = global_plan(op, inputs, Want::All)?;
    if let Some(i) = plan.boxing.iter().position(Option::is_some) {
        return Ok(CallInto::Refused(format!(
            "input {i} ({}) needs boxing",
            inputs[i].describe()
        )));
    }
    if plan.outs.len() != targets.len() {
        return Ok(CallInto::Refused(format!(
            "{} outputs for {} targets",
            plan.outs.len(),
            targets.len()
        )));
    }
    for (i, ((layout, dtype), t)) in plan.outs.iter().zip(targets).enumerate() {
        if t.layout() != Some(layout) || t.dtype() != *dtype {
            return Ok(CallInto::Refused(format!(
                "output {i} is {dtype} {layout}, target {}",
                t.describe()
            )));
        }
    }
    Ok(match plan.out_local {
        None => CallInto::Outside,
        Some(_) => CallInto::Local(plan.local_op.clone()),
    })
}

/// Runs `op` on global `inputs` (see [`dispatch`]).
fn dispatch_global(op: &Op, inputs: &[&Tensor], want: Want, observed: bool) -> Result<Outputs> {
    let (plan, ctx) = global_plan(op, inputs, want)?;
    if want == Want::One && plan.outs.len() != 1 {
        return Err(TensorError::Kernel {
            op: op.name(),
            detail: format!("{} outputs: run it with dispatch_multi", plan.outs.len()),
        });
    }
    let device = inputs[0].device();
    // Box the inputs that need it.
    let mut boxed: SmallVec<[Option<Arc<Storage>>; 3]> = SmallVec::new();
    for (t, b) in inputs.iter().zip(&plan.boxing) {
        boxed.push(match b {
            Some(bp) => run_boxing(op.name(), bp, ctx, t.0.piece.as_ref(), device)?,
            None => None,
        });
    }
    let outs = run_global_kernel(op, &plan, inputs, &boxed, ctx)?;
    if observed {
        observe_global(op, &plan, inputs, &boxed, ctx, &outs);
    }
    Ok(outs)
}

/// The local kernel of a global op call on the (boxed) pieces, and its outputs as global
/// tensors (pieceless outside the placement).
fn run_global_kernel(
    op: &Op,
    plan: &DispatchPlan,
    inputs: &[&Tensor],
    boxed: &[Option<Arc<Storage>>],
    ctx: &Context,
) -> Result<Outputs> {
    let device = inputs[0].device();
    let Some(out_local) = &plan.out_local else {
        // Outside the placement: no pieces.
        return Ok(plan
            .outs
            .iter()
            .map(|(layout, dtype)| {
                Tensor::global_from_piece(None, layout.clone(), *dtype, ctx.clone())
            })
            .collect());
    };
    let mut pieces: SmallVec<[&Storage; 3]> = SmallVec::new();
    for (t, b) in inputs.iter().zip(boxed) {
        match b.as_deref().or(t.storage()) {
            Some(p) => pieces.push(p),
            None => {
                return Err(TensorError::Kernel {
                    op: op.name(),
                    detail: format!(
                        "rank {} has no local piece of input {}",
                        ctx.rank(),
                        t.describe()
                    ),
                })
            }
        }
    }
    let checked = |out: Storage, i: usize| -> Result<Tensor> {
        let (layout, dtype) = &plan.outs[i];
        if out.shape() != out_local[i].shape {
            return Err(TensorError::Kernel {
                op: op.name(),
                detail: format!(
                    "local kernel gave {} but layout {layout} expects {} on rank {}",
                    out.shape(),
                    out_local[i].shape,
                    ctx.rank()
                ),
            });
        }
        Ok(Tensor::global_from_piece(
            Some(out),
            layout.clone(),
            *dtype,
            ctx.clone(),
        ))
    };
    if let [spec] = out_local.as_slice() {
        let out = run_kernel_one(&plan.local_op, &pieces, device, spec)?;
        return Ok(smallvec::smallvec![checked(out, 0)?]);
    }
    run_kernel(&plan.local_op, &pieces, device, out_local)?
        .into_iter()
        .enumerate()
        .map(|(i, out)| checked(out, i))
        .collect()
}
