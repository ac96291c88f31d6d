//! The CPU backend: kernels of every op family on host arrays (`CpuArray`: ndarray, rayon for
//! large arrays, matrixmultiply), one file per family, each implementing that family's kernel
//! trait for [`CpuBackend`] and writing into the buffers its allocator gives the executor.
//! Dispatch runs them through [`execute`], which widens 16-bit floats to f32 around the
//! kernels, so each kernel is written for f32, f64 and i64 only (an extern op's kernels get
//! the dtypes their table declares, 16-bit ones included).

/// Runs `$f` on each tuple of the zipped row producers (`Zip::from($first).and(..)`), on rayon
/// when the `$work` (elements) reaches [`PAR_THRESHOLD`], else on this thread.
macro_rules! for_each_row {
    ($work:expr, $f:expr; $first:expr $(, $more:expr)* $(,)?) => {{
        let z = ndarray::Zip::from($first)$(.and($more))*;
        if $work >= $crate::cpu::PAR_THRESHOLD {
            z.par_for_each($f);
        } else {
            z.for_each($f);
        }
    }};
}

/// `$body` with the arrays inside the `CpuArray`s `$x` bound as `$a` when all are f32 or all
/// f64 (generic over the float type), and each `$fx` is of variant `$fv` (bound as `$fa`);
/// else the kernel error of `$op` saying what it `$needs`.
macro_rules! with_floats {
    ($op:expr, $needs:expr; ($($x:expr),+) as ($($a:ident),+) $(, $fx:expr => $fv:ident($fa:ident))*
        => $body:expr) => {
        match ($($x,)+ $($fx,)*) {
            ($($crate::CpuArray::F32($a),)+ $($crate::CpuArray::$fv($fa),)*) => $body,
            ($($crate::CpuArray::F64($a),)+ $($crate::CpuArray::$fv($fa),)*) => $body,
            _ => Err($crate::op::kernel_err($op, String::from($needs))),
        }
    };
}

mod attention;
mod custom;
mod dropout;
mod elementwise;
pub(crate) mod elementwise_fns;
mod gather;
mod layout;
mod loss;
mod mask;
mod matmul;
mod norm;
mod piece;
mod reduction;
mod rms_norm;
mod rotary;
mod softmax;

use ndarray::{ArrayD, ArrayView2, ArrayViewMut, IxDyn, ShapeArg};
use oxiflow_sbp::Shape;

use std::borrow::Cow;

use oxiflow_dtype::{with_element, DType};
use rayon::iter::{IndexedParallelIterator, IntoParallelIterator, ParallelIterator};
use smallvec::SmallVec;

use crate::element::{FloatElement, TensorElement};
use crate::op::{kernel_err, KernelBackend, Op, OutSpec};
use crate::storage::CpuArray;
use crate::{with_array, Result, TensorError};

/// Arrays with at least this many elements run on rayon.
pub const PAR_THRESHOLD: usize = 1 << 15;
pub(crate) use piece::CpuPiece;
pub use piece::{array_of_host_piece, host_piece_of};

/// Output buffers of at least this many elements come zeroed from the system (`calloc`);
/// smaller ones are filled after a plain allocation, which takes the allocator's fast path.
const ZEROED_PAGES: usize = 1 << 12;

/// The CPU backend (stateless: kernels run on the calling thread and rayon's pool).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl KernelBackend for CpuBackend {
    const NAME: &'static str = "cpu";
    type Piece = CpuArray;
    type Out = CpuArray;
    /// Zeros, row-major: a filled allocation when small (the allocator's fast path), zeroed
    /// pages when large.
    fn alloc(&self, spec: &OutSpec) -> Result<CpuArray> {
        fn zeros<T: TensorElement>(shape: &[usize]) -> Option<CpuArray> {
            let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let zero = T::from_f64(0.0);
            let v = if n < ZEROED_PAGES {
                let mut v = Vec::with_capacity(n);
                v.resize(n, zero);
                v
            } else {
                vec![zero; n]
            };
            ArrayD::from_shape_vec(IxDyn(shape), v).ok().map(T::wrap)
        }
        let dims = spec.shape.dims();
        let out = with_element!(spec.dtype, T => zeros::<T>(dims));
        out.ok_or_else(|| kernel_err("alloc", format!("{} {} overflows", spec.dtype, spec.shape)))
    }
    fn out_spec(&self, out: &CpuArray) -> OutSpec {
        OutSpec {
            shape: Shape::from(out.shape()),
            dtype: out.dtype(),
        }
    }
    fn finish(&self, out: CpuArray) -> CpuArray {
        out
    }
    fn piece_spec(&self, x: &CpuArray) -> OutSpec {
        self.out_spec(x)
    }
    /// A copy: host pieces own their arrays.
    fn viewed(&self, x: &CpuArray, start: usize, spec: &OutSpec) -> Result<CpuArray> {
        fn to<T: TensorElement>(a: &ArrayD<T>, start: usize, shape: &[usize]) -> Option<ArrayD<T>> {
            let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let end = start.checked_add(n)?;
            let standard = a.as_standard_layout();
            let all = standard.as_slice()?;
            let run = all.get(start..end)?;
            ArrayD::from_shape_vec(IxDyn(shape), run.to_vec()).ok()
        }
        let out = (spec.dtype == x.dtype())
            .then(|| with_array!(x, a => to(a, start, spec.shape.dims()).map(wrap)))
            .flatten();
        out.ok_or_else(|| {
            kernel_err(
                "view",
                format!(
                    "cannot view elements from {start} of {} {:?} as {} {}",
                    x.dtype(),
                    x.shape(),
                    spec.dtype,
                    spec.shape
                ),
            )
        })
    }
}

