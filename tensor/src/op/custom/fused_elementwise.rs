//! Fused element-wise op: one kernel running a small expression program ([`FusedProgram`]) over
//! its inputs, what the compiler's fusion pass puts in place of a chain (or DAG) of element-wise
//! ops (unary, backward-of-unary, tensor-scalar, broadcasting binary ops and casts); it writes
//! its last step's values and those of up to three more steps the program names.
//!
//! Semantics are those of the ops it replaces, element by element: every input is broadcast
//! (numpy rules) to the outputs' shape, the broadcast of all input shapes, and each step
//! computes its value as the unfused op's kernel would, in f32 for f32, bf16 and f16 steps and
//! in f64 for f64 steps, then rounds it to its own dtype (a 16-bit step's value is rounded to 16
//! bits exactly where the unfused op would have stored it). The CPU kernel calls the same
//! per-element functions as the element-wise kernels, so fused equals unfused bit for bit; the
//! CUDA kernel is CUDA C generated from the program (the cuda crate's `fused_elementwise.rs`).
//!
//! The op runs on local pieces only (its one SBP candidate is all-broadcast) and has no
//! gradient: it exists in compiled programs, after autograd recorded the step.

use std::fmt;
use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::op::{
    kernel_err, no_gradient, BinaryOp, CustomKernels, ElementwiseOp, F64Bits, Inferred,
    KernelBackend, MetaError, MetaResult, OpFamily, RunKernels, ScalarOp, UnaryOp,
};
use crate::Result;

/// Most inputs of one fused op (the CUDA kernel's parameter block holds this many).
pub const MAX_FUSED_INPUTS: usize = 16;
/// Most steps of one fused program.
pub const MAX_FUSED_STEPS: usize = 256;
/// Most outputs of one fused op.
pub const MAX_FUSED_OUTPUTS: usize = 4;

/// What one step of a fused program computes; operands are indices of earlier steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FusedStep {
    /// Input `k` of the op, broadcast to the output's shape.
    Input(usize),
    /// `ElementwiseOp::Unary`.
    Unary(UnaryOp, usize),
    /// `ElementwiseOp::UnaryBackward`: (dy, saved).
    UnaryBackward(UnaryOp, usize, usize),
    /// `ElementwiseOp::Scalar`.
    Scalar(ScalarOp, F64Bits, usize),
    /// `ElementwiseOp::Binary`.
    Binary(BinaryOp, usize, usize),
    /// `ElementwiseOp::Cast` / `CastParts` to the step's dtype.
    Cast(usize),
}

impl FusedStep {
    /// The step of element-wise op `op` on operand steps `args`; None for an op a fused
    /// program does not hold (or a wrong operand count).
    pub fn of(op: &ElementwiseOp, args: &[usize]) -> Option<FusedStep> {
        Some(match (op, args) {
            (ElementwiseOp::Unary(u), &[a]) => FusedStep::Unary(*u, a),
            (ElementwiseOp::UnaryBackward(u), &[g, x]) => FusedStep::UnaryBackward(*u, g, x),
            (ElementwiseOp::Scalar(s, c), &[a]) => FusedStep::Scalar(*s, *c, a),
            (ElementwiseOp::Binary(b), &[a, c]) => FusedStep::Binary(*b, a, c),
            (ElementwiseOp::Cast(_) | ElementwiseOp::CastParts(_), &[a]) => FusedStep::Cast(a),
            _ => return None,
        })
    }

    /// The steps it reads.
    pub fn operands(&self) -> impl Iterator<Item = usize> {
        let (a, b) = match *self {
            FusedStep::Input(_) => (None, None),
            FusedStep::Unary(_, a) | FusedStep::Scalar(_, _, a) | FusedStep::Cast(a) => {
                (Some(a), None)
            }
            FusedStep::UnaryBackward(_, a, b) | FusedStep::Binary(_, a, b) => (Some(a), Some(b)),
        };
        a.into_iter().chain(b)
    }

    /// The name of the op it stands for.
    pub fn name(&self) -> &'static str {
        match self {
            FusedStep::Input(_) => "input",
            FusedStep::Unary(u, _) => u.name(),
            FusedStep::UnaryBackward(u, ..) => u.backward_name(),
            FusedStep::Scalar(s, ..) => s.name(),
            FusedStep::Binary(b, ..) => b.name(),
            FusedStep::Cast(_) => "cast",
        }
    }
}

/// One step with the dtype of its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusedInstr {
    pub step: FusedStep,
    pub dtype: DType,
}

/// A checked fused program: steps in order, each reading only earlier ones, every input
/// `0..inputs` read by exactly one `Input` step, float dtypes only, operands of the dtype
/// their op computes in; the op writes the values of its output steps, the last step first
/// (every output has the op's output shape).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FusedProgram {
    instrs: Vec<FusedInstr>,
    inputs: usize,
    outputs: Vec<usize>,
}

