//! `Rope`: the rotary embedding of a block's queries and keys `[B, T, H, D]` at positions
//! `pos0..pos0 + T`, held along T in a `SeqOrder` (GPT-NeoX layout: pairs (i, i + D/2) rotate by `pos * inv_freq[i]`), with
//! the architecture's frequencies (`Arch::inv_freq`). Unscaled frequencies in natural order run
//! as the tensor crate's fused `rotary` op from any first position (a decoding step's too; 16-bit
//! inputs rotate in f32); scaled ones and the load-balanced order of a context-parallel split as
//! `x cos + rotate_half(x) sin` over cos/sin tables of the same angles in the input's dtype
//! (as transformers does), by the fused `oxiflow_ops::rotary` op (computed in f32 for 16-bit
//! inputs), whose tables are split as the input's rows are. The tables of positions
//! `0..seq_len` are made when the model is (`Rope::with_tables`), in the parameters' dtype on
//! the block's placement, so a step (a compiled one included) only narrows and casts them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use oxiflow_dtype::DType;
use oxiflow_ops::context_parallel::SeqOrder;
use oxiflow_ops::decode::rotary_at;
use oxiflow_ops::rotary::rotary_tables;
use oxiflow_sbp::NdSbp;

use crate::shape_error::shape_err;
use crate::Result;
use oxiflow_tensor::Tensor;

use super::arch::{Arch, Positions, RopeScaling};

/// The cos and sin tables `[T, 1, D]` of a window from position 0, by (T, dtype, layout, order).
type Tables = HashMap<(usize, DType, String, SeqOrder), (Tensor, Tensor)>;

/// A rotary embedding (see the module docs). Cloning shares the kept tables.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f64>,
    /// The unscaled base, when the frequencies are `theta^(-2i/D)` (the fused op's).
    fused_theta: Option<f64>,
    tables: Arc<Mutex<Tables>>,
    /// The cos and sin tables `[seq_len, 1, D]` of positions from 0, made with the model.
    base: Option<(Tensor, Tensor)>,
    /// The frequencies as an f64 tensor `[D / 2]` beside the tables (for [`Rope::apply_at`]).
    freq: Option<Tensor>,
    /// The cos and sin tables of a whole window of positions from 0 held in the layout's
    /// order, where that is not the natural one, made with the model.
    ordered: Option<(SeqOrder, Tensor, Tensor)>,
}

impl Rope {
    /// The rotary embedding of `arch` for heads `head_dim` wide (None: learned positions).
    pub fn new(arch: &Arch, head_dim: usize) -> Option<Rope> {
        let Positions::Rotary { theta, scaling } = arch.positions else {
            return None;
        };
        Some(Rope {
            inv_freq: arch.inv_freq(head_dim)?,
            fused_theta: (scaling == RopeScaling::None).then_some(theta),
            tables: Arc::default(),
            base: None,
            freq: None,
            ordered: None,
        })
    }

    /// This embedding with the tables of positions `0..len` made now, in `dtype` on
    /// `placement` (broadcast; local without one), in the natural order and in `order`.
    pub fn with_tables(
        mut self,
        len: usize,
        dtype: DType,
        placement: Option<&oxiflow_placement::Placement>,
        order: SeqOrder,
    ) -> Result<Rope> {
        self.base = Some(self.make(0, SeqOrder::Natural, len, dtype, placement)?);
        self.freq = Some(self.frequencies(placement)?);
        if order != SeqOrder::Natural {
            let (cos, sin) = self.make(0, order, len, dtype, placement)?;
            self.ordered = Some((order, cos, sin));
        }
        Ok(self)
    }

    /// `x` `[B, T, H, D]` rotated for positions `pos0..pos0 + T`.
    pub fn apply(&self, x: &Tensor, pos0: usize) -> Result<Tensor> {
        self.apply_in(x, pos0, SeqOrder::Natural)
    }

    /// `x` `[B, T, H, D]` rotated for positions `pos0..pos0 + T` held along T in `order`.
    pub fn apply_in(&self, x: &Tensor, pos0: usize, order: SeqOrder) -> Result<Tensor> {
        let t = match x.shape().dims() {
            &[_, t, _, d] if d == 2 * self.inv_freq.len() => t,
            _ => {
                return Err(shape_err(
                    "Rope::apply",
                    x,
                    format!(
                        "needs [B, T, H, D] with D = {} (the rotary frequencies' pairs)",
                        2 * self.inv_freq.len()
                    ),
                ))
            }
        };
        if let (Some(theta), SeqOrder::Natural) = (self.fused_theta, order) {
            return x.rotary_from(1, theta, pos0);
        }
        let (cos, sin) = self.tables(x, pos0, order, t)?;
        rotary_tables(x, &cos, &sin)
    }

