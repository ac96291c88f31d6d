//! `Op`: every op the dispatcher runs, with its attributes (hashable: the signature cache key).

use std::fmt;

use oxiflow_collectives::DType;
use oxiflow_sbp::Shape;
use smallvec::SmallVec;

/// A list of tensor dims (normalized, non-negative).
pub type Dims = SmallVec<[usize; 6]>;

/// Element-wise unary functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Relu,
    /// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    Gelu,
    Exp,
    Log,
    Tanh,
    Sigmoid,
    Sqrt,
    Abs,
    Square,
}

impl UnaryOp {
    /// Linear functions keep a partial-sum SBP.
    pub fn is_linear(self) -> bool {
        matches!(self, UnaryOp::Neg)
    }
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Square => "square",
        }
    }
    pub fn backward_name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg_backward",
            UnaryOp::Relu => "relu_backward",
            UnaryOp::Gelu => "gelu_backward",
            UnaryOp::Exp => "exp_backward",
            UnaryOp::Log => "log_backward",
            UnaryOp::Tanh => "tanh_backward",
            UnaryOp::Sigmoid => "sigmoid_backward",
            UnaryOp::Sqrt => "sqrt_backward",
            UnaryOp::Abs => "abs_backward",
            UnaryOp::Square => "square_backward",
        }
    }
}

/// Broadcasting binary functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }
}

/// Functions of a tensor and a scalar `c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScalarOp {
    /// x + c
    Add,
    /// x * c (linear: keeps P)
    Mul,
    /// c - x
    RSub,
    /// c / x
    RDiv,
    /// x ^ c
    Pow,
}

impl ScalarOp {
    pub fn name(self) -> &'static str {
        match self {
            ScalarOp::Add => "add_scalar",
            ScalarOp::Mul => "mul_scalar",
            ScalarOp::RSub => "rsub_scalar",
            ScalarOp::RDiv => "rdiv_scalar",
            ScalarOp::Pow => "pow_scalar",
        }
    }
}

/// Bit pattern of an f64 attribute, so ops hash and compare exactly.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct F64Bits(u64);

impl F64Bits {
    pub fn new(v: f64) -> Self {
        F64Bits(v.to_bits())
    }
    pub fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}
impl fmt::Debug for F64Bits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// One op with its attributes. Built by the `Tensor` methods; the dispatcher infers shapes and
/// signatures from it and the kernels run it (with local attributes, see `local_op`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Unary(UnaryOp),
    Scalar(ScalarOp, F64Bits),
    Binary(BinaryOp),
    /// a [.., k] x b [k, n] -> [.., n]
    MatMul,
    /// a [b.., m, k] x b [b.., k, n] -> [b.., m, n] (equal batch dims)
    BatchMatMul,
    Sum {
        dims: Dims,
        keepdim: bool,
    },
    /// Sum, then multiplied by 1 / `count` where `count` is the number of reduced elements of
    /// the *global* shape (0 = take it from the input shape; the dispatcher fills it in).
    Mean {
        dims: Dims,
        keepdim: bool,
        count: usize,
    },
    Max {
        dims: Dims,
        keepdim: bool,
    },
    Softmax {
        dim: usize,
    },
    LogSoftmax {
        dim: usize,
    },
    Permute {
        perm: Dims,
    },
    Reshape {
        shape: Shape,
    },
    Concat {
        dim: usize,
    },
    Narrow {
        dim: usize,
        start: usize,
        len: usize,
    },
    /// (ids [..] i64, weight [V, H]) -> [.., H]
    Embedding,
    /// (x, weight [H], bias [H]): normalizes over the last dim.
    LayerNorm {
        eps: F64Bits,
    },
    /// (logits [N, C], labels [N] i64) -> per-sample loss [N]
    CrossEntropy,
    Cast(DType),
    /// (dy, x) -> dx for y = f(x)
    UnaryBackward(UnaryOp),
    /// (y, dy) -> dx for y = softmax(x, dim)
    SoftmaxBackward {
        dim: usize,
    },
    /// (y, dy) -> dx for y = log_softmax(x, dim)
    LogSoftmaxBackward {
        dim: usize,
    },
    /// Sums broadcast dims away so the result has `shape` (the reverse of broadcasting).
    SumToShape {
        shape: Shape,
    },
    /// (ids [..], dy [.., H]) -> dweight [num, H] by scatter-add
    EmbeddingBackward {
        num: usize,
    },
    /// (x, weight [H], dy) -> dx of layer norm over the last dim
    LayerNormBackward {
        eps: F64Bits,
    },
    /// (logits [N, C], labels [N], dy [N]) -> dlogits [N, C]
    CrossEntropyBackward,
}

impl Op {
    /// The op's name, as errors print it.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => u.name(),
            Op::Scalar(s, _) => s.name(),
            Op::Binary(b) => b.name(),
            Op::MatMul => "matmul",
            Op::BatchMatMul => "batch_matmul",
            Op::Sum { .. } => "sum",
            Op::Mean { .. } => "mean",
            Op::Max { .. } => "max",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::Permute { .. } => "permute",
            Op::Reshape { .. } => "reshape",
            Op::Concat { .. } => "concat",
            Op::Narrow { .. } => "narrow",
            Op::Embedding => "embedding",
            Op::LayerNorm { .. } => "layer_norm",
            Op::CrossEntropy => "cross_entropy",
            Op::Cast(_) => "cast",
            Op::UnaryBackward(u) => u.backward_name(),
            Op::SoftmaxBackward { .. } => "softmax_backward",
            Op::LogSoftmaxBackward { .. } => "log_softmax_backward",
            Op::SumToShape { .. } => "sum_to_shape",
            Op::EmbeddingBackward { .. } => "embedding_backward",
            Op::LayerNormBackward { .. } => "layer_norm_backward",
            Op::CrossEntropyBackward => "cross_entropy_backward",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
