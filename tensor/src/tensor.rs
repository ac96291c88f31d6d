//! `Tensor`: a cheap-to-clone handle (Arc) to a local tensor or to this rank's view of a global
//! tensor (local piece + `GlobalLayout` + runtime context), plus its autograd state
//! ([`AutogradMeta`]): the gradient slot and the backward-graph node that made it, held as a
//! [`GradFn`] trait object so that this layer knows nothing of ops or of the autograd engine
//! (which records nodes from above, as a dispatch observer).

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{GlobalLayout, NdSbp, Sbp, Shape};

use crate::context::Context;
use crate::storage::{Device, Storage};

/// The global part of a tensor: its layout and the rank's runtime context.
#[derive(Clone)]
pub(crate) struct GlobalMeta {
    pub layout: GlobalLayout,
    pub ctx: Context,
}

/// Everything a tensor holds: the local piece, its layout, and the autograd state.
pub(crate) struct TensorImpl {
    /// The local piece; None on ranks outside a global tensor's placement.
    pub(crate) piece: Option<Arc<Storage>>,
    /// Shape of the local piece (all-zero dims when `piece` is None).
    pub(crate) local_shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) global: Option<GlobalMeta>,
    pub(crate) autograd: AutogradMeta,
}

/// A local or global tensor. Cloning shares the data.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

/// A tensor's metadata without its data: logical shape, dtype, device and (for a global
/// tensor) layout and context. What an autograd node keeps of a tensor it does not save.
#[derive(Clone)]
pub struct TensorMeta {
    shape: Shape,
    dtype: DType,
    device: Device,
    global: Option<GlobalMeta>,
}

impl TensorMeta {
    /// The logical shape (global for a global tensor).
    pub fn shape(&self) -> &Shape {
        match &self.global {
            Some(g) => g.layout.shape(),
            None => &self.shape,
        }
    }
    pub fn ndim(&self) -> usize {
        self.shape().ndim()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn placement(&self) -> Option<&Placement> {
        self.global.as_ref().map(|g| g.layout.placement())
    }
    pub fn nd_sbp(&self) -> Option<&NdSbp> {
        self.global.as_ref().map(|g| g.layout.nd_sbp())
    }
    pub fn context(&self) -> Option<&Context> {
        self.global.as_ref().map(|g| &g.ctx)
    }
    /// Short description for messages, as `Tensor::describe` prints it.
    pub fn describe(&self) -> String {
        match &self.global {
            Some(g) => format!(
                "{} {} ({} on {})",
                self.shape(),
                self.dtype,
                g.layout.nd_sbp(),
                g.layout.placement()
            ),
            None => format!("{} {} local on {}", self.shape, self.dtype, self.device),
        }
    }
}

impl Tensor {
    /// A local tensor from storage.
    pub fn from_storage(storage: Storage) -> Tensor {
        let local_shape = storage.shape();
        Tensor::from_storage_of_shape(storage, local_shape)
    }

    /// A local tensor of `storage`, whose shape the caller has checked to be `local_shape`.
    pub(crate) fn from_storage_of_shape(storage: Storage, local_shape: Shape) -> Tensor {
        let (dtype, device) = (storage.dtype(), storage.device());
        Tensor(Arc::new(TensorImpl {
            piece: Some(Arc::new(storage)),
            local_shape,
            dtype,
            device,
            global: None,
            autograd: AutogradMeta::default(),
        }))
    }

    /// A local tensor sharing a piece's storage.
    pub(crate) fn from_shared(piece: Arc<Storage>) -> Tensor {
        let local_shape = piece.shape();
        let (dtype, device) = (piece.dtype(), piece.device());
        Tensor(Arc::new(TensorImpl {
            piece: Some(piece),
            local_shape,
            dtype,
            device,
            global: None,
            autograd: AutogradMeta::default(),
        }))
    }

    /// A global tensor from this rank's piece (None outside the placement). Checks the local
    /// shape against the layout (a kernel bug otherwise).
    pub(crate) fn global_from_piece(
        piece: Option<Storage>,
        layout: GlobalLayout,
        dtype: DType,
        ctx: Context,
    ) -> Tensor {
        Tensor::global_from_shared(piece.map(Arc::new), layout, dtype, ctx)
    }

