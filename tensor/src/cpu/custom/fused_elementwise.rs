//! Fused element-wise CPU kernel: one loop over the output in chunks (rayon over chunks when
//! large), each chunk running the program step by step over its elements with the element-wise
//! kernels' own per-element functions (`cpu::elementwise_fns`), so every value is computed as
//! the unfused op computes it: f32 for f32 and 16-bit steps (16-bit inputs arrive widened to
//! f32, see `cpu::execute`), f64 for f64 steps, and a 16-bit step's value rounded to 16 bits
//! as the unfused op's output would be.

use std::borrow::Cow;

use ndarray::ArrayD;
use oxiflow_dtype::{bf16, f16, DType, Element};

use crate::cpu::elementwise_fns::{
    with_binary_fn, with_scalar_fn, with_unary_backward_fn, with_unary_fn,
};
use crate::cpu::{try_for_each_indexed, CpuBackend, PAR_THRESHOLD};
use crate::element::TensorElement;
use crate::op::custom::{
    Broadcast, FusedElementwise, FusedElementwiseKernels, FusedProgram, FusedStep,
};
use crate::op::{kernel_err, OpFamily};
use crate::storage::CpuArray;
use crate::Result;

/// Output elements one chunk computes at a time.
const CHUNK: usize = 4096;

/// One input's elements in logical order, in the type its steps compute in.
enum Source<'a> {
    F32(Cow<'a, [f32]>),
    F64(Cow<'a, [f64]>),
}

fn elements<T: Copy>(a: &ArrayD<T>) -> Cow<'_, [T]> {
    match a.as_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().copied().collect()),
    }
}

/// The values of one step over a chunk.
#[derive(Clone)]
enum Lane {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// `v` rounded once to `dtype` (a float dtype), as the element-wise cast rounds.
fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => f64::from(<f32 as Element>::from_f64(v)),
        DType::BF16 => Element::to_f64(<bf16 as Element>::from_f64(v)),
        DType::F16 => Element::to_f64(<f16 as Element>::from_f64(v)),
        _ => v,
    }
}

/// A 16-bit step's f32 values rounded to its dtype (an f32 value rounds to 16 bits as its f64
/// value does: `Element::from_f64` of an f32 value is `from_f32` of it).
fn round_lane(dtype: DType, lane: &mut Lane) {
    let Lane::F32(v) = lane else { return };
    match dtype {
        DType::BF16 => v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
        DType::F16 => v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
        _ => {}
    }
}

fn mismatch(j: usize, step: &FusedStep) -> String {
    format!(
        "step {j} ({}) reads values of another compute type",
        step.name()
    )
}

/// Elements `start..start + len` of an input read as `reach` says (counters, no division per
/// element).
fn gather<T: Copy>(s: &[T], reach: &Broadcast, out: &[usize], start: usize, len: usize) -> Vec<T> {
    match reach {
        Broadcast::Same => s[start..start + len].to_vec(),
        Broadcast::Scalar => vec![s[0]; len],
        Broadcast::Repeat(n) => {
            let mut j = start % n;
            (0..len)
                .map(|_| {
                    let v = s[j];
                    j = if j + 1 == *n { 0 } else { j + 1 };
                    v
                })
                .collect()
        }
        Broadcast::Strided(strides) => {
            let mut at = Vec::with_capacity(out.len());
            let mut rem = start;
            for &n in out.iter().rev() {
                at.push(rem % n);
                rem /= n;
            }
            at.reverse();
            let mut idx: usize = at.iter().zip(strides).map(|(c, s)| c * s).sum();
            let mut v = Vec::with_capacity(len);
            for _ in 0..len {
                v.push(s[idx]);
                for d in (0..out.len()).rev() {
                    at[d] += 1;
                    idx += strides[d];
                    if at[d] < out[d] {
                        break;
                    }
                    idx -= strides[d] * out[d];
                    at[d] = 0;
                }
            }
            v
        }
    }
}

/// For each step, the last step that reads it (itself when none does; none for an output,
/// whose values are kept to the end).
fn last_reads(program: &FusedProgram) -> Vec<usize> {
    let mut last: Vec<usize> = (0..program.instrs().len()).collect();
    for (j, ins) in program.instrs().iter().enumerate() {
        for a in ins.step.operands() {
            last[a] = j;
        }
    }
    for &o in program.outputs() {
        last[o] = usize::MAX;
    }
    last
}

/// Step `a`'s values to compute step `j` in: taken when `j` is their last reader and `keep` is
/// false (another operand of `j` is the same step), copied otherwise.
fn owned(lanes: &mut [Lane], a: usize, j: usize, last: &[usize], keep: bool) -> Option<Lane> {
    let slot = lanes.get_mut(a)?;
    Some(if last.get(a) == Some(&j) && !keep {
        std::mem::replace(slot, Lane::F32(Vec::new()))
    } else {
        slot.clone()
    })
}

