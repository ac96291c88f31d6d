//! The vocabulary of the raw device-kernel layer (fused attention, cuBLASLt products, fused
//! NVRTC kernels): float types, strided `[B, H, T, D]` views, attention arguments, and the
//! layer's error type, and the fused classifier's arguments. These functions take device addresses and shapes, not tensors; the op
//! layer validates tensors and calls them.

use oxiflow_dtype::DType;

use oxiflow_tensor::TensorError;

/// The element type of a raw kernel's floating-point operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FloatType {
    F32,
    Bf16,
    F16,
}

impl FloatType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::Bf16 | FloatType::F16 => 2,
        }
    }
    /// The kernels' name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            FloatType::F32 => "f32",
            FloatType::Bf16 => "bf16",
            FloatType::F16 => "f16",
        }
    }
    pub const ALL: [FloatType; 3] = [FloatType::F32, FloatType::Bf16, FloatType::F16];
    /// The tensor dtype of this float type.
    pub fn dtype(self) -> DType {
        match self {
            FloatType::F32 => DType::F32,
            FloatType::Bf16 => DType::BF16,
            FloatType::F16 => DType::F16,
        }
    }
    /// The float type of tensor dtype `d` (None: f64 and i64, which the raw kernels do not
    /// take).
    pub fn of(d: DType) -> Option<FloatType> {
        match d {
            DType::F32 => Some(FloatType::F32),
            DType::BF16 => Some(FloatType::Bf16),
            DType::F16 => Some(FloatType::F16),
            _ => None,
        }
    }
}

/// Errors of the raw layer. `Unavailable` and `Refused` mean a library path cannot serve the
/// call and the caller may fall back (see [`FusedError::is_fallback`]); the others are failures.
#[derive(Debug, thiserror::Error)]
pub enum FusedError {
    /// A library is missing or does not load (cuDNN, cuBLASLt).
    #[error("{op}: {lib} is not available: {detail}")]
    Unavailable {
        op: &'static str,
        lib: &'static str,
        detail: String,
    },
    /// The library loaded but supports no plan for this call.
    #[error("{op}: {lib} refused {what}: {detail}")]
    Refused {
        op: &'static str,
        lib: &'static str,
        what: String,
        detail: String,
    },
    /// The kernel does not support these arguments (a dtype, a head size).
    #[error("{op}: unsupported: {detail}")]
    Unsupported { op: &'static str, detail: String },
    /// The arguments are inconsistent (sizes, strides, counts).
    #[error("{op}: invalid arguments: {detail}")]
    Invalid { op: &'static str, detail: String },
    /// A device call failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

impl FusedError {
    /// Whether another implementation may serve the call instead (the library is missing,
    /// refuses the graph, or does not support the arguments).
    pub fn is_fallback(&self) -> bool {
        matches!(
            self,
            FusedError::Unavailable { .. }
                | FusedError::Refused { .. }
                | FusedError::Unsupported { .. }
        )
    }
}

impl From<FusedError> for TensorError {
    fn from(e: FusedError) -> TensorError {
        match e {
            FusedError::Tensor(t) => t,
            FusedError::Unavailable { op, .. }
            | FusedError::Refused { op, .. }
            | FusedError::Unsupported { op, .. }
            | FusedError::Invalid { op, .. } => TensorError::Device {
                op,
                devices: "cuda".into(),
                shapes: String::new(),
                detail: e.to_string(),
            },
        }
    }
}

pub type FResult<T> = std::result::Result<T, FusedError>;

pub(crate) fn invalid(op: &'static str, detail: impl Into<String>) -> FusedError {
    FusedError::Invalid {
        op,
        detail: detail.into(),
    }
}

/// A strided view of a logical `[B, H, T, D]` array: element `(b, h, t, d)` sits at
/// `ptr + (b s[0] + h s[1] + t s[2] + d s[3])` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bhtd {
    pub ptr: u64,
    pub strides: [i64; 4],
}

impl Bhtd {
    /// Q, K and V as views of a fused QKV buffer `[B, T, 3, H, D]` of `elem` bytes per element
    /// (so the QKV gradient is one buffer too).
    pub fn qkv(ptr: u64, elem: usize, t: usize, h: usize, d: usize) -> [Bhtd; 3] {
        let (t, h, d) = (t as i64, h as i64, d as i64);
        let strides = [t * 3 * h * d, d, 3 * h * d, 1];
        let part = (h * d) as u64 * elem as u64;
        [0u64, 1, 2].map(|i| Bhtd {
            ptr: ptr + i * part,
            strides,
        })
    }
    /// An array `[B, T, H, D]` seen as `[B, H, T, D]` (merging heads afterwards is free).
    pub fn bthd(ptr: u64, t: usize, h: usize, d: usize) -> Bhtd {
        let (t, h, d) = (t as i64, h as i64, d as i64);
        Bhtd {
            ptr,
            strides: [t * h * d, d, h * d, 1],
        }
    }
}

/// The shape and options of one fused attention call:
/// `O = softmax(scale Q K^T [+ causal mask]) V`, with `lse = log sum exp` of each row's scaled,
/// masked scores (f32, contiguous `[B, H, T]`), the statistic the backward needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    pub batch: usize,
    pub heads: usize,
    pub seq: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub scale: f32,
    pub dtype: FloatType,
}

impl AttentionShape {
    fn dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq, self.head_dim]
    }
    /// Checks sizes and that every view stays inside an `i64`-indexable range with
    /// non-negative strides.
    pub(crate) fn check(&self, op: &'static str, views: &[Bhtd]) -> FResult<()> {
        let d = self.dims();
        if d.contains(&0) {
            return Err(invalid(op, format!("empty attention shape {d:?}")));
        }
        if self.head_dim > 256 {
            return Err(FusedError::Unsupported {
                op,
                detail: format!("head size {} (at most 256)", self.head_dim),
            });
        }
        if !self.scale.is_finite() {
            return Err(invalid(op, format!("scale {}", self.scale)));
        }
        if d.iter().any(|&n| n > i32::MAX as usize) {
            return Err(invalid(
                op,
                format!("shape {d:?} exceeds the 32-bit index range"),
            ));
        }
        for v in views {
            if v.strides.iter().any(|&s| s < 0) {
                return Err(invalid(op, format!("negative strides {:?}", v.strides)));
            }
            if v.ptr == 0 {
                return Err(invalid(op, "null device address"));
            }
        }
        Ok(())
    }
    /// Multiply-adds of the forward counted as 2 FLOPs (`4 B H T^2 D`, halved when causal).
    pub fn forward_flops(&self) -> f64 {
        let (b, h, t, d) = (
            self.batch as f64,
            self.heads as f64,
            self.seq as f64,
            self.head_dim as f64,
        );
        let full = 4.0 * b * h * t * t * d;
        if self.causal {
            full / 2.0
        } else {
            full
        }
    }
}