/// An owned array as a `CpuArray`.
fn wrap<T: TensorElement>(a: ArrayD<T>) -> CpuArray {
    T::wrap(a)
}

/// `out` as an array of `T`, or a typed error naming `op` when it holds another dtype.
fn out_as<'a, T: TensorElement>(
    op: &'static str,
    out: &'a mut CpuArray,
) -> Result<&'a mut ArrayD<T>> {
    let dt = out.dtype();
    T::view_mut(out).ok_or_else(|| {
        kernel_err(
            op,
            format!("output buffer is {dt}, the kernel writes {}", T::DTYPE),
        )
    })
}

/// A typed error unless a piece of shape `got` fits the output buffer's `want`.
fn fits(op: &'static str, got: &[usize], want: &[usize]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(kernel_err(
            op,
            format!("piece {got:?} does not fit the output buffer {want:?}"),
        ))
    }
}

/// Runs `op` through the executor on the CPU backend (one piece per output of `outs`): the one
/// place where 16-bit floats meet the kernels. 16-bit inputs are widened to f32 (exactly), the
/// kernels compute in f32 (in f64 where an input is f64) into the executor's buffers, and each
/// 16-bit output is rounded once into its own buffer from the allocator. Kernels never see a
/// 16-bit array; a view (reshape) moves 16-bit data as it is.
pub(crate) fn execute(
    op: &Op,
    inputs: &[&CpuArray],
    outs: &[OutSpec],
) -> Result<SmallVec<[CpuArray; 1]>> {
    if !widens(op, inputs, outs) {
        return op.execute(&CpuBackend, inputs, outs);
    }
    let widened = widen(inputs);
    let refs: SmallVec<[&CpuArray; 3]> = widened.iter().map(|a| a.as_ref()).collect();
    let specs: SmallVec<[OutSpec; 1]> = outs.iter().map(|o| computed(o, inputs)).collect();
    let ys = op.execute(&CpuBackend, &refs, &specs)?;
    ys.into_iter()
        .zip(outs)
        .map(|(y, spec)| rounded(y, spec))
        .collect()
}

/// [`execute`] of a single-output call.
pub(crate) fn execute_one(op: &Op, inputs: &[&CpuArray], out: &OutSpec) -> Result<CpuArray> {
    if !widens(op, inputs, std::slice::from_ref(out)) {
        return op.execute_one(&CpuBackend, inputs, out);
    }
    let widened = widen(inputs);
    let refs: SmallVec<[&CpuArray; 3]> = widened.iter().map(|a| a.as_ref()).collect();
    let y = op.execute_one(&CpuBackend, &refs, &computed(out, inputs))?;
    rounded(y, out)
}

/// [`execute`] into given output buffers (zeroed, of the outputs' shapes and dtypes): the
/// kernels write them; a 16-bit output is computed in f32 (or f64) and rounded into its buffer
/// once, as [`execute`] does.
pub(crate) fn execute_into(op: &Op, inputs: &[&CpuArray], outs: &mut [CpuArray]) -> Result<()> {
    let specs: SmallVec<[OutSpec; 1]> = outs.iter().map(|o| CpuBackend.out_spec(o)).collect();
    if !widens(op, inputs, &specs) {
        return op.execute_into(&CpuBackend, inputs, outs);
    }
    let widened = widen(inputs);
    let refs: SmallVec<[&CpuArray; 3]> = widened.iter().map(|a| a.as_ref()).collect();
    let computed_specs: SmallVec<[OutSpec; 1]> =
        specs.iter().map(|o| computed(o, inputs)).collect();
    let ys = op.execute(&CpuBackend, &refs, &computed_specs)?;
    for (y, o) in ys.iter().zip(outs.iter_mut()) {
        if y.dtype() == o.dtype() {
            copy_into(y, o)?;
        } else {
            elementwise::cast_into(y, o)?;
        }
    }
    Ok(())
}

