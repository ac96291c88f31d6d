//! Local <-> global conversions: `to_global` from a local tensor (the locals are the pieces) or
//! from a global one (boxing, also to another placement), `to_global_checked` (metadata agreed
//! across ranks, handles uneven pieces), `to_local`, and gathering the whole value (`to_ndarray`).

use ndarray::ArrayD;
use oxiflow_collectives::{Buf, BufMut};
use oxiflow_dtype::DType;
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{check_nd_sbp, GlobalLayout, NdSbp, Shape};

use crate::capture::refuse_host_read;
use crate::context::Context;
use crate::device::backend_for;
use crate::dispatch::{run_boxing, sbp_err};
use crate::element::TensorElement;
use crate::observe;
use crate::storage::{CpuArray, Device, Storage};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

/// Most dims `to_global_checked` exchanges.
const MAX_DIMS: usize = 16;

/// A typed error unless `placement`'s ranks lie in `ctx`'s world.
pub(crate) fn world_check(op: &'static str, ctx: &Context, placement: &Placement) -> Result<()> {
    placement
        .check_world(ctx.world_size())
        .map_err(|e| TensorError::World {
            op,
            placement: placement.to_string(),
            world_size: ctx.world_size(),
            detail: e.to_string(),
        })
}

/// The piece moved to the placement's device type.
fn piece_on(op: &'static str, s: &Storage, placement: &Placement) -> Result<Storage> {
    match (placement.device(), s.device()) {
        (DeviceType::Cpu, Device::Cpu) | (DeviceType::Cuda, Device::Cuda(_)) => Ok(s.clone()),
        (DeviceType::Cpu, Device::Cuda(_)) => Ok(Storage::Cpu(s.to_host()?)),
        (DeviceType::Cuda, Device::Cpu) => {
            // One device per process: ordinal 0 of the devices the process sees (the CUDA
            // backend maps LOCAL_RANK to a visible device when it initialises).
            let dev = Device::Cuda(0);
            Ok(Storage::Device(
                backend_for(op, dev)?.from_host(&s.to_host()?, 0)?,
            ))
        }
    }
}

impl Tensor {
    /// A tensor laid out like `like` (same global layout and context, or local) holding
    /// `piece` as this rank's piece (None outside the placement), moved to the placement's
    /// device type (a host piece read from a file onto the GPU of a cuda placement). The piece
    /// must have the shape `like`'s layout gives this rank and `like`'s dtype.
    pub fn with_layout_of(like: &Tensor, piece: Option<Storage>) -> Result<Tensor> {
        let want = match like.layout() {
            Some(l) => like.context().and_then(|c| l.local_shape(c.rank())),
            None => Some(like.shape().clone()),
        };
        let got = piece.as_ref().map(|p| (p.shape(), p.dtype()));
        let fits = match (&want, &got) {
            (Some(w), Some((s, d))) => w == s && *d == like.dtype(),
            (None, None) => true,
            _ => false,
        };
        if !fits {
            return Err(TensorError::Shape {
                op: "with_layout_of",
                shapes: like.shape().to_string(),
                sbps: like
                    .nd_sbp()
                    .map_or_else(|| "local".into(), |s| s.to_string()),
                detail: format!(
                    "piece {:?} does not fit: this rank needs {:?} of {}",
                    got.map(|(s, d)| format!("{s} {d}")),
                    want.map(|s| s.to_string()),
                    like.dtype()
                ),
            });
        }
        match (like.layout(), like.context(), piece) {
            (Some(l), Some(ctx), piece) => Ok(Tensor::global_from_piece(
                piece
                    .map(|p| piece_on("with_layout_of", &p, l.placement()))
                    .transpose()?,
                l.clone(),
                like.dtype(),
                ctx.clone(),
            )),
            (_, _, Some(p)) => Ok(Tensor::from_storage(p)),
            _ => Err(TensorError::Shape {
                op: "with_layout_of",
                shapes: like.shape().to_string(),
                sbps: "local".into(),
                detail: "a local tensor needs a piece".into(),
            }),
        }
    }