/// Arguments of the fused attention forward.
#[derive(Clone, Copy, Debug)]
pub struct AttentionForward {
    pub shape: AttentionShape,
    pub q: Bhtd,
    pub k: Bhtd,
    pub v: Bhtd,
    pub o: Bhtd,
    /// f32 `[B, H, T]`, contiguous.
    pub lse: u64,
}

/// Arguments of the fused attention backward: dQ, dK, dV from Q, K, V, O, dO and the forward's
/// log-sum-exp.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBackward {
    pub shape: AttentionShape,
    pub q: Bhtd,
    pub k: Bhtd,
    pub v: Bhtd,
    pub o: Bhtd,
    pub d_o: Bhtd,
    pub lse: u64,
    pub dq: Bhtd,
    pub dk: Bhtd,
    pub dv: Bhtd,
    /// Same bits on every run (no atomics in the accumulation order).
    pub deterministic: bool,
}

impl AttentionForward {
    pub(crate) fn check(&self, op: &'static str) -> FResult<()> {
        self.shape.check(op, &[self.q, self.k, self.v, self.o])?;
        if self.lse == 0 {
            return Err(invalid(op, "null log-sum-exp address"));
        }
        Ok(())
    }
}

impl AttentionBackward {
    pub(crate) fn check(&self, op: &'static str) -> FResult<()> {
        let v = [
            self.q, self.k, self.v, self.o, self.d_o, self.dq, self.dk, self.dv,
        ];
        self.shape.check(op, &v)?;
        if self.lse == 0 {
            return Err(invalid(op, "null log-sum-exp address"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_views_address_the_fused_buffer() {
        // [B=2, T=3, 3, H=4, D=5]: element (b, t, which, h, d).
        let [q, k, v] = Bhtd::qkv(1000, 2, 3, 4, 5);
        let at = |x: &Bhtd, b: i64, h: i64, t: i64, d: i64| {
            (x.ptr as i64 - 1000) / 2 + b * x.strides[0] + h * x.strides[1] + t * x.strides[2] + d
        };
        let flat = |b: i64, t: i64, w: i64, h: i64, d: i64| (((b * 3 + t) * 3 + w) * 4 + h) * 5 + d;
        for (w, x) in [q, k, v].iter().enumerate() {
            assert_eq!(at(x, 1, 2, 1, 3), flat(1, 1, w as i64, 2, 3));
        }
    }

    #[test]
    fn shapes_are_checked() {
        let s = AttentionShape {
            batch: 1,
            heads: 1,
            seq: 4,
            head_dim: 300,
            causal: true,
            scale: 0.1,
            dtype: FloatType::Bf16,
        };
        let v = Bhtd::bthd(8, 4, 1, 300);
        assert!(s.check("t", &[v]).unwrap_err().is_fallback());
        let s = AttentionShape { head_dim: 0, ..s };
        assert!(!s.check("t", &[v]).unwrap_err().is_fallback());
    }
}

/// Shared memory a block may use without opting in.
pub(crate) const SMEM_BYTES: usize = 48 * 1024;

/// Whether every address is 16-byte aligned (what the vectorised kernels load).
pub(crate) fn aligned(ptrs: &[u64]) -> bool {
    ptrs.iter().all(|p| p % 16 == 0)
}

/// The fused classifier over `rows` rows of `v` logits (row stride `ld`): per-row loss
/// (f32 `[rows]`) and `(softmax - onehot(target)) * dloss` (columns `v..ld` set to 0) written
/// to `dlogits` (same strides and type; None: in place over the logits); targets are i64, one
/// outside `0..v` ignores its row (loss and gradient 0), or with `strict` makes them NaN.
#[derive(Clone, Copy, Debug)]
pub struct Classifier {
    pub rows: usize,
    pub v: usize,
    pub ld: usize,
    pub dloss: f32,
    pub dtype: FloatType,
    pub logits: u64,
    pub dlogits: Option<u64>,
    pub targets: u64,
    pub loss: u64,
    pub strict: bool,
}