/// Copies `src` into `dst` (same dtype and shape), element by element.
pub(crate) fn copy_into(src: &CpuArray, dst: &mut CpuArray) -> Result<()> {
    fn to<T: TensorElement>(a: &ArrayD<T>, o: &mut CpuArray) -> Result<()> {
        let o = T::view_mut(o).ok_or_else(|| kernel_err("copy", "dtypes differ".into()))?;
        if o.shape() != a.shape() {
            return Err(kernel_err(
                "copy",
                format!("shape {:?} into {:?}", a.shape(), o.shape()),
            ));
        }
        o.assign(a);
        Ok(())
    }
    with_array!(src, a => to(a, dst))
}

/// Whether a call has 16-bit inputs or outputs and runs kernels (not a view) that compute
/// them through f32: an extern op's kernels take the dtypes they declare as they are.
fn widens(op: &Op, inputs: &[&CpuArray], outs: &[OutSpec]) -> bool {
    if matches!(op, Op::Extern(_)) {
        return false;
    }
    let half = inputs.iter().any(|a| a.dtype().is_half()) || outs.iter().any(|o| o.dtype.is_half());
    half && op.view_of().is_none()
}

/// The inputs with 16-bit floats widened to f32.
fn widen<'a>(inputs: &[&'a CpuArray]) -> SmallVec<[Cow<'a, CpuArray>; 3]> {
    inputs
        .iter()
        .map(|&a| match a.dtype().half() {
            Some(_) => Cow::Owned(a.cast(DType::F32)),
            None => Cow::Borrowed(a),
        })
        .collect()
}

/// The buffer the kernels compute `out` in: f32 for a 16-bit output (f64 where an input is
/// f64), else `out` itself.
fn computed(out: &OutSpec, inputs: &[&CpuArray]) -> OutSpec {
    let dtype = match out.dtype.half() {
        Some(_) if inputs.iter().any(|a| a.dtype() == DType::F64) => DType::F64,
        Some(_) => DType::F32,
        None => out.dtype,
    };
    OutSpec {
        shape: out.shape.clone(),
        dtype,
    }
}

/// `y` rounded once into an allocated buffer of `out`'s dtype (itself when it has it).
fn rounded(y: CpuArray, out: &OutSpec) -> Result<CpuArray> {
    if y.dtype() == out.dtype {
        return Ok(y);
    }
    let mut o = CpuBackend.alloc(out)?;
    elementwise::cast_into(&y, &mut o)?;
    Ok(o)
}

/// `a` viewed as rows of its last dim.
fn rows<F: FloatElement>(a: &ArrayD<F>) -> Option<ArrayView2<'_, F>> {
    let (&h, lead) = a.shape().split_last()?;
    a.view()
        .into_shape_with_order((lead.iter().product::<usize>(), h))
        .ok()
}

/// `out` viewed as `shape` (row-major), or a kernel error of `op`.
fn view_mut_as<'a, T, E: ShapeArg>(
    op: &'static str,
    out: &'a mut ArrayD<T>,
    shape: E,
) -> Result<ArrayViewMut<'a, T, E::Dim>> {
    out.view_mut()
        .into_shape_with_order(shape)
        .map_err(|e| kernel_err(op, e.to_string()))
}

/// `f` on each `(index, item)` of `items`, on rayon when `big`, stopping at the first error.
fn try_for_each_indexed<I, T, E, F>(items: I, big: bool, f: F) -> std::result::Result<(), E>
where
    I: IntoIterator<Item = T> + IntoParallelIterator<Item = T>,
    <I as IntoParallelIterator>::Iter: IndexedParallelIterator,
    T: Send,
    E: Send,
    F: Fn((usize, T)) -> std::result::Result<(), E> + Sync + Send,
{
    if big {
        items.into_par_iter().enumerate().try_for_each(f)
    } else {
        items.into_iter().enumerate().try_for_each(f)
    }
}

/// Every index lies in `0..num`.
fn check_ids(op: &'static str, ids: &ArrayD<i64>, num: usize) -> Result<()> {
    match ids.iter().find(|&&i| i < 0 || i as usize >= num) {
        Some(bad) => Err(kernel_err(op, format!("index {bad} out of range 0..{num}"))),
        None => Ok(()),
    }
}

/// The error of a kernel given an array it does not compute on: i64 where it needs a float, or
/// a 16-bit float, which reaches kernels only as f32 (see `execute`).
fn float_input(op: &'static str, a: &CpuArray) -> TensorError {
    let detail = if a.dtype().is_half() {
        format!(
            "a {} array reached the kernel; 16-bit floats run as f32",
            a.dtype()
        )
    } else {
        format!("needs a float input, got {}", a.dtype())
    };
    TensorError::Kernel { op, detail }
}
