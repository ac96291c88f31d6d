//! Attention test operands and references: the sizes the attention property tests draw,
//! never-zero values, the composed attention on `[B, T, H, D]` operands and key/value heads
//! repeated to the query heads.

use std::ops::Range;

use oxiflow_tensor::{DType, Tensor};
use proptest::prelude::*;

use super::vals;

/// Never-zero f64 values: magnitude 0.1..1, either sign, from `seed`.
pub fn nz(shape: &[usize], seed: u64) -> Tensor {
    let mag = vals(&Tensor::rand(shape.to_vec(), seed, DType::F64));
    let sign = vals(&Tensor::rand(shape.to_vec(), seed ^ 0x5eed, DType::F64));
    let v: Vec<f64> = mag
        .iter()
        .zip(&sign)
        .map(|(m, s)| (0.1 + 0.9 * m) * if *s < 0.5 { -1.0 } else { 1.0 })
        .collect();
    Tensor::from_vec(v, shape.to_vec()).unwrap()
}

/// The composed reference on `[B, T, H, D]` operands: heads moved to dim 1,
/// `attention_probs` + `bmm`, moved back.
pub fn composed(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Tensor {
    let heads = |x: &Tensor| x.permute(&[0, 2, 1, 3]).unwrap();
    heads(
        &heads(q)
            .attention_probs(&heads(k), causal, scale)
            .unwrap()
            .bmm(&heads(v))
            .unwrap(),
    )
}

/// `x` `[B, S, G, D]` with each head repeated `group` times in place (head `j` of the result
/// is head `j / group` of `x`; the backward sums the copies).
pub fn repeated(x: &Tensor, group: usize) -> Tensor {
    let &[b, s, g, d] = x.shape().dims() else {
        panic!("repeated: {} is not 4-d", x.shape())
    };
    let one = x.reshape([b, s, g, 1, d]).unwrap();
    let copies = vec![&one; group];
    Tensor::concat(&copies, 3)
        .unwrap()
        .reshape([b, s, g * group, d])
        .unwrap()
}

/// The sizes of one grouped-query attention case: q `[b, t, group x g, d]` over k
/// `[b, s, g, d]`; `s` equals `t` when `causal`.
#[derive(Clone, Copy, Debug)]
pub struct GqaDims {
    pub b: usize,
    pub t: usize,
    pub s: usize,
    pub g: usize,
    pub group: usize,
    pub d: usize,
    pub causal: bool,
}

impl GqaDims {
    /// The query heads: `group` per key/value head.
    pub fn h(&self) -> usize {
        self.g * self.group
    }
}

/// [`GqaDims`] drawn from the ranges of each size and either `causal` (which then takes the
/// drawn `t` for `s`).
pub fn gqa_dims(
    b: Range<usize>,
    t: Range<usize>,
    s: Range<usize>,
    g: Range<usize>,
    group: Range<usize>,
    d: Range<usize>,
) -> impl Strategy<Value = GqaDims> {
    (b, t, s, g, group, d, any::<bool>()).prop_map(|(b, t, s, g, group, d, causal)| GqaDims {
        b,
        t,
        s: if causal { t } else { s },
        g,
        group,
        d,
        causal,
    })
}