impl FusedProgram {
    /// The program of `instrs` with one output, the last step, checked (see the type's docs);
    /// the error says what is wrong.
    pub fn new(instrs: Vec<FusedInstr>) -> std::result::Result<FusedProgram, String> {
        FusedProgram::with_outputs(instrs, &[])
    }

    /// The program of `instrs` whose outputs are the last step and then the steps `more`
    /// (distinct, earlier, not inputs), checked.
    pub fn with_outputs(
        instrs: Vec<FusedInstr>,
        more: &[usize],
    ) -> std::result::Result<FusedProgram, String> {
        if instrs.is_empty() || instrs.len() > MAX_FUSED_STEPS {
            return Err(format!(
                "a fused program has 1 to {MAX_FUSED_STEPS} steps, got {}",
                instrs.len()
            ));
        }
        let mut seen = Vec::new();
        for (j, ins) in instrs.iter().enumerate() {
            if !ins.dtype.is_float() {
                return Err(format!(
                    "step {j} ({}) is {}, not a float dtype",
                    ins.step.name(),
                    ins.dtype
                ));
            }
            if let Some(a) = ins.step.operands().find(|&a| a >= j) {
                return Err(format!(
                    "step {j} ({}) reads step {a}, not an earlier one",
                    ins.step.name()
                ));
            }
            match ins.step {
                FusedStep::Input(k) => {
                    if seen.len() <= k {
                        seen.resize(k + 1, false);
                    }
                    if std::mem::replace(&mut seen[k], true) {
                        return Err(format!("input {k} is read by two steps"));
                    }
                }
                FusedStep::Cast(_) => {}
                step => {
                    if let Some(a) = step.operands().find(|&a| instrs[a].dtype != ins.dtype) {
                        return Err(format!(
                            "step {j} ({}) is {} but reads step {a} of {}",
                            step.name(),
                            ins.dtype,
                            instrs[a].dtype
                        ));
                    }
                }
            }
        }
        if let Some(k) = seen.iter().position(|s| !s) {
            return Err(format!("input {k} is read by no step"));
        }
        if seen.is_empty() || seen.len() > MAX_FUSED_INPUTS {
            return Err(format!(
                "a fused program reads 1 to {MAX_FUSED_INPUTS} inputs, got {}",
                seen.len()
            ));
        }
        let last = instrs.len() - 1;
        let mut outputs = vec![last];
        for &m in more {
            let computed = instrs
                .get(m)
                .is_some_and(|i| !matches!(i.step, FusedStep::Input(_)));
            if !computed || outputs.contains(&m) {
                return Err(format!(
                    "output step {m} is not a distinct computed step of 0..{last}"
                ));
            }
            outputs.push(m);
        }
        if outputs.len() > MAX_FUSED_OUTPUTS {
            return Err(format!(
                "a fused program writes 1 to {MAX_FUSED_OUTPUTS} outputs, got {}",
                outputs.len()
            ));
        }
        Ok(FusedProgram {
            inputs: seen.len(),
            instrs,
            outputs,
        })
    }

    /// The steps, in order.
    pub fn instrs(&self) -> &[FusedInstr] {
        &self.instrs
    }

    /// Number of inputs.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// The dtype input `k` must have.
    pub fn input_dtype(&self, k: usize) -> Option<DType> {
        self.instrs
            .iter()
            .find(|i| i.step == FusedStep::Input(k))
            .map(|i| i.dtype)
    }

    /// The steps the op writes, in output order (the last step first).
    pub fn outputs(&self) -> &[usize] {
        &self.outputs
    }

    /// Each output's dtype.
    pub fn output_dtypes(&self) -> Vec<DType> {
        self.outputs.iter().map(|&o| self.instrs[o].dtype).collect()
    }

    /// Steps that compute (every step but the inputs): the ops the program stands for.
    pub fn op_count(&self) -> usize {
        self.instrs
            .iter()
            .filter(|i| !matches!(i.step, FusedStep::Input(_)))
            .count()
    }

    /// The output shape for inputs of `shapes`: their broadcast (None when they do not
    /// broadcast, or the count is not the program's).
    pub fn output_shape(&self, shapes: &[&Shape]) -> Option<Shape> {
        if shapes.len() != self.inputs {
            return None;
        }
        let (first, rest) = shapes.split_first()?;
        rest.iter()
            .try_fold((*first).clone(), |acc, s| rules::broadcast_shape(&acc, s))
    }
}