    /// `x` `[B, T, H, D]` rotated for positions `pos..pos + T`, `pos` one i64 on the device
    /// (broadcast on x's placement): the angles as [`Rope::apply`]'s, read from the device
    /// (`oxiflow_ops::decode::rotary_at`), so a captured decoding step serves every position.
    pub fn apply_at(&self, x: &Tensor, pos: &Tensor) -> Result<Tensor> {
        rotary_at(x, &self.frequencies_on(x.placement())?, pos)
    }

    /// The frequencies as an f64 tensor `[D / 2]`, broadcast on `placement` (the kept ones
    /// where they are there), for the ops that rotate at a device position.
    pub fn frequencies_on(
        &self,
        placement: Option<&oxiflow_placement::Placement>,
    ) -> Result<Tensor> {
        match &self.freq {
            Some(f) if f.placement() == placement => Ok(f.clone()),
            _ => self.frequencies(placement),
        }
    }

    /// The frequencies as an f64 tensor `[D / 2]`, broadcast on `placement`.
    fn frequencies(&self, placement: Option<&oxiflow_placement::Placement>) -> Result<Tensor> {
        let _ng = oxiflow_tensor::no_grad();
        let local = Tensor::from_vec(self.inv_freq.clone(), [self.inv_freq.len()])?;
        match placement {
            Some(p) => local.to_global(p, NdSbp::broadcast(p.ndim())),
            None => Ok(local),
        }
    }

    /// The cos and sin tables `[T, 1, D]` of positions `pos0..pos0 + T` in `order` in `x`'s
    /// dtype, broadcast on `x`'s placement (kept for windows from position 0).
    fn tables(
        &self,
        x: &Tensor,
        pos0: usize,
        order: SeqOrder,
        t: usize,
    ) -> Result<(Tensor, Tensor)> {
        let key = (
            t,
            x.dtype(),
            x.placement().map_or_else(String::new, |p| p.to_string()),
            order,
        );
        if let (Some((cos, sin)), SeqOrder::Natural) = (&self.base, order) {
            let fits = pos0 + t <= cos.shape().dims()[0];
            if fits && cos.placement() == x.placement() {
                let at = |table: &Tensor| table.narrow(0, pos0, t)?.to_dtype(x.dtype());
                return Ok((at(cos)?, at(sin)?));
            }
        }
        if let Some((o, cos, sin)) = &self.ordered {
            let fits = *o == order && pos0 == 0 && cos.shape().dims()[0] == t;
            if fits && cos.placement() == x.placement() {
                return Ok((cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?));
            }
        }
        if pos0 == 0 {
            let kept = self.tables.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(pair) = kept.get(&key) {
                return Ok(pair.clone());
            }
        }
        let pair = self.make(pos0, order, t, x.dtype(), x.placement())?;
        if pos0 == 0 {
            let mut kept = self.tables.lock().unwrap_or_else(|e| e.into_inner());
            kept.insert(key, pair.clone());
        }
        Ok(pair)
    }

    /// The cos and sin tables `[t, 1, D]` of positions `pos0..pos0 + t` held in `order`,
    /// computed in f64 and stored in `dtype`, broadcast on `placement`.
    fn make(
        &self,
        pos0: usize,
        order: SeqOrder,
        t: usize,
        dtype: DType,
        placement: Option<&oxiflow_placement::Placement>,
    ) -> Result<(Tensor, Tensor)> {
        let d = 2 * self.inv_freq.len();
        let half = d / 2;
        let mut cos = Vec::with_capacity(t * d);
        let mut sin = Vec::with_capacity(t * d);
        for p in order.positions(t).into_iter().map(|i| pos0 + i) {
            for j in 0..d {
                let angle = p as f64 * self.inv_freq[j % half];
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let place = |v: Vec<f64>| -> Result<Tensor> {
            let _ng = oxiflow_tensor::no_grad();
            let local = Tensor::from_vec(v, [t, 1, d])?.to_dtype(dtype)?;
            match placement {
                Some(p) => local.to_global(p, NdSbp::broadcast(p.ndim())),
                None => Ok(local),
            }
        };
        Ok((place(cos)?, place(sin)?))
    }
}
