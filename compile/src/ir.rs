//! The program IR: a `Vec` of nodes in execution order over numbered values. A node is one
//! global op (its attributes, the signature dispatch chose, and this rank's lowering: the local
//! op with its output buffers) or one boxing run (its plan). A value is one piece this rank
//! holds: produced by a node, bound from a step input, or a constant of the program (a tensor
//! the step read that it neither made nor was given). Specialised on shapes, dtypes and
//! layouts: [`StepKey`] says which, and the step cache keys programs by it.

use std::fmt;
use std::sync::Arc;

use oxiflow_boxing::{Plan, StepKind};
use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{GlobalLayout, NdSbp, Shape};
use oxiflow_tensor::{Context, Device, Op, OutSpec, Storage, Tensor, ViewOf};

/// A value of a program (an index into `Program::values`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Where a value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Step input `i`'s piece, bound at every replay.
    Input(usize),
    /// Constant `i` of the program (kept with it).
    Constant(usize),
    /// Output `output` of node `node`.
    Node { node: usize, output: usize },
}

/// One piece of this rank.
#[derive(Clone, Debug)]
pub struct Value {
    pub origin: Origin,
    pub shape: Shape,
    pub dtype: DType,
    pub device: Device,
    /// The value whose buffer this one shares (a view, or a boxing that left its piece as it
    /// was); its bytes are that buffer's, from `alias_at`.
    pub alias_of: Option<ValueId>,
    /// Where this value's bytes begin in those of `alias_of` (0 without one).
    pub alias_at: usize,
}

impl Value {
    /// Bytes of the piece.
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }
}

/// The global signature of an op on global tensors, as inference chose it.
#[derive(Clone, Debug)]
pub struct Signature {
    /// Each input's layout as given.
    pub inputs: Vec<GlobalLayout>,
    /// Each input's nd-SBP in the signature (boxing made it so).
    pub input_sbps: Vec<NdSbp>,
    /// Each output's layout and dtype.
    pub outputs: Vec<(GlobalLayout, DType)>,
}

/// One op: `op` with its global attributes, `local_op` what this rank's kernel runs;
/// `out_specs` the buffers it writes (None: the rank is outside the placement and runs
/// nothing); `view_of`: output 0 is a run of an input's buffer under a new shape.
#[derive(Clone, Debug)]
pub struct OpNode {
    pub op: Op,
    pub local_op: Op,
    pub signature: Option<Signature>,
    pub out_specs: Option<Vec<OutSpec>>,
    pub view_of: Option<ViewOf>,
}

/// What a node does.
#[derive(Clone, Debug)]
pub enum NodeKind {
    /// One op.
    Op(Box<OpNode>),
    /// One boxing plan run (every member of its collectives runs it, in the same order).
    Boxing { op: &'static str, plan: Arc<Plan> },
}

/// One node: what it does, the values it reads and the value of each output (None where the
/// rank holds no piece of it).
#[derive(Clone, Debug)]
pub struct Node {
    pub kind: NodeKind,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<Option<ValueId>>,
    pub device: Device,
}

impl Node {
    /// Whether the node communicates (a boxing plan with a collective or point-to-point step);
    /// such nodes run on every rank in the same order and are never removed by one rank alone.
    pub fn communicates(&self) -> bool {
        match &self.kind {
            NodeKind::Boxing { plan, .. } => plan.steps.iter().any(|s| {
                !matches!(
                    s.kind,
                    StepKind::Relabel | StepKind::LocalSlice { .. } | StepKind::PartialZero { .. }
                )
            }),
            NodeKind::Op(_) => false,
        }
    }
    /// Whether the node runs a kernel on this rank.
    pub fn runs_kernel(&self) -> bool {
        match &self.kind {
            NodeKind::Op(o) => o.out_specs.is_some() && o.view_of.is_none(),
            NodeKind::Boxing { .. } => false,
        }
    }
    /// The node's name, as messages print it.
    pub fn name(&self) -> &'static str {
        match &self.kind {
            NodeKind::Op(o) => o.op.name(),
            NodeKind::Boxing { op, .. } => op,
        }
    }
}

/// How a step output is rebuilt as a tensor after a replay.
#[derive(Clone, Debug)]
pub struct OutputSpec {
    /// Its value (None outside its placement).
    pub value: Option<ValueId>,
    /// Its layout and context, for a global tensor.
    pub global: Option<(GlobalLayout, Context)>,
    pub dtype: DType,
}

/// One input of a step as the program was specialised on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputKey {
    pub shape: Shape,
    pub dtype: DType,
    pub device: Device,
    /// Placement and nd-SBP of a global input.
    pub layout: Option<GlobalLayout>,
    /// The earlier input sharing this one's piece, if any.
    pub same_as: Option<usize>,
}