    /// A tensor laid out like `like` (its global layout and context) in `dtype`, over the piece
    /// of the local tensor `local` (shared, not copied; None outside the placement): how an op
    /// run on this rank's pieces hands its results back in their tensors' layouts. A local
    /// `like` gives `local` itself. `local` must be of the shape `like`'s layout gives this
    /// rank and of `dtype`.
    pub fn with_layout_over(like: &Tensor, local: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
        let (Some(layout), Some(ctx)) = (like.layout(), like.context()) else {
            return local.cloned().ok_or_else(|| TensorError::Shape {
                op: "with_layout_over",
                shapes: like.shape().to_string(),
                sbps: "local".into(),
                detail: "a local tensor needs a piece".into(),
            });
        };
        let want = layout.local_shape(ctx.rank());
        if let Some(l) = local {
            if l.is_global() || want.as_ref() != Some(l.shape()) || l.dtype() != dtype {
                return Err(TensorError::Shape {
                    op: "with_layout_over",
                    shapes: format!("{}, {}", like.shape(), l.shape()),
                    sbps: layout.nd_sbp().to_string(),
                    detail: format!(
                        "piece {} does not fit {dtype} {}: this rank needs {:?}",
                        l.describe(),
                        like.describe(),
                        want.map(|s| s.to_string())
                    ),
                });
            }
        }
        Ok(Tensor::global_from_shared(
            local.and_then(|l| l.0.piece.clone()),
            layout.clone(),
            dtype,
            ctx.clone(),
        ))
    }

    /// A global tensor on `placement` with `nd_sbp`. From a local tensor: this rank's tensor is
    /// its piece and the global shape is derived assuming every rank's piece has this rank's
    /// shape (even splits; use `to_global_checked` for uneven pieces). From a global tensor:
    /// boxing to the new (placement, nd-SBP), the same value. Ranks outside the placement pass
    /// any tensor (its data is ignored).
    pub fn to_global(&self, placement: &Placement, nd_sbp: impl Into<NdSbp>) -> Result<Tensor> {
        let nd_sbp = nd_sbp.into();
        let out = self.to_global_untracked(placement, &nd_sbp)?;
        observe::to_global(self, &out, &nd_sbp);
        Ok(out)
    }

    /// This tensor on the placement and nd-SBP of `like` (boxed where they differ); itself
    /// where `like` is local or the layouts already agree.
    pub fn to_layout_of(&self, like: &Tensor) -> Result<Tensor> {
        match (like.placement(), like.nd_sbp()) {
            (Some(p), Some(nd)) if self.placement() != Some(p) || self.nd_sbp() != Some(nd) => {
                self.to_global(p, nd.clone())
            }
            _ => Ok(self.clone()),
        }
    }

    fn to_global_untracked(&self, placement: &Placement, nd_sbp: &NdSbp) -> Result<Tensor> {
        let nd_sbp = nd_sbp.clone();
        if self.is_global() {
            return self.box_to(placement, nd_sbp);
        }
        let ctx = Context::current_for("to_global")?;
        world_check("to_global", &ctx, placement)?;
        check_nd_sbp(self.shape(), placement, &nd_sbp)
            .map_err(|e| sbp_err("to_global", e, &[self], placement))?;
        let n = placement.num_ranks();
        let locals = vec![self.shape().clone(); n];
        let global = GlobalLayout::global_shape_from_locals(&locals, placement, &nd_sbp)
            .map_err(|e| sbp_err("to_global", e, &[self], placement))?;
        self.local_to_global(&ctx, placement, nd_sbp, global, self.dtype(), "to_global")
    }

