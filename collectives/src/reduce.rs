//! Reduction operators and the host reduction kernel shared by the CPU backends.

use std::fmt;

use crate::{DType, Element};

/// How partial values combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

fn reduce_typed<T: Element>(acc: &mut [u8], src: &[u8], op: ReduceOp) {
    // Buffers come from byte vectors that may not be aligned for T; work unaligned-safe.
    let n = acc.len() / std::mem::size_of::<T>();
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(acc),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        (Ok(a), Ok(s)) => match op {
            ReduceOp::Sum => a.iter_mut().zip(s).for_each(|(x, y)| *x = x.add(*y)),
            ReduceOp::Max => a
                .iter_mut()
                .zip(s)
                .for_each(|(x, y)| *x = Element::max(*x, *y)),
            ReduceOp::Min => a
                .iter_mut()
                .zip(s)
                .for_each(|(x, y)| *x = Element::min(*x, *y)),
        },
        _ => {
            let sz = std::mem::size_of::<T>();
            for i in 0..n {
                let x: T = bytemuck::pod_read_unaligned(&acc[i * sz..(i + 1) * sz]);
                let y: T = bytemuck::pod_read_unaligned(&src[i * sz..(i + 1) * sz]);
                let r = match op {
                    ReduceOp::Sum => x.add(y),
                    ReduceOp::Max => Element::max(x, y),
                    ReduceOp::Min => Element::min(x, y),
                };
                acc[i * sz..(i + 1) * sz].copy_from_slice(bytemuck::bytes_of(&r));
            }
        }
    }
}

/// `acc = op(acc, src)` element-wise, both holding `dtype` elements as bytes of equal length
/// (16-bit floats: each pair combined in f32 and rounded once).
pub fn reduce_into(dtype: DType, acc: &mut [u8], src: &[u8], op: ReduceOp) {
    debug_assert_eq!(acc.len(), src.len());
    oxiflow_dtype::with_element!(dtype, T => reduce_typed::<T>(acc, src, op))
}