impl fmt::Display for InputKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.layout {
            Some(l) => write!(
                f,
                "{} {} ({} on {})",
                l.shape(),
                self.dtype,
                l.nd_sbp(),
                l.placement()
            )?,
            None => write!(f, "{} {} local on {}", self.shape, self.dtype, self.device)?,
        }
        if let Some(j) = self.same_as {
            write!(f, " (the piece of input {j})")?;
        }
        Ok(())
    }
}

/// What a program is specialised on: every input's shape, dtype, device and layout, and the
/// matmul precision the step's products were built at (an attribute of their ops, which a
/// replay keeps).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StepKey {
    pub inputs: Vec<InputKey>,
    pub matmul: MatmulPrecision,
}

impl StepKey {
    /// The key of `inputs` for a step whose products run at `matmul`.
    pub fn of(inputs: &[Tensor], matmul: MatmulPrecision) -> StepKey {
        let pieces: Vec<Option<*const Storage>> = inputs
            .iter()
            .map(|t| oxiflow_tensor::capture::piece_of(t).map(Arc::as_ptr))
            .collect();
        StepKey {
            inputs: inputs
                .iter()
                .enumerate()
                .map(|(i, t)| InputKey {
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                    device: t.device(),
                    layout: t.layout().cloned(),
                    same_as: pieces[i].and_then(|p| pieces[..i].iter().position(|q| *q == Some(p))),
                })
                .collect(),
            matmul,
        }
    }

    /// Why `self` (the new call's key) does not match `old`, naming what changed.
    pub fn changes_from(&self, old: &StepKey) -> String {
        if self.inputs.len() != old.inputs.len() {
            return format!(
                "the step takes {} inputs instead of {}",
                self.inputs.len(),
                old.inputs.len()
            );
        }
        let mut changed: Vec<String> = self
            .inputs
            .iter()
            .zip(&old.inputs)
            .enumerate()
            .filter(|(_, (new, old))| new != old)
            .map(|(i, (new, old))| format!("input {i} is {new} instead of {old}"))
            .collect();
        if self.matmul != old.matmul {
            changed.push(format!(
                "products run at matmul precision {} instead of {}",
                self.matmul, old.matmul
            ));
        }
        if changed.is_empty() {
            "nothing changed".into()
        } else {
            changed.join("; ")
        }
    }
}

/// One captured step on this rank: the nodes in execution order, the values, the constants
/// and how outputs are rebuilt.
#[derive(Clone, Debug)]
pub struct Program {
    pub key: StepKey,
    pub values: Vec<Value>,
    pub nodes: Vec<Node>,
    /// Pieces of the constants (`Origin::Constant(i)` is `constants[i]`).
    pub constants: Vec<Arc<Storage>>,
    pub outputs: Vec<OutputSpec>,
    /// The rank's runtime context (None when the step has no global tensors).
    pub ctx: Option<Context>,
}

impl Program {
    /// Global ops in the program (every op node, whether or not this rank runs a kernel).
    pub fn op_count(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| matches!(n.kind, NodeKind::Op(_)))
            .count()
    }
    /// Kernels this rank runs.
    pub fn kernel_count(&self) -> usize {
        self.nodes.iter().filter(|n| n.runs_kernel()).count()
    }
    /// Boxing nodes.
    pub fn boxing_count(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| matches!(n.kind, NodeKind::Boxing { .. }))
            .count()
    }
    /// The buffer `v` lives in (following aliases).
    pub fn buffer_of(&self, mut v: ValueId) -> ValueId {
        while let Some(a) = self.values[v.index()].alias_of {
            v = a;
        }
        v
    }
    /// Values the step's outputs hold.
    pub fn output_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.outputs.iter().filter_map(|o| o.value)
    }
    /// Whether each step input's piece is read by a node or handed out as an output (an
    /// input no node reads, such as a parameter a mixed-precision step reads only as its
    /// compute copy, need not be bound).
    pub fn inputs_read(&self) -> Vec<bool> {
        let mut read = vec![false; self.key.inputs.len()];
        let used = self
            .nodes
            .iter()
            .flat_map(|n| n.inputs.iter().copied())
            .chain(self.output_values());
        for v in used {
            if let Origin::Input(k) = self.values[self.buffer_of(v).index()].origin {
                if let Some(r) = read.get_mut(k) {
                    *r = true;
                }
            }
        }
        read
    }
    /// Bytes of the inputs and constants the program reads (held outside its arena).
    pub fn external_bytes(&self) -> usize {
        self.values
            .iter()
            .filter(|v| matches!(v.origin, Origin::Input(_) | Origin::Constant(_)))
            .map(Value::bytes)
            .sum()
    }
}