    /// Like `to_global` from a local tensor, but all ranks of the world exchange their local
    /// shapes and dtypes first (every world rank must call it): the global shape is derived
    /// exactly from the pieces (uneven splits work) and disagreements are a typed error on every
    /// rank.
    pub fn to_global_checked(
        &self,
        placement: &Placement,
        nd_sbp: impl Into<NdSbp>,
    ) -> Result<Tensor> {
        let op = "to_global_checked";
        let nd_sbp = nd_sbp.into();
        if self.is_global() {
            return self.box_to(placement, nd_sbp);
        }
        let ctx = Context::current_for(op)?;
        world_check(op, &ctx, placement)?;
        let shape = self.shape();
        if shape.ndim() > MAX_DIMS {
            return Err(TensorError::Shape {
                op,
                shapes: shape.to_string(),
                sbps: nd_sbp.to_string(),
                detail: format!("at most {MAX_DIMS} dims"),
            });
        }
        let width = MAX_DIMS + 2;
        let mut mine = vec![0i64; width];
        mine[0] = shape.ndim() as i64;
        mine[1] = i64::from(self.dtype().code());
        for (i, &d) in shape.dims().iter().enumerate() {
            mine[2 + i] = d as i64;
        }
        let world = ctx.world();
        let mut all = vec![0i64; width * world.size()];
        world
            .all_gather(
                DType::I64,
                Buf::Host(bytemuck::cast_slice(&mine)),
                BufMut::Host(bytemuck::cast_slice_mut(&mut all)),
            )
            .map_err(|source| TensorError::Comm { op, source })?;
        // Every rank checks the placement's members against its first member's row, so all
        // ranks (those outside the placement too, whatever they hold) reach the same verdict.
        let ranks = world.world_ranks();
        let row_of = |r: usize| -> Result<&[i64]> {
            let m = ranks
                .iter()
                .position(|&x| x == r)
                .ok_or(TensorError::Mismatch {
                    op,
                    detail: format!("placement rank {r} is not in the world {ranks:?}"),
                })?;
            Ok(&all[m * width..(m + 1) * width])
        };
        let first = placement.ranks()[0];
        let reference = row_of(first)?;
        let (ndim, dtype) = (reference[0], reference[1]);
        let dtype = u8::try_from(dtype)
            .ok()
            .and_then(DType::from_code)
            .unwrap_or(DType::I64);
        let mut locals = Vec::with_capacity(placement.num_ranks());
        for &r in placement.ranks() {
            let row = row_of(r)?;
            if row[0] != reference[0] || row[1] != reference[1] {
                return Err(TensorError::Mismatch {
                    op,
                    detail: format!(
                        "rank {r} has {} dims and dtype code {}, rank {first} has {} dims and dtype code {}",
                        row[0], row[1], reference[0], reference[1]
                    ),
                });
            }
            locals.push(Shape::new(
                row[2..2 + ndim as usize].iter().map(|&d| d as usize),
            ));
        }
        let layout_err = |e: oxiflow_sbp::SbpError| TensorError::Sbp {
            op,
            shapes: locals
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            sbps: nd_sbp.to_string(),
            placement: placement.to_string(),
            detail: e.to_string(),
        };
        check_nd_sbp(&locals[0], placement, &nd_sbp).map_err(layout_err)?;
        let global = GlobalLayout::global_shape_from_locals(&locals, placement, &nd_sbp)
            .map_err(layout_err)?;
        let layout =
            GlobalLayout::new(global.clone(), placement, nd_sbp.clone()).map_err(layout_err)?;
        for (idx, &r) in placement.ranks().iter().enumerate() {
            let expect = layout.local_shape_at(&placement.coord_of_index(idx));
            if expect != locals[idx] {
                return Err(TensorError::Mismatch {
                    op,
                    detail: format!(
                        "rank {r} holds a piece of shape {} but {} needs {expect} there",
                        locals[idx], layout
                    ),
                });
            }
        }
        self.local_to_global(&ctx, placement, nd_sbp, global, dtype, op)
    }

    fn local_to_global(
        &self,
        ctx: &Context,
        placement: &Placement,
        nd_sbp: NdSbp,
        global: Shape,
        dtype: DType,
        op: &'static str,
    ) -> Result<Tensor> {
        let layout = GlobalLayout::new(global, placement, nd_sbp)
            .map_err(|e| sbp_err(op, e, &[self], placement))?;
        let piece = match layout.local_shape(ctx.rank()) {
            None => None,
            Some(expect) => {
                if &expect != self.shape() {
                    return Err(TensorError::Shape {
                        op,
                        shapes: self.shape().to_string(),
                        sbps: layout.nd_sbp().to_string(),
                        detail: format!(
                            "rank {} holds a piece of shape {} but {} needs {expect} (uneven pieces need to_global_checked)",
                            ctx.rank(),
                            self.shape(),
                            layout
                        ),
                    });
                }
                match &self.0.piece {
                    // The same piece, shared: a capture sees the same value.
                    Some(s) if s.device().device_type() == placement.device() => Some(s.clone()),
                    Some(s) => Some(std::sync::Arc::new(piece_on(op, s, placement)?)),
                    None => None,
                }
            }
        };
        Ok(Tensor::global_from_shared(
            piece,
            layout,
            dtype,
            ctx.clone(),
        ))
    }

