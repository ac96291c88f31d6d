//! A cuDNN backend operation graph built op by op (tensors with unique ids, pointwise, matmul,
//! reduction and reshape operations), its execution plan (heuristics, then the first engine
//! configuration that finalizes, optionally only deterministic ones), and its execution with a
//! variant pack.

use std::ffi::c_void;

use cudarc::cudnn::sys::{
    cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as Ty,
    cudnnBackendDescriptorType_t as K, cudnnBackendHeurMode_t, cudnnBackendNumericalNote_t,
    cudnnDataType_t as Dt, cudnnPointwiseMode_t as Pw, cudnnReduceTensorOp_t as Red,
};

use super::ffi::{Api, Desc, Raw};
use crate::raw::{FResult, FusedError};

/// A tensor of the graph (its descriptor is `Graph::tensors[idx]`).
#[derive(Clone, Copy, Debug)]
pub(super) struct T {
    idx: usize,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
}

/// Row-major strides of `dims`.
pub(super) fn packed(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

pub(super) struct Graph {
    api: &'static Api,
    op: &'static str,
    tensors: Vec<Desc>,
    ops: Vec<Desc>,
    /// Descriptors the operations point to (pointwise, matmul, reduction settings).
    keep: Vec<Desc>,
    next_virtual: i64,
}

impl Graph {
    pub(super) fn new(api: &'static Api, op: &'static str) -> Graph {
        Graph {
            api,
            op,
            tensors: Vec::new(),
            ops: Vec::new(),
            keep: Vec::new(),
            next_virtual: 1000,
        }
    }

    fn tensor(
        &mut self,
        uid: i64,
        dims: [i64; 4],
        strides: [i64; 4],
        dt: Dt,
        virt: bool,
        by_value: bool,
    ) -> FResult<T> {
        let op = self.op;
        let d = self.desc(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor")?;
        self.data_type(&d, A::CUDNN_ATTR_TENSOR_DATA_TYPE, dt)?;
        d.i64s(op, A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
        d.i64s(op, A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
        d.i64s(op, A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
        d.i64s(op, A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
        if virt {
            d.boolean(op, A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, true)?;
        }
        if by_value {
            d.boolean(op, A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        d.finalize(op)?;
        self.tensors.push(d);
        Ok(T {
            idx: self.tensors.len() - 1,
            dims,
            strides,
        })
    }
    /// A tensor in device memory, bound by `uid` at execution.
    pub(super) fn io(&mut self, uid: i64, dims: [i64; 4], strides: [i64; 4], dt: Dt) -> FResult<T> {
        self.tensor(uid, dims, strides, dt, false, false)
    }
    /// An intermediate tensor that never reaches memory.
    pub(super) fn virt(&mut self, dims: [i64; 4], strides: [i64; 4], dt: Dt) -> FResult<T> {
        self.next_virtual += 1;
        self.tensor(self.next_virtual, dims, strides, dt, true, false)
    }
    /// A scalar passed by value (a host pointer in the variant pack).
    pub(super) fn scalar(&mut self, uid: i64, dt: Dt) -> FResult<T> {
        self.tensor(uid, [1; 4], [1; 4], dt, false, true)
    }

    /// A new descriptor of `kind` (`name`) for this graph.
    fn desc(&self, kind: K, name: &'static str) -> FResult<Desc> {
        Desc::new(self.api, self.op, kind, name)
    }
    /// Points attribute `attr` of operation `o` at tensor `t`.
    fn tensor_attr(&self, o: &Desc, attr: A, t: T) -> FResult<()> {
        o.descs(self.op, attr, &[&self.tensors[t.idx]])
    }
    /// Sets attribute `attr` of `d` to the data type `dt`.
    fn data_type(&self, d: &Desc, attr: A, dt: Dt) -> FResult<()> {
        d.enum_(self.op, attr, Ty::CUDNN_TYPE_DATA_TYPE, dt as u32)
    }
    /// Sets attribute `attr` of `d` to f32, the type its computation runs in.
    fn compute_in_f32(&self, d: &Desc, attr: A) -> FResult<()> {
        self.data_type(d, attr, Dt::CUDNN_DATA_FLOAT)
    }
    /// Finalizes operation `o` and adds it to the graph, with the finalized `settings`
    /// descriptor it points to (kept alive as long as the graph).
    fn add_op(&mut self, o: Desc, settings: Option<Desc>) -> FResult<()> {
        o.finalize(self.op)?;
        self.keep.extend(settings);
        self.ops.push(o);
        Ok(())
    }

    /// `y = mode(x [, b] [, t])` (`inputs` = x, b, t) computed in `prec` (`axis` for GEN_INDEX).
    pub(super) fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        inputs: &[T],
        y: T,
        axis: Option<i64>,
    ) -> FResult<()> {
        let (x, b, t) = (inputs[0], inputs.get(1).copied(), inputs.get(2).copied());
        let op = self.op;
        let pw = self.desc(K::CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise")?;
        pw.enum_(
            op,
            A::CUDNN_ATTR_POINTWISE_MODE,
            Ty::CUDNN_TYPE_POINTWISE_MODE,
            mode as u32,
        )?;
        self.data_type(&pw, A::CUDNN_ATTR_POINTWISE_MATH_PREC, prec)?;
        if let Some(a) = axis {
            pw.i64s(op, A::CUDNN_ATTR_POINTWISE_AXIS, &[a])?;
        }
        pw.finalize(op)?;
        let o = self.desc(
            K::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
            "pointwise op",
        )?;
        o.descs(op, A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)?;
        o.f32(op, A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0)?;
        o.f32(op, A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0)?;
        if let Some(b) = b {
            self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b)?;
        }
        if let Some(t) = t {
            self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t)?;
        }
        self.add_op(o, Some(pw))
    }
    /// `c = a b` (batched over the two leading dims), f32 accumulation.
    pub(super) fn matmul(&mut self, a: T, b: T, c: T) -> FResult<()> {
        let op = self.op;
        let mm = self.desc(K::CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul")?;
        self.compute_in_f32(&mm, A::CUDNN_ATTR_MATMUL_COMP_TYPE)?;
        mm.finalize(op)?;
        let o = self.desc(K::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul op")?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)?;
        o.descs(op, A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
        self.add_op(o, Some(mm))
    }
    /// `y = reduce(x)` over the dims where `y` has size 1, in f32.
    pub(super) fn reduction(&mut self, mode: Red, x: T, y: T) -> FResult<()> {
        let op = self.op;
        let r = self.desc(K::CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction")?;
        self.compute_in_f32(&r, A::CUDNN_ATTR_REDUCTION_COMP_TYPE)?;
        r.enum_(
            op,
            A::CUDNN_ATTR_REDUCTION_OPERATOR,
            Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            mode as u32,
        )?;
        r.finalize(op)?;
        let o = self.desc(
            K::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
            "reduction op",
        )?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)?;
        o.descs(op, A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&r])?;
        self.add_op(o, Some(r))
    }
    /// `y` is `x` under other dims and strides (a transpose view).
    pub(super) fn reshape(&mut self, x: T, y: T) -> FResult<()> {
        let o = self.desc(K::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape op")?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x)?;
        self.tensor_attr(&o, A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)?;
        self.add_op(o, None)
    }

    /// The operation graph on `handle` and its execution plan: the engine configurations of
    /// the heuristics (modes A, B, then the fallback list), then of every engine, tried in
    /// order; the first that finalizes wins (non-deterministic engines are skipped when
    /// `deterministic`).
    pub(super) fn plan(self, handle: Raw, deterministic: bool) -> FResult<Plan> {
        let (api, op) = (self.api, self.op);
        let g = Desc::new(
            api,
            op,
            K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
            "operation graph",
        )?;
        let ops: Vec<&Desc> = self.ops.iter().collect();
        g.descs(op, A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?;
        g.handle(op, A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
        g.finalize(op)?;
        let mut tried = Vec::new();
        let mut sources: Vec<(String, FResult<Vec<Desc>>)> = Vec::new();
        for mode in [
            cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B,
            cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            sources.push((format!("{mode:?}"), heuristics(api, op, &g, mode)));
        }
        sources.push(("every engine".into(), engines(api, op, &g)));
        for (source, configs) in sources {
            let configs = match configs {
                Ok(c) => c,
                Err(e) => {
                    tried.push(format!("{source}: {e}"));
                    continue;
                }
            };
            tried.push(format!("{source}: {} configurations", configs.len()));
            for (i, cfg) in configs.iter().enumerate() {
                if deterministic && !is_deterministic(api, op, cfg)? {
                    tried.push(format!("{source} #{i}: non-deterministic"));
                    continue;
                }
                match plan_of(api, op, handle, cfg) {
                    Ok((plan, workspace)) => {
                        return Ok(Plan {
                            plan,
                            workspace,
                            source: format!("{source} #{i}"),
                            _graph: g,
                            _tensors: self.tensors,
                            _ops: self.ops,
                            _keep: self.keep,
                        })
                    }
                    Err(e) => tried.push(format!("{source} #{i}: {e}")),
                }
            }
        }
        Err(FusedError::Refused {
            op,
            lib: "cuDNN",
            what: "every engine configuration".into(),
            detail: tried.join("; "),
        })
    }
}

fn heuristics(
    api: &'static Api,
    op: &'static str,
    g: &Desc,
    mode: cudnnBackendHeurMode_t,
) -> FResult<Vec<Desc>> {
    let h = Desc::new(
        api,
        op,
        K::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR,
        "heuristics",
    )?;
    h.descs(op, A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[g])?;
    h.enum_(
        op,
        A::CUDNN_ATTR_ENGINEHEUR_MODE,
        Ty::CUDNN_TYPE_HEUR_MODE,
        mode as u32,
    )?;
    h.finalize(op)?;
    // Created configurations are filled in order; the count says how many were.
    let mut configs = (0..32)
        .map(|_| {
            Desc::new(
                api,
                op,
                K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
                "engine config",
            )
        })
        .collect::<FResult<Vec<_>>>()?;
    let got = h.get_descs(op, A::CUDNN_ATTR_ENGINEHEUR_RESULTS, &configs)?;
    configs.truncate(got);
    Ok(configs)
}

/// A configuration of every engine cuDNN reports for `g` (by global index), each finalized
/// with its default knobs; engines that do not support the graph are skipped.
fn engines(api: &'static Api, op: &'static str, g: &Desc) -> FResult<Vec<Desc>> {
    let mut count = [0i64; 1];
    g.get(
        op,
        A::CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT,
        Ty::CUDNN_TYPE_INT64,
        &mut count,
    )?;
    let mut out = Vec::new();
    for i in 0..count[0].clamp(0, 256) {
        let e = Desc::new(api, op, K::CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine")?;
        e.descs(op, A::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, &[g])?;
        e.i64s(op, A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, &[i])?;
        if e.finalize(op).is_err() {
            continue;
        }
        let cfg = Desc::new(
            api,
            op,
            K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
            "engine config",
        )?;
        cfg.descs(op, A::CUDNN_ATTR_ENGINECFG_ENGINE, &[&e])?;
        if cfg.finalize(op).is_ok() {
            out.push(cfg);
        }
    }
    Ok(out)
}

/// Whether the engine of `cfg` carries no NONDETERMINISTIC numerical note.
fn is_deterministic(api: &'static Api, op: &'static str, cfg: &Desc) -> FResult<bool> {
    let engine = Desc::new(api, op, K::CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine")?;
    cfg.get_descs(
        op,
        A::CUDNN_ATTR_ENGINECFG_ENGINE,
        std::slice::from_ref(&engine),
    )?;
    let mut notes = [0u32; 16];
    let n = engine.get(
        op,
        A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        Ty::CUDNN_TYPE_NUMERICAL_NOTE,
        &mut notes,
    )?;
    let bad = cudnnBackendNumericalNote_t::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as u32;
    Ok(!notes[..n.min(16)].contains(&bad))
}

fn plan_of(api: &'static Api, op: &'static str, handle: Raw, cfg: &Desc) -> FResult<(Desc, usize)> {
    let p = Desc::new(
        api,
        op,
        K::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR,
        "execution plan",
    )?;
    p.handle(op, A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
    p.descs(op, A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[cfg])?;
    p.finalize(op)?;
    let mut ws = [0i64; 1];
    p.get(
        op,
        A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
        Ty::CUDNN_TYPE_INT64,
        &mut ws,
    )?;
    Ok((p, ws[0].max(0) as usize))
}

/// A finalized execution plan with everything it was built from.
pub(super) struct Plan {
    plan: Desc,
    /// Bytes of workspace the plan needs.
    pub workspace: usize,
    /// Which heuristic (or engine enumeration) and rank it came from.
    pub source: String,
    _graph: Desc,
    _tensors: Vec<Desc>,
    _ops: Vec<Desc>,
    _keep: Vec<Desc>,
}

impl Plan {
    /// Runs the plan on `handle`'s stream with `(uid, address)` bindings (device addresses, or
    /// host addresses of by-value scalars) and `workspace` (at least `self.workspace` bytes).
    pub(super) fn execute(
        &self,
        api: &'static Api,
        op: &'static str,
        handle: Raw,
        bind: &[(i64, *mut c_void)],
        workspace: u64,
    ) -> FResult<()> {
        let vp = Desc::new(
            api,
            op,
            K::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR,
            "variant pack",
        )?;
        let uids: Vec<i64> = bind.iter().map(|b| b.0).collect();
        let ptrs: Vec<*mut c_void> = bind.iter().map(|b| b.1).collect();
        vp.i64s(op, A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?;
        vp.ptrs(op, A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &ptrs)?;
        vp.ptrs(
            op,
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            &[workspace as *mut c_void],
        )?;
        vp.finalize(op)?;
        // SAFETY: handle, plan and variant pack are live; every bound address covers the
        // tensor its uid describes, and the by-value scalars outlive this call.
        let s = unsafe { (api.execute)(handle, self.plan.raw, vp.raw) };
        if s != 0 {
            return Err(FusedError::Tensor(crate::derr(
                op,
                format!("cudnnBackendExecute: {}", api.describe(s)),
            )));
        }
        Ok(())
    }
}
