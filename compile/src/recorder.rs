//! The capturing recorder: a [`CaptureSink`] that turns what dispatch ran on this rank into a
//! [`Program`]. A piece is a value by identity (`Arc<Storage>` address); the recorder keeps a
//! `Weak` of every piece it has named, which pins the address (never the data) so a freed
//! piece's address is never taken for a later one during the capture.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Weak};

use oxiflow_boxing::StepKind;
use oxiflow_tensor::capture::{piece_of, BoxingEvent, CaptureSink, OpEvent};
use oxiflow_tensor::{Context, Op, Storage, Tensor};
use rustc_hash::FxHashMap;

use crate::ir::{
    Node, NodeKind, OpNode, Origin, OutputSpec, Program, Signature, StepKey, Value, ValueId,
};

/// The recording of one capture.
#[derive(Default)]
pub(crate) struct Recording {
    ids: FxHashMap<usize, (Weak<Storage>, ValueId)>,
    /// Step inputs' pieces by address, with the input index.
    inputs: FxHashMap<usize, usize>,
    values: Vec<Value>,
    nodes: Vec<Node>,
    constants: Vec<Arc<Storage>>,
    ctx: Option<Context>,
    /// The first thing seen that makes the step unreplayable.
    refused: Option<Refusal>,
}

/// Why a captured step cannot be replayed: what did it and the tensor.
#[derive(Clone, Debug)]
pub(crate) enum Refusal {
    /// A host read of a tensor's value.
    HostRead(&'static str, String),
    /// A tensor made from host data inside the step.
    HostData(&'static str, String),
    /// An extern op that says its kernels cannot be replayed, and why.
    Unreplayable(&'static str, String),
}

fn addr(p: &Arc<Storage>) -> usize {
    Arc::as_ptr(p) as usize
}

impl Recording {
    /// A recording whose step inputs are `inputs`.
    pub(crate) fn new(inputs: &[Tensor]) -> Recording {
        let mut r = Recording::default();
        for (i, t) in inputs.iter().enumerate() {
            if let Some(p) = piece_of(t) {
                r.inputs.entry(addr(p)).or_insert(i);
            }
        }
        r
    }

    fn known(&self, p: &Arc<Storage>) -> Option<ValueId> {
        let (weak, id) = self.ids.get(&addr(p))?;
        // The Weak pins the address, so a live entry is this very piece.
        (weak.as_ptr() == Arc::as_ptr(p)).then_some(*id)
    }

    fn push_value(
        &mut self,
        p: &Arc<Storage>,
        origin: Origin,
        alias: Option<(ValueId, usize)>,
    ) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        self.values.push(Value {
            origin,
            shape: p.shape(),
            dtype: p.dtype(),
            device: p.device(),
            alias_of: alias.map(|(v, _)| v),
            alias_at: alias.map_or(0, |(_, at)| at),
        });
        self.ids.insert(addr(p), (Arc::downgrade(p), id));
        id
    }

    /// The value a node reads: known, a step input, or else a constant of the program.
    fn read(&mut self, p: &Arc<Storage>) -> ValueId {
        if let Some(id) = self.known(p) {
            return id;
        }
        if let Some(&i) = self.inputs.get(&addr(p)) {
            return self.push_value(p, Origin::Input(i), None);
        }
        self.constants.push(p.clone());
        let c = self.constants.len() - 1;
        self.push_value(p, Origin::Constant(c), None)
    }

    /// A value a node writes (a new one even for a known piece: an alias of it), or a view
    /// `alias` gives: the value and the byte it begins at.
    fn write(
        &mut self,
        p: &Arc<Storage>,
        node: usize,
        output: usize,
        alias: Option<(ValueId, usize)>,
    ) -> ValueId {
        let alias = alias.or_else(|| self.known(p).map(|v| (v, 0)));
        self.push_value(p, Origin::Node { node, output }, alias)
    }

    fn note_ctx(&mut self, ctx: &Context) {
        if self.ctx.is_none() {
            self.ctx = Some(ctx.clone());
        }
    }

    /// The first reason seen not to replay the step, if any.
    pub(crate) fn refusal(&self) -> Option<&Refusal> {
        self.refused.as_ref()
    }

    /// The program, with `outputs` the step's results.
    pub(crate) fn finish(mut self, key: StepKey, outputs: &[Tensor]) -> Program {
        let outs = outputs
            .iter()
            .map(|t| OutputSpec {
                value: piece_of(t).map(|p| self.read(p)),
                global: t.layout().cloned().zip(t.context().cloned()),
                dtype: t.dtype(),
            })
            .collect();
        Program {
            key,
            values: self.values,
            nodes: self.nodes,
            constants: self.constants,
            outputs: outs,
            ctx: self.ctx,
        }
    }
}

/// The sink installed on the capturing thread: shares the recording with the step driver,
/// and says whether the driver replays the program for the step's outputs.
pub(crate) struct Recorder(pub(crate) Rc<RefCell<Recording>>, pub(crate) bool);

impl CaptureSink for Recorder {
    /// A compile on a device returns the step's outputs from the program's first replay, not
    /// the capture's (`step.rs`).
    fn replaces_device_values(&self) -> bool {
        self.1
    }
    fn op(&mut self, e: OpEvent<'_>) {
        let Ok(mut r) = self.0.try_borrow_mut() else {
            return;
        };
        if let (None, Op::Extern(x)) = (&r.refused, e.local_op) {
            if let Some(why) = x.op().replay_refusal() {
                r.refused = Some(Refusal::Unreplayable(x.op().name(), why));
            }
        }
        let node = r.nodes.len();
        let inputs: Vec<ValueId> = e.kernel_inputs.iter().map(|p| r.read(p)).collect();
        let signature = e.global.map(|g| {
            r.note_ctx(g.ctx);
            Signature {
                inputs: g.inputs.iter().map(|l| (*l).clone()).collect(),
                input_sbps: g.input_sbps,
                outputs: g.outputs,
            }
        });
        let view_alias = e.view_of.and_then(|v| {
            let src = *inputs.get(v.input)?;
            Some((src, v.start * r.values[src.index()].dtype.size()))
        });
        let outputs = e
            .outputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let alias = if i == 0 { view_alias } else { None };
                piece_of(t).map(|p| r.write(p, node, i, alias))
            })
            .collect();
        r.nodes.push(Node {
            kind: NodeKind::Op(Box::new(OpNode {
                op: e.op.clone(),
                local_op: e.local_op.clone(),
                signature,
                out_specs: e.out_specs.map(<[_]>::to_vec),
                view_of: e.view_of,
            })),
            inputs,
            outputs,
            device: e.device,
        });
    }