/// `Some` lane of `first`'s values each replaced by `f(first, second)` element by element, `$f`
/// the function that `$with!($op, ..)` picks for the lanes' type; `None` when the lanes' types
/// differ.
macro_rules! zip_lanes {
    ($with:ident!($op:expr), $first:expr, $second:expr) => {
        match ($first, $second) {
            (Lane::F32(mut v), Lane::F32(w)) => {
                $with!($op, f32, f => v.iter_mut().zip(w).for_each(|(x, y)| *x = f(*x, *y)));
                Some(Lane::F32(v))
            }
            (Lane::F64(mut v), Lane::F64(w)) => {
                $with!($op, f64, f => v.iter_mut().zip(w).for_each(|(x, y)| *x = f(*x, *y)));
                Some(Lane::F64(v))
            }
            _ => None,
        }
    };
}

/// The values of every output over elements `start..start + len`, in output order.
fn run_chunk(
    program: &FusedProgram,
    sources: &[(Source<'_>, Broadcast)],
    out_dims: &[usize],
    last: &[usize],
    start: usize,
    len: usize,
) -> std::result::Result<Vec<Lane>, String> {
    let mut lanes: Vec<Lane> = Vec::with_capacity(program.instrs().len());
    for (j, ins) in program.instrs().iter().enumerate() {
        let gone = || mismatch(j, &ins.step);
        let mut out = match ins.step {
            FusedStep::Input(k) => {
                let (src, reach) = sources.get(k).ok_or_else(|| format!("no input {k}"))?;
                match (src, ins.dtype == DType::F64) {
                    (Source::F32(s), false) => Lane::F32(gather(s, reach, out_dims, start, len)),
                    (Source::F64(s), true) => Lane::F64(gather(s, reach, out_dims, start, len)),
                    _ => return Err(format!("input {k} is not of the dtype step {j} reads")),
                }
            }
            FusedStep::Unary(u, a) => {
                match owned(&mut lanes, a, j, last, false).ok_or_else(gone)? {
                    Lane::F32(mut v) => {
                        with_unary_fn!(u, f32, f => v.iter_mut().for_each(|x| *x = f(*x)));
                        Lane::F32(v)
                    }
                    Lane::F64(mut v) => {
                        with_unary_fn!(u, f64, f => v.iter_mut().for_each(|x| *x = f(*x)));
                        Lane::F64(v)
                    }
                }
            }
            FusedStep::Scalar(s, c, a) => {
                match owned(&mut lanes, a, j, last, false).ok_or_else(gone)? {
                    Lane::F32(mut v) => {
                        let c = <f32 as Element>::from_f64(c.get());
                        with_scalar_fn!(s, f32, f => v.iter_mut().for_each(|x| *x = f(*x, c)));
                        Lane::F32(v)
                    }
                    Lane::F64(mut v) => {
                        let c = c.get();
                        with_scalar_fn!(s, f64, f => v.iter_mut().for_each(|x| *x = f(*x, c)));
                        Lane::F64(v)
                    }
                }
            }
            FusedStep::Binary(b, a, c) => {
                let first = owned(&mut lanes, a, j, last, a == c).ok_or_else(gone)?;
                let second = lanes.get(c).ok_or_else(gone)?;
                zip_lanes!(with_binary_fn!(b), first, second).ok_or_else(gone)?
            }
            FusedStep::UnaryBackward(u, g, x) => {
                let first = owned(&mut lanes, g, j, last, g == x).ok_or_else(gone)?;
                let second = lanes.get(x).ok_or_else(gone)?;
                zip_lanes!(with_unary_backward_fn!(u), first, second).ok_or_else(gone)?
            }
            FusedStep::Cast(a) => {
                let d = ins.dtype;
                match (owned(&mut lanes, a, j, last, false).ok_or_else(gone)?, d) {
                    (Lane::F32(v), DType::F64) => Lane::F64(v.into_iter().map(f64::from).collect()),
                    (Lane::F64(v), DType::F64) => Lane::F64(v),
                    (Lane::F32(v), _) => {
                        let mut lane = Lane::F32(v);
                        round_lane(d, &mut lane);
                        lane
                    }
                    (Lane::F64(v), _) => {
                        Lane::F32(v.into_iter().map(|x| round_to(d, x) as f32).collect())
                    }
                }
            }
        };
        if !matches!(ins.step, FusedStep::Input(_) | FusedStep::Cast(_)) {
            round_lane(ins.dtype, &mut out);
        }
        lanes.push(out);
    }
    program
        .outputs()
        .iter()
        .map(|&o| {
            lanes
                .get_mut(o)
                .map(|l| std::mem::replace(l, Lane::F32(Vec::new())))
                .ok_or_else(|| format!("no output step {o}"))
        })
        .collect()
}

/// One output's buffer (or a chunk of it) in the type the kernel writes.
enum OutSlice<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
}

impl OutSlice<'_> {
    fn len(&self) -> usize {
        match self {
            OutSlice::F32(s) => s.len(),
            OutSlice::F64(s) => s.len(),
        }
    }
    /// Writes `lane`'s values (each exact in the buffer's type, or rounded as a cast rounds).
    fn write(&mut self, lane: Lane) {
        fn put<T: TensorElement>(o: &mut [T], lane: Lane) {
            match lane {
                Lane::F32(v) => o
                    .iter_mut()
                    .zip(v)
                    .for_each(|(y, x)| *y = T::from_f64(f64::from(x))),
                Lane::F64(v) => o.iter_mut().zip(v).for_each(|(y, x)| *y = T::from_f64(x)),
            }
        }
        match self {
            OutSlice::F32(o) => put(o, lane),
            OutSlice::F64(o) => put(o, lane),
        }
    }
}

