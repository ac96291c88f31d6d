//! Creation ops, local and global: zeros, ones, full, arange, rand, randn. A global creation op
//! fills only this rank's region (`GlobalLayout::region_of`) from the global element index, so
//! the value never depends on placement or SBP; on P axes the root coordinate gets the value and
//! the other ranks zeros.

use ndarray::{ArrayD, IxDyn};
use oxiflow_dtype::{with_element, DType};
use oxiflow_placement::Placement;
use oxiflow_sbp::{check_nd_sbp, GlobalLayout, NdSbp, Region, Shape};
use rayon::prelude::*;

use crate::capture::note_host_data;
use crate::context::Context;
use crate::cpu::PAR_THRESHOLD;
use crate::device::backend_for;
use crate::element::TensorElement;
use crate::global::world_check;
use crate::rng::ElementInit;
use crate::storage::{CpuArray, Device, Storage};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

fn shape_error(op: &'static str, shape: &Shape, detail: String) -> TensorError {
    TensorError::Shape {
        op,
        shapes: shape.to_string(),
        sbps: "-".into(),
        detail,
    }
}

/// Checks that a tensor of `shape` and `dtype` has a byte size that fits in memory arithmetic
/// (before any layout math or allocation uses it).
fn check_size(op: &'static str, shape: &Shape, dtype: DType) -> Result<()> {
    match shape.checked_bytes(dtype.size()) {
        Some(_) => Ok(()),
        None => Err(shape_error(
            op,
            shape,
            format!(
                "{shape} elements of {dtype} overflow the addressable size ({} bytes at most)",
                isize::MAX
            ),
        )),
    }
}

/// The values of `region` of a tensor of `shape`, row-major. The region's byte size was
/// checked; an allocation the system refuses is an error, not an abort.
fn fill<T: TensorElement>(
    op: &'static str,
    init: ElementInit,
    shape: &Shape,
    region: &Region,
    zero: bool,
) -> Result<ArrayD<T>> {
    let local: Vec<usize> = region.iter().map(|r| r.len()).collect();
    let n: usize = local.iter().product();
    let mut data: Vec<T> = Vec::new();
    data.try_reserve_exact(n).map_err(|e| {
        shape_error(
            op,
            shape,
            format!("cannot allocate the {n} elements of this rank's piece: {e}"),
        )
    })?;
    if zero {
        data.resize(n, T::from_f64(0.0));
    } else {
        let strides = shape.strides();
        let value = |l: usize| -> T {
            let (mut rem, mut g) = (l, 0usize);
            for d in (0..local.len()).rev() {
                let i = rem % local[d];
                rem /= local[d];
                g += (region[d].start + i) * strides[d];
            }
            // 16-bit values are the f32 values rounded once (as a device computes them).
            let v = init.at(g as u64);
            T::from_f64(if T::DTYPE.is_half() {
                f64::from(v as f32)
            } else {
                v
            })
        };
        if n >= PAR_THRESHOLD {
            data.par_extend((0..n).into_par_iter().map(value));
        } else {
            data.extend((0..n).map(value));
        }
    }
    ArrayD::from_shape_vec(IxDyn(&local), data).map_err(|e| shape_error(op, shape, e.to_string()))
}

fn fill_any(
    op: &'static str,
    init: ElementInit,
    dtype: DType,
    shape: &Shape,
    region: &Region,
    zero: bool,
) -> Result<CpuArray> {
    Ok(with_element!(dtype, T => T::wrap(fill::<T>(op, init, shape, region, zero)?)))
}

/// A local tensor of `shape` filled by `init` (the byte size checked first).
fn try_local(op: &'static str, init: ElementInit, shape: Shape, dtype: DType) -> Result<Tensor> {
    check_size(op, &shape, dtype)?;
    let region: Region = shape.dims().iter().map(|&n| 0..n).collect();
    let a = fill_any(op, init, dtype, &shape, &region, false)?;
    Ok(Tensor::from_storage(Storage::Cpu(a)))
}

/// The infallible local constructors (`zeros`, `ones`, `full`, `rand`, `randn`): a shape too
/// large to allocate panics with the typed error's message, as `Vec::with_capacity` would;
/// their `try_` forms, `arange` and the `_global` forms return the error instead.
fn local(init: ElementInit, shape: Shape, dtype: DType) -> Tensor {
    match try_local("create", init, shape, dtype) {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    }
}