    /// A global tensor over a piece that may be shared with other tensors (boxing that left
    /// the piece unchanged).
    pub(crate) fn global_from_shared(
        piece: Option<Arc<Storage>>,
        layout: GlobalLayout,
        dtype: DType,
        ctx: Context,
    ) -> Tensor {
        let device = match &piece {
            Some(s) => s.device(),
            None => Device::Cpu,
        };
        let local_shape = match &piece {
            Some(s) => s.shape(),
            None => Shape::new(std::iter::repeat_n(0, layout.shape().ndim())),
        };
        debug_assert!(
            piece.is_none() || layout.local_shape(ctx.rank()).as_ref() == Some(&local_shape),
            "local piece {local_shape} does not match layout {layout} on rank {}",
            ctx.rank()
        );
        Tensor(Arc::new(TensorImpl {
            piece,
            local_shape,
            dtype,
            device,
            global: Some(GlobalMeta { layout, ctx }),
            autograd: AutogradMeta::default(),
        }))
    }

    /// The logical shape: the global shape of a global tensor, the shape of a local one.
    pub fn shape(&self) -> &Shape {
        match &self.0.global {
            Some(g) => g.layout.shape(),
            None => &self.0.local_shape,
        }
    }
    /// The shape of this rank's piece (equal to `shape()` for local tensors).
    pub fn local_shape(&self) -> &Shape {
        &self.0.local_shape
    }
    pub fn ndim(&self) -> usize {
        self.shape().ndim()
    }
    pub fn numel(&self) -> usize {
        self.shape().numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// The device of the local piece.
    pub fn device(&self) -> Device {
        self.0.device
    }
    pub fn is_global(&self) -> bool {
        self.0.global.is_some()
    }
    pub fn is_local(&self) -> bool {
        self.0.global.is_none()
    }
    /// The placement of a global tensor.
    pub fn placement(&self) -> Option<&Placement> {
        self.0.global.as_ref().map(|g| g.layout.placement())
    }
    /// The nd-SBP of a global tensor.
    pub fn nd_sbp(&self) -> Option<&NdSbp> {
        self.0.global.as_ref().map(|g| g.layout.nd_sbp())
    }
    /// Alias of `nd_sbp`.
    pub fn sbp(&self) -> Option<&NdSbp> {
        self.nd_sbp()
    }
    /// Whether a mesh axis of more than one rank lays this tensor out with an SBP that
    /// `which` accepts (false for a local tensor): e.g. split on dim 1, or anything but B.
    pub fn has_sbp_over_ranks(&self, which: impl Fn(Sbp) -> bool) -> bool {
        match (self.placement(), self.nd_sbp()) {
            (Some(p), Some(s)) => s
                .iter()
                .zip(p.shape().iter())
                .any(|(a, &n)| n > 1 && which(a)),
            _ => false,
        }
    }
    /// The global layout (shape, placement, nd-SBP) of a global tensor.
    pub fn layout(&self) -> Option<&GlobalLayout> {
        self.0.global.as_ref().map(|g| &g.layout)
    }
    /// The runtime context a global tensor was made in.
    pub fn context(&self) -> Option<&Context> {
        self.0.global.as_ref().map(|g| &g.ctx)
    }
    /// The local piece's storage (None on ranks outside a global tensor's placement).
    pub fn storage(&self) -> Option<&Storage> {
        self.0.piece.as_deref()
    }
    /// Autograd metadata (requires_grad, grad, grad_fn).
    pub fn autograd(&self) -> &AutogradMeta {
        &self.0.autograd
    }
    pub fn requires_grad(&self) -> bool {
        self.0.autograd.requires_grad()
    }
    /// The tensor's metadata, without its data.
    pub(crate) fn meta(&self) -> TensorMeta {
        TensorMeta {
            shape: self.0.local_shape.clone(),
            dtype: self.0.dtype,
            device: self.0.device,
            global: self.0.global.clone(),
        }
    }
    /// Whether both handles share one tensor.
    pub fn same(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
    /// A tensor sharing this one's data without autograd history (and not requiring grad).
    pub fn detach(&self) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            piece: self.0.piece.clone(),
            local_shape: self.0.local_shape.clone(),
            dtype: self.0.dtype,
            device: self.0.device,
            global: self.0.global.clone(),
            autograd: AutogradMeta::default(),
        }))
    }
    /// Whether the tensor has no autograd history (a leaf, when it requires grad).
    pub fn is_leaf(&self) -> bool {
        self.autograd().grad_edge().is_none()
    }
    /// The name of the op that made this tensor, when it has autograd history.
    pub fn grad_fn_name(&self) -> Option<String> {
        self.autograd().grad_fn().map(|f| f.name().to_string())
    }
    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.autograd().grad()
    }
    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        self.autograd().set_grad(None)
    }

    /// Short description for messages: `[4, 5] f32 (S(0) on cpu:[0, 1])` or `[4, 5] f32 local`.
    pub fn describe(&self) -> String {
        self.meta().describe()
    }
}