    /// Boxing of a global tensor to another (placement, nd-SBP): same shape and value.
    fn box_to(&self, placement: &Placement, nd_sbp: NdSbp) -> Result<Tensor> {
        let op = "to_global";
        let (Some(from), Some(ctx)) = (self.layout(), self.context()) else {
            return Err(TensorError::Kernel {
                op,
                detail: "global tensor without layout".into(),
            });
        };
        world_check(op, ctx, placement)?;
        let to = GlobalLayout::new(from.shape().clone(), placement, nd_sbp)
            .map_err(|e| sbp_err(op, e, &[self], placement))?;
        if &to == from {
            return Ok(self.clone());
        }
        let plan =
            ctx.planner()
                .plan(from, &to, self.dtype())
                .map_err(|e| TensorError::Boxing {
                    op,
                    from: from.to_string(),
                    to: to.to_string(),
                    detail: e.to_string(),
                })?;
        let piece = run_boxing(op, &plan, ctx, self.0.piece.as_ref(), self.device())?;
        Ok(Tensor::global_from_shared(
            piece,
            to,
            self.dtype(),
            ctx.clone(),
        ))
    }

    /// This rank's piece as a local tensor (shares the data). A local tensor returns itself;
    /// ranks outside the placement get an empty tensor.
    pub fn to_local(&self) -> Tensor {
        if self.is_local() {
            return self.clone();
        }
        match &self.0.piece {
            Some(s) => Tensor::from_shared(s.clone()),
            None => Tensor::from_storage(Storage::Cpu(CpuArray::zeros(
                self.dtype(),
                self.local_shape().dims(),
            ))),
        }
    }

    /// The local piece as a host array of `T` (a copy). For a global tensor this is the rank's
    /// piece; use `to_ndarray` for the whole value.
    pub fn local_ndarray<T: TensorElement>(&self) -> Result<ArrayD<T>> {
        refuse_host_read("local_ndarray", self)?;
        let host = match self.storage() {
            Some(s) => s.to_host()?,
            None => CpuArray::zeros(self.dtype(), self.local_shape().dims()),
        };
        let dt = host.dtype();
        T::unwrap(host).ok_or_else(|| TensorError::DType {
            op: "to_ndarray",
            dtypes: dt.to_string(),
            shapes: self.shape().to_string(),
            sbps: self.nd_sbp().map_or("-".into(), |s| s.to_string()),
            detail: format!("asked for {}", T::DTYPE),
        })
    }

    /// The whole value as a host array. Local: a copy. Global: every rank of the placement must
    /// call it (it boxes to all-B on the placement); ranks outside the placement get an error
    /// without communicating.
    pub fn to_ndarray<T: TensorElement>(&self) -> Result<ArrayD<T>> {
        refuse_host_read("to_ndarray", self)?;
        self.whole_here("to_ndarray")?.local_ndarray()
    }

    /// The whole value on this rank: a local tensor itself, a global one boxed to all-B on its
    /// placement (every rank of the placement must call it); a rank outside the placement gets
    /// an error naming `op`, without communicating.
    pub(crate) fn whole_here(&self, op: &'static str) -> Result<Tensor> {
        let (Some(layout), Some(ctx)) = (self.layout(), self.context()) else {
            return Ok(self.clone());
        };
        let placement = layout.placement().clone();
        if !placement.contains(ctx.rank()) {
            return Err(TensorError::World {
                op,
                placement: placement.to_string(),
                world_size: ctx.world_size(),
                detail: format!(
                    "rank {} is outside the placement and holds no part of the value",
                    ctx.rank()
                ),
            });
        }
        self.to_global(&placement, NdSbp::broadcast(placement.ndim()))
    }

    /// The whole value as a row-major vector (see `to_ndarray`).
    pub fn to_vec<T: TensorElement>(&self) -> Result<Vec<T>> {
        Ok(self.to_ndarray::<T>()?.into_raw_vec_and_offset().0)
    }
}