fn global(
    op: &'static str,
    init: ElementInit,
    shape: Shape,
    dtype: DType,
    placement: &Placement,
    nd_sbp: NdSbp,
) -> Result<Tensor> {
    check_size(op, &shape, dtype)?;
    let ctx = Context::current_for(op)?;
    world_check(op, &ctx, placement)?;
    let on_device = placement.device() != oxiflow_placement::DeviceType::Cpu;
    // A device backend that creates the values itself (counter-based, so the same values as
    // on the host); otherwise they are created on the host and moved.
    let backend = if on_device {
        backend_for(op, Device::Cuda(0))
            .ok()
            .filter(|b| b.creates(init, dtype))
    } else {
        None
    };
    if on_device && backend.is_none() {
        // Created on the host, then moved by the device backend.
        let host = global(
            op,
            init,
            shape,
            dtype,
            &placement.with_device(oxiflow_placement::DeviceType::Cpu),
            nd_sbp.clone(),
        )?;
        return host.to_global(placement, nd_sbp);
    }
    let sbp_error = |e| TensorError::Sbp {
        op,
        shapes: shape.to_string(),
        sbps: nd_sbp.to_string(),
        placement: placement.to_string(),
        detail: format!("{e}"),
    };
    check_nd_sbp(&shape, placement, &nd_sbp).map_err(sbp_error)?;
    let layout = GlobalLayout::new(shape.clone(), placement, nd_sbp.clone()).map_err(sbp_error)?;
    let piece = match placement.coord_of(ctx.rank()) {
        None => None,
        Some(coord) => {
            let region = layout.region_at(&coord);
            let zero = !layout.is_partial_root(&coord);
            Some(match &backend {
                Some(b) => Storage::Device(b.create(init, dtype, &shape, &region, zero, 0)?),
                None => Storage::Cpu(fill_any(op, init, dtype, &shape, &region, zero)?),
            })
        }
    };
    Ok(Tensor::global_from_piece(piece, layout, dtype, ctx))
}

impl Tensor {
    /// A local tensor from a host array (made row-major contiguous).
    pub fn from_array<T: TensorElement>(a: ArrayD<T>) -> Tensor {
        let t = Tensor::from_storage(Storage::Cpu(T::wrap(a).into_standard()));
        note_host_data("from_array", &t);
        t
    }