/// A node of the backward graph as a tensor holds it (the op that made it): the autograd
/// engine, which records every node, implements it and reads its own node type back.
pub trait GradFn: Any + Send + Sync + fmt::Debug {
    /// The op the node differentiates.
    fn name(&self) -> &str;
    /// How many tensors the node keeps for its backward now (0 once its backward released
    /// them).
    fn saved_count(&self) -> usize;
}

/// Autograd state of one tensor. Interior mutability: tensors are shared through `Arc`.
/// Nodes are attached by the autograd observer of dispatch; nothing outside this crate can
/// install or replace one.
#[derive(Default)]
pub struct AutogradMeta {
    pub(crate) requires_grad: AtomicBool,
    grad: Mutex<Option<Tensor>>,
    /// The node that made this tensor and which of its outputs this tensor is.
    grad_fn: Mutex<Option<(Arc<dyn GradFn>, usize)>>,
    grad_layout: Mutex<Option<NdSbp>>,
}

impl AutogradMeta {
    pub fn requires_grad(&self) -> bool {
        self.requires_grad.load(Ordering::Relaxed)
    }
    /// The accumulated gradient, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.grad.lock().unwrap_or_else(|e| e.into_inner()) = g;
    }
    /// The node that made this tensor (None for leaves and tensors made without grad).
    pub fn grad_fn(&self) -> Option<Arc<dyn GradFn>> {
        self.grad_edge().map(|(n, _)| n)
    }
    /// The node that made this tensor and the index of this tensor among its outputs.
    pub(crate) fn grad_edge(&self) -> Option<(Arc<dyn GradFn>, usize)> {
        self.grad_fn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// The nd-SBP a leaf's gradient is boxed to as it accumulates (None: as it comes).
    pub fn grad_layout(&self) -> Option<NdSbp> {
        self.grad_layout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    pub(crate) fn set_grad_layout(&self, nd: Option<NdSbp>) {
        *self.grad_layout.lock().unwrap_or_else(|e| e.into_inner()) = nd;
    }
    pub(crate) fn set_grad_fn(&self, f: Option<(Arc<dyn GradFn>, usize)>) {
        *self.grad_fn.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }
}

impl fmt::Debug for AutogradMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AutogradMeta")
            .field("requires_grad", &self.requires_grad())
            .finish()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({})", self.describe())
    }
}

impl fmt::Display for Tensor {
    /// The local piece's values (global tensors print their piece and layout).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "tensor {}", self.describe())?;
        match self.storage() {
            Some(Storage::Cpu(a)) => crate::with_array!(a, x => write!(f, "{x}")),
            Some(Storage::Device(d)) => write!(f, "<{} piece on {}>", d.shape(), d.device()),
            None => f.write_str("<no piece on this rank>"),
        }
    }
}

/// `text` of each of `inputs`, joined by `sep`, for messages.
pub(crate) fn inputs_text<S: ToString>(
    inputs: &[&Tensor],
    sep: &str,
    text: impl Fn(&Tensor) -> S,
) -> String {
    inputs
        .iter()
        .map(|t| text(t).to_string())
        .collect::<Vec<_>>()
        .join(sep)
}

/// The shapes of `inputs`, for messages: `[4, 5], [5]`.
pub(crate) fn shapes_text(inputs: &[&Tensor]) -> String {
    inputs_text(inputs, ", ", |t| t.shape().to_string())
}

/// The nd-SBPs of `inputs` (`local` for a local tensor), for messages.
pub(crate) fn sbps_text(inputs: &[&Tensor]) -> String {
    inputs_text(inputs, ", ", |t| {
        t.nd_sbp()
            .map_or_else(|| "local".to_string(), |s| s.to_string())
    })
}

/// The devices of `inputs`, for messages: `cpu, cuda:0`.
pub(crate) fn devices_text(inputs: &[&Tensor]) -> String {
    inputs_text(inputs, ", ", Tensor::device)
}

/// The placements of `inputs` (empty for a local tensor), for messages: `a vs b`.
pub(crate) fn placements_text(inputs: &[&Tensor]) -> String {
    inputs_text(inputs, " vs ", |t| {
        t.placement().map_or_else(String::new, |p| p.to_string())
    })
}

/// A `Mixed` error naming `op` when `inputs` mix global and local tensors.
pub(crate) fn check_not_mixed(op: &'static str, inputs: &[&Tensor]) -> crate::Result<()> {
    let global = inputs.first().is_some_and(|t| t.is_global());
    if inputs.iter().any(|t| t.is_global() != global) {
        return Err(crate::TensorError::Mixed {
            op,
            kinds: inputs_text(
                inputs,
                ", ",
                |t| {
                    if t.is_global() {
                        "global"
                    } else {
                        "local"
                    }
                },
            ),
            shapes: shapes_text(inputs),
        });
    }
    Ok(())
}