/// Writes every output of the program over `outs` (whole, contiguous), chunk by chunk (rayon
/// over chunks when large).
fn run_into(
    program: &FusedProgram,
    sources: &[(Source<'_>, Broadcast)],
    out_dims: &[usize],
    outs: Vec<OutSlice<'_>>,
) -> std::result::Result<(), String> {
    let n: usize = out_dims.iter().product();
    let last = last_reads(program);
    let mut chunks: Vec<Vec<OutSlice<'_>>> = (0..n.div_ceil(CHUNK)).map(|_| Vec::new()).collect();
    for o in outs {
        match o {
            OutSlice::F32(s) => s
                .chunks_mut(CHUNK)
                .zip(chunks.iter_mut())
                .for_each(|(p, c)| c.push(OutSlice::F32(p))),
            OutSlice::F64(s) => s
                .chunks_mut(CHUNK)
                .zip(chunks.iter_mut())
                .for_each(|(p, c)| c.push(OutSlice::F64(p))),
        }
    }
    let write = |(c, mut parts): (usize, Vec<OutSlice<'_>>)| -> std::result::Result<(), String> {
        let len = parts.first().map_or(0, OutSlice::len);
        let values = run_chunk(program, sources, out_dims, &last, c * CHUNK, len)?;
        for (part, lane) in parts.iter_mut().zip(values) {
            part.write(lane);
        }
        Ok(())
    };
    try_for_each_indexed(chunks, n >= PAR_THRESHOLD, write)
}

impl FusedElementwiseKernels for CpuBackend {
    fn fused_elementwise(
        &self,
        op: &FusedElementwise,
        x: &[&CpuArray],
        out: &mut [CpuArray],
    ) -> Result<()> {
        let name = op.name();
        let out_dims = match out.first() {
            Some(o) => o.shape().to_vec(),
            None => return Err(kernel_err(name, "no output buffer".into())),
        };
        let mut sources = Vec::with_capacity(x.len());
        for (k, a) in x.iter().enumerate() {
            let dims = a.shape();
            let reach = Broadcast::of(dims, &out_dims).ok_or_else(|| {
                kernel_err(
                    name,
                    format!("input {k} {dims:?} does not broadcast to the output {out_dims:?}"),
                )
            })?;
            let src = match a {
                CpuArray::F32(v) => Source::F32(elements(v)),
                CpuArray::F64(v) => Source::F64(elements(v)),
                other => {
                    return Err(kernel_err(
                        name,
                        format!("input {k} is {}, not f32 or f64", other.dtype()),
                    ))
                }
            };
            sources.push((src, reach));
        }
        let n: usize = out_dims.iter().product();
        let mut slices = Vec::with_capacity(out.len());
        for (m, o) in out.iter_mut().enumerate() {
            let (dtype, dims) = (o.dtype(), o.shape().to_vec());
            let slice = match o {
                CpuArray::F32(a) => a.as_slice_mut().map(OutSlice::F32),
                CpuArray::F64(a) => a.as_slice_mut().map(OutSlice::F64),
                _ => None,
            };
            match slice {
                Some(s) if dims == out_dims && s.len() == n => slices.push(s),
                _ => {
                    return Err(kernel_err(
                        name,
                        format!(
                            "output {m} ({dtype} {dims:?}) is not a contiguous f32 or f64 buffer of {out_dims:?}"
                        ),
                    ))
                }
            }
        }
        let ran = run_into(&op.program, &sources, &out_dims, slices);
        ran.map_err(|detail| kernel_err(name, format!("{detail} (program {})", op.program)))
    }
}
