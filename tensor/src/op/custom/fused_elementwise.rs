//! Fused element-wise op: one kernel running a small expression program ([`FusedProgram`]) over
//! its inputs, what the compiler's fusion pass puts in place of a chain (or DAG) of element-wise
//! ops (unary, backward-of-unary, tensor-scalar, broadcasting binary ops and casts) whose
//! intermediate values nothing else reads.
//!
//! Semantics are those of the ops it replaces, element by element: every input is broadcast
//! (numpy rules) to the output's shape, the broadcast of all input shapes, and each step
//! computes its value as the unfused op's kernel would, in f32 for f32, bf16 and f16 steps and
//! in f64 for f64 steps, then rounds it to its own dtype (a 16-bit step's value is rounded to 16
//! bits exactly where the unfused op would have stored it). The CPU kernel calls the same
//! per-element functions as the element-wise kernels, so fused equals unfused bit for bit; the
//! CUDA kernel is CUDA C generated from the program (`cuda/fused_elementwise.rs`).
//!
//! The op runs on local pieces only (its one SBP candidate is all-broadcast) and has no
//! gradient: it exists in compiled programs, after autograd recorded the step.

use std::fmt;
use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Rules, Sbp, Shape};

use crate::dispatch::dispatch;
use crate::op::{
    kernel_err, no_gradient, single, Backend, BinaryOp, ElementwiseOp, F64Bits, Inferred,
    KernelBackend, MetaError, MetaResult, OpFamily, ScalarOp, UnaryOp,
};
use crate::tensor::Tensor;
use crate::Result;

/// Most inputs of one fused op (the CUDA kernel's parameter block holds this many).
pub const MAX_FUSED_INPUTS: usize = 16;
/// Most steps of one fused program.
pub const MAX_FUSED_STEPS: usize = 256;

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
/// their op computes in; the last step's value is the output.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FusedProgram {
    instrs: Vec<FusedInstr>,
    inputs: usize,
}

impl FusedProgram {
    /// The program of `instrs`, checked (see the type's docs); the error says what is wrong.
    pub fn new(instrs: Vec<FusedInstr>) -> std::result::Result<FusedProgram, String> {
        if instrs.is_empty() || instrs.len() > MAX_FUSED_STEPS {
            return Err(format!(
                "a fused program has 1 to {MAX_FUSED_STEPS} steps, got {}",
                instrs.len()
            ));
        }
        let mut seen = Vec::new();
        for (j, ins) in instrs.iter().enumerate() {
            if !ins.dtype.is_float() {
                return Err(format!("step {j} ({}) is {}, not a float dtype", ins.step.name(), ins.dtype));
            }
            if let Some(a) = ins.step.operands().find(|&a| a >= j) {
                return Err(format!("step {j} ({}) reads step {a}, not an earlier one", ins.step.name()));
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
        Ok(FusedProgram {
            inputs: seen.len(),
            instrs,
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

    /// The output's dtype (the last step's).
    pub fn output_dtype(&self) -> DType {
        self.instrs.last().map_or(DType::F32, |i| i.dtype)
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

/// Kernel of the fused element-wise op: `out` (of the inputs' broadcast shape) = the program
/// on `x`.
pub trait FusedElementwiseKernels: KernelBackend {
    fn fused_elementwise(
        &self,
        op: &FusedElementwise,
        x: &[&Self::Piece],
        out: &mut Self::Out,
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
                s.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        let mut r = Rules::new(mode, [out]);
        r.push_uniform(s.len(), 1, Sbp::B);
        Ok(Inferred::new(r, self.program.output_dtype()))
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        if x.len() != self.program.inputs() {
            return Err(kernel_err(
                self.name(),
                format!(
                    "the program reads {} inputs, got {}",
                    self.program.inputs(),
                    x.len()
                ),
            ));
        }
        b.fused_elementwise(self, x, y)
    }

    no_gradient!("a fused element-wise op appears only in compiled programs");
}

impl Tensor {
    /// Runs fused program `program` on local tensors `inputs` (one per program input, of the
    /// dtypes it reads, shapes that broadcast together) as one kernel: the result of the ops
    /// it stands for.
    pub fn fused_elementwise(program: &Arc<FusedProgram>, inputs: &[&Tensor]) -> Result<Tensor> {
        let _ng = crate::autograd::no_grad();
        let op = FusedElementwise {
            program: program.clone(),
        };
        dispatch(op.into(), inputs)
    }
}