    fn boxing(&mut self, e: BoxingEvent<'_>) {
        let Ok(mut r) = self.0.try_borrow_mut() else {
            return;
        };
        r.note_ctx(e.ctx);
        let node = r.nodes.len();
        let input = e.input.map(|p| r.read(p));
        // A plan of relabels only leaves the piece's bytes as they are, whether or not the
        // backend hands back the same piece object.
        let relabel = e
            .plan
            .steps
            .iter()
            .all(|s| matches!(s.kind, StepKind::Relabel));
        let output = e.output.map(|p| {
            let same = e.input.is_some_and(|i| relabel || Arc::ptr_eq(i, p));
            r.write(p, node, 0, input.filter(|_| same).map(|v| (v, 0)))
        });
        r.nodes.push(Node {
            kind: NodeKind::Boxing {
                op: e.op,
                plan: e.plan.clone(),
            },
            inputs: input.into_iter().collect(),
            outputs: vec![output],
            device: e.device,
        });
    }

    fn host_read(&mut self, what: &'static str, tensor: &Tensor) {
        if let Ok(mut r) = self.0.try_borrow_mut() {
            if r.refused.is_none() {
                r.refused = Some(Refusal::HostRead(what, tensor.describe()));
            }
        }
    }

    fn host_data(&mut self, what: &'static str, tensor: &Tensor) {
        if let Ok(mut r) = self.0.try_borrow_mut() {
            if r.refused.is_none() {
                r.refused = Some(Refusal::HostData(what, tensor.describe()));
            }
        }
    }
}