impl fmt::Display for FusedProgram {
    /// `%0 = in0 f32; %1 = gelu(%0) f32; ...`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (j, ins) in self.instrs.iter().enumerate() {
            if j > 0 {
                f.write_str("; ")?;
            }
            write!(f, "%{j} = ")?;
            match ins.step {
                FusedStep::Input(k) => write!(f, "in{k}")?,
                FusedStep::Scalar(s, c, a) => write!(f, "{}(%{a}, {:?})", s.name(), c)?,
                step => {
                    let args: Vec<String> = step.operands().map(|a| format!("%{a}")).collect();
                    write!(f, "{}({})", step.name(), args.join(", "))?
                }
            }
            write!(f, " {}", ins.dtype)?;
        }
        if self.outputs.len() > 1 {
            let outs: Vec<String> = self.outputs.iter().map(|o| format!("%{o}")).collect();
            write!(f, " -> {}", outs.join(", "))?;
        }
        Ok(())
    }
}

/// How output element `i` reads an input broadcast (numpy rules) to the output's shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Broadcast {
    /// The input has the output's shape: element `i`.
    Same,
    /// One element for all.
    Scalar,
    /// The input is the output's trailing dims (a bias row), `n` elements: element `i % n`.
    Repeat(usize),
    /// Any other broadcast: the input's stride on each of the output's dims (0 where
    /// broadcast).
    Strided(Vec<usize>),
}

impl Broadcast {
    /// How an input of `dims` is read as `out`; None when it does not broadcast to `out`.
    pub fn of(dims: &[usize], out: &[usize]) -> Option<Broadcast> {
        let fits = dims.len() <= out.len()
            && dims
                .iter()
                .rev()
                .zip(out.iter().rev())
                .all(|(&d, &o)| d == o || d == 1);
        if !fits {
            return None;
        }
        if dims == out {
            return Some(Broadcast::Same);
        }
        let core = &dims[dims.iter().take_while(|&&d| d == 1).count()..];
        let n: usize = core.iter().product();
        if n == 1 {
            return Some(Broadcast::Scalar);
        }
        if out[out.len() - core.len()..] == *core {
            return Some(Broadcast::Repeat(n));
        }
        let offset = out.len() - dims.len();
        let mut strides = vec![0; out.len()];
        let mut step = 1;
        for (d, &m) in dims.iter().enumerate().rev() {
            if m != 1 {
                strides[offset + d] = step;
            }
            step *= m;
        }
        Some(Broadcast::Strided(strides))
    }

    /// The element output element `i` of an output of `out` dims reads.
    pub fn index(&self, i: usize, out: &[usize]) -> usize {
        match self {
            Broadcast::Same => i,
            Broadcast::Scalar => 0,
            Broadcast::Repeat(n) => i % n,
            Broadcast::Strided(strides) => {
                let (mut rem, mut at) = (i, 0);
                for (n, s) in out.iter().zip(strides).rev() {
                    at += (rem % n) * s;
                    rem /= n;
                }
                at
            }
        }
    }
}

/// The fused element-wise op: runs `program` on its inputs (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FusedElementwise {
    pub program: Arc<FusedProgram>,
}

/// Kernel of the fused element-wise op: `out` (one buffer per program output, each of the
/// inputs' broadcast shape) = the program's outputs on `x`.
pub trait FusedElementwiseKernels: KernelBackend {
    fn fused_elementwise(
        &self,
        op: &FusedElementwise,
        x: &[&Self::Piece],
        out: &mut [Self::Out],
    ) -> Result<()>;
}

impl OpFamily for FusedElementwise {
    fn name(&self) -> &'static str {
        "fused_elementwise"
    }

    fn arity(&self) -> (usize, usize) {
        (self.program.inputs(), self.program.inputs())
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        for (k, &dt) in d.iter().enumerate() {
            let want = self.program.input_dtype(k);
            if want != Some(dt) {
                return Err(MetaError::DType(format!(
                    "input {k} is {dt}, the program reads {}",
                    want.map_or_else(|| "no such input".to_string(), |w| w.to_string())
                )));
            }
        }
        let out = self.program.output_shape(s).ok_or_else(|| {
            MetaError::Shape(format!(
                "inputs {} do not broadcast together",
                s.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        let n = self.program.outputs().len();
        let r = rules::whole(std::iter::repeat_n(out, n), s.len(), mode);
        Ok(Inferred::outputs(r, &self.program.output_dtypes()))
    }

    no_gradient!("a fused element-wise op appears only in compiled programs");
}

impl<B: CustomKernels> RunKernels<B> for FusedElementwise {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        if x.len() != self.program.inputs() || out.len() != self.program.outputs().len() {
            return Err(kernel_err(
                self.name(),
                format!(
                    "the program reads {} inputs and writes {} outputs, got {} and {}",
                    self.program.inputs(),
                    self.program.outputs().len(),
                    x.len(),
                    out.len()
                ),
            ));
        }
        b.fused_elementwise(self, x, out)
    }
}