    /// A local tensor from row-major data and a shape.
    pub fn from_vec<T: TensorElement>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        let n = data.len();
        ArrayD::from_shape_vec(IxDyn(shape.dims()), data)
            .map(Tensor::from_array)
            .map_err(|_| TensorError::Shape {
                op: "from_vec",
                shapes: shape.to_string(),
                sbps: "-".into(),
                detail: format!("{n} elements do not fill shape {shape}"),
            })
    }

    /// A 0-d local tensor.
    pub fn scalar<T: TensorElement>(v: T) -> Tensor {
        Tensor::from_array(ArrayD::from_elem(IxDyn(&[]), v))
    }

    /// A local tensor of zeros.
    ///
    /// # Panics
    /// If the shape's byte size overflows or cannot be allocated; [`Tensor::try_zeros`]
    /// returns that as an error (use it for shapes from outside the program).
    pub fn zeros(shape: impl Into<Shape>, dtype: DType) -> Tensor {
        local(ElementInit::Full(0.0), shape.into(), dtype)
    }
    /// A local tensor of ones. Panics as [`Tensor::zeros`] does; see [`Tensor::try_ones`].
    pub fn ones(shape: impl Into<Shape>, dtype: DType) -> Tensor {
        local(ElementInit::Full(1.0), shape.into(), dtype)
    }
    /// A local tensor of `value`. Panics as [`Tensor::zeros`] does; see [`Tensor::try_full`].
    pub fn full(shape: impl Into<Shape>, value: f64, dtype: DType) -> Tensor {
        local(ElementInit::Full(value), shape.into(), dtype)
    }
    /// `[start, start + step, ...]` below `end` (1-d).
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType) -> Result<Tensor> {
        try_local(
            "arange",
            ElementInit::Arange { start, step },
            arange_shape(start, end, step)?,
            dtype,
        )
    }
    /// Uniform in [0, 1), counter-based (Philox keyed by `seed`). Panics as [`Tensor::zeros`]
    /// does; see [`Tensor::try_rand`].
    pub fn rand(shape: impl Into<Shape>, seed: u64, dtype: DType) -> Tensor {
        local(ElementInit::Rand(seed), shape.into(), dtype)
    }
    /// Standard normal, counter-based (Philox keyed by `seed`, Box-Muller). Panics as
    /// [`Tensor::zeros`] does; see [`Tensor::try_randn`].
    pub fn randn(shape: impl Into<Shape>, seed: u64, dtype: DType) -> Tensor {
        local(ElementInit::Randn(seed), shape.into(), dtype)
    }
    /// [`Tensor::zeros`], with a shape whose size overflows or cannot be allocated as an
    /// error.
    pub fn try_zeros(shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        try_local("zeros", ElementInit::Full(0.0), shape.into(), dtype)
    }
    /// [`Tensor::ones`], returning size errors.
    pub fn try_ones(shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        try_local("ones", ElementInit::Full(1.0), shape.into(), dtype)
    }
    /// [`Tensor::full`], returning size errors.
    pub fn try_full(shape: impl Into<Shape>, value: f64, dtype: DType) -> Result<Tensor> {
        try_local("full", ElementInit::Full(value), shape.into(), dtype)
    }
    /// [`Tensor::rand`], returning size errors.
    pub fn try_rand(shape: impl Into<Shape>, seed: u64, dtype: DType) -> Result<Tensor> {
        try_local("rand", ElementInit::Rand(seed), shape.into(), dtype)
    }
    /// [`Tensor::randn`], returning size errors.
    pub fn try_randn(shape: impl Into<Shape>, seed: u64, dtype: DType) -> Result<Tensor> {
        try_local("randn", ElementInit::Randn(seed), shape.into(), dtype)
    }

    /// `[start, start + step, ...]` below `end` (1-d), global: this rank's region of it.
    pub fn arange_global(
        start: f64,
        end: f64,
        step: f64,
        dtype: DType,
        placement: &Placement,
        nd_sbp: impl Into<NdSbp>,
    ) -> Result<Tensor> {
        let shape = arange_shape(start, end, step)?;
        global(
            "arange",
            ElementInit::Arange { start, step },
            shape,
            dtype,
            placement,
            nd_sbp.into(),
        )
    }
}

/// The global constructors that fill a shape given by the caller: each is
/// `name(shape, extra.., dtype, placement, nd_sbp)`, creating with the named op's `ElementInit`.
macro_rules! global_constructors {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) => $op:literal, $init:expr;)+) => {
        impl Tensor {
            $(
                $(#[$doc])*
                pub fn $name(
                    shape: impl Into<Shape>,
                    $($arg: $ty,)*
                    dtype: DType,
                    placement: &Placement,
                    nd_sbp: impl Into<NdSbp>,
                ) -> Result<Tensor> {
                    global($op, $init, shape.into(), dtype, placement, nd_sbp.into())
                }
            )+
        }
    };
}

global_constructors! {
    /// Zeros, global: this rank's region of them.
    zeros_global() => "zeros", ElementInit::Full(0.0);
    /// Ones, global.
    ones_global() => "ones", ElementInit::Full(1.0);
    /// `value` everywhere, global.
    full_global(value: f64) => "full", ElementInit::Full(value);
    /// [`Tensor::rand`]'s values, global: each element's value depends only on `seed` and its
    /// global index.
    rand_global(seed: u64) => "rand", ElementInit::Rand(seed);
    /// [`Tensor::randn`]'s values, global, as `rand_global`.
    randn_global(seed: u64) => "randn", ElementInit::Randn(seed);
}

fn arange_shape(start: f64, end: f64, step: f64) -> Result<Shape> {
    if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
        return Err(TensorError::Shape {
            op: "arange",
            shapes: "-".into(),
            sbps: "-".into(),
            detail: format!("bad range {start}..{end} step {step}"),
        });
    }
    // Counts beyond 2^53 are not exact in f64 (nor could their elements be told apart).
    let count = ((end - start) / step).ceil().max(0.0);
    if count > (1u64 << 53) as f64 {
        return Err(TensorError::Shape {
            op: "arange",
            shapes: "-".into(),
            sbps: "-".into(),
            detail: format!("{start}..{end} step {step} has {count:e} elements, more than 2^53"),
        });
    }
    Ok(Shape::new([count as usize]))
}
