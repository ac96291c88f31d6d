//! The public op contract: [`ExternOp`], the object-safe trait a crate outside `tensor`
//! implements to add an op (in the spirit of candle's `CustomOp1/2/3` and burn's backends), and
//! [`Extern`], the handle that carries one through dispatch as `Op::Extern`.
//!
//! An op says its name, arity and attribute bytes (the dispatch cache key is its type, its name
//! and those bytes), its output shapes, dtypes and SBP candidates (built with
//! `oxiflow_sbp::rules`, the one home for rules), its local attributes per rank, what its
//! backward saves and the backward itself (written with dispatched ops), and its [`Kernels`]: a
//! table of typed kernel functions, one per backend (found by the backend's type,
//! [`BackendId`]), each for a list of input dtypes and with the scratch buffers it needs
//! declared so the executor allocates them. A call whose backend or input dtypes have no kernel
//! is [`TensorError::NoKernel`], raised by dispatch from metadata before any boxing or kernel
//! runs, so every rank fails alike.
//!
//! ```text
//! impl ExternOp for SwiGlu {
//!     fn name(&self) -> &'static str { "swiglu" }
//!     fn kernels(&self) -> &Kernels { &SWIGLU_KERNELS }   // Kernels::new().with::<SwiGlu, CpuBackend>(..)
//!     ..
//! }
//! let y = dispatch(Extern::new(SwiGlu).into(), &[&gate, &up])?;
//! ```

use std::any::{Any, TypeId};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Shape};
use smallvec::SmallVec;

use super::{
    kernel_err, Grad, Inferred, KernelBackend, LocalAt, MetaResult, OpFamily, OutSpec, RunKernels,
    Saves,
};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

/// An op defined outside the tensor crate (see the module docs). Inputs reach `infer`, the
/// kernels and `backward` only after dispatch has checked their count against `arity`.
pub trait ExternOp: Send + Sync + fmt::Debug + Any {
    /// The op's name, as errors, explain and traces print it.
    fn name(&self) -> &'static str;
    /// Writes the op's attributes as bytes: two ops of one type are the same op (one dispatch
    /// cache entry, one recorded node) exactly when their bytes are equal. An op without
    /// attributes writes none (the default).
    fn attrs(&self, _key: &mut Vec<u8>) {}
    /// Number of inputs (min, max).
    fn arity(&self) -> (usize, usize);
    /// Checks shapes and dtypes; returns every output's dtype and the op's rules (each
    /// output's shape and, in `RuleMode::Candidates`, its SBP candidates).
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred>;
    /// The op with one rank's local attributes, given where its pieces sit in the global
    /// tensors; None when they equal the global ones.
    fn local(&self, _at: &LocalAt<'_>) -> Option<Extern> {
        None
    }
    /// The op's kernels, one per backend and dtype list.
    fn kernels(&self) -> &Kernels;
    /// Why the op has no gradient at all (it returns indices, a statistic, another op's
    /// gradients), if it has none: then no output is differentiable, the op saves nothing and
    /// its backward is the typed error naming the op and this reason. A differentiable op
    /// returns None and defines `saves` and `backward`.
    fn no_gradient(&self) -> Option<&'static str> {
        None
    }
    /// Whether output `i` carries a gradient (every output, unless `no_gradient` says why not).
    fn differentiable(&self, _output: usize) -> bool {
        self.no_gradient().is_none()
    }
    /// The inputs and outputs the backward reads, given which inputs need a gradient.
    fn saves(&self, _needs: &[bool]) -> Saves {
        Saves::NOTHING
    }
    /// Input gradients from the output gradients, written with dispatched ops (None where an
    /// input needs none).
    fn backward(&self, _g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        Err(Grad::unsupported(
            self.name(),
            self.no_gradient().unwrap_or("the op defines no backward"),
        ))
    }
    /// Why a compiled step cannot replay this op's kernels from a recording (e.g. it acts on
    /// the host), if it cannot; the compile then refuses the step naming the op and this.
    fn replay_refusal(&self) -> Option<String> {
        None
    }
    /// Why a device graph cannot capture this op's kernels (e.g. they read device values back
    /// to the host to size their work), if it cannot; a compiled step holding it then replays
    /// launch by launch, saying why.
    fn graph_refusal(&self) -> Option<String> {
        None
    }
}

/// A backend's identity for kernel lookup: its kernel-side type (and its name for messages).
#[derive(Clone, Copy)]
pub struct BackendId {
    type_id: TypeId,
    name: &'static str,
}

impl BackendId {
    /// The id of backend `B`.
    pub fn of<B: KernelBackend + 'static>() -> BackendId {
        BackendId {
            type_id: TypeId::of::<B>(),
            name: B::NAME,
        }
    }
    /// The backend's name (`cpu`, `cuda`).
    pub fn name(self) -> &'static str {
        self.name
    }
}

impl PartialEq for BackendId {
    fn eq(&self, other: &Self) -> bool {
        self.type_id == other.type_id
    }
}
impl Eq for BackendId {}

impl fmt::Debug for BackendId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// What one kernel call reads and writes on backend `B`: the input pieces, one uninitialised
/// buffer per output (the kernel writes every element), and the scratch buffers its entry
/// declared, all from the backend's allocator.
pub struct KernelIo<'a, B: KernelBackend> {
    pub inputs: &'a [&'a B::Piece],
    pub outputs: &'a mut [B::Out],
    pub scratch: &'a mut [B::Out],
}

/// A kernel of op type `O` on backend `B`.
pub type KernelFn<O, B> = fn(&O, &B, KernelIo<'_, B>) -> Result<()>;

/// The scratch buffers a kernel of op type `O` needs, from the specs of its inputs and
/// outputs.
pub type ScratchFn<O> = fn(&O, &[OutSpec], &[OutSpec]) -> Vec<OutSpec>;

/// One backend's kernel with the op type erased.
trait RunOn<B: KernelBackend>: Send + Sync {
    fn run(&self, op: &dyn ExternOp, b: &B, io: KernelIo<'_, B>) -> Result<()>;
}

struct Typed<O, B: KernelBackend> {
    run: KernelFn<O, B>,
}

impl<O: ExternOp, B: KernelBackend + 'static> RunOn<B> for Typed<O, B> {
    fn run(&self, op: &dyn ExternOp, b: &B, io: KernelIo<'_, B>) -> Result<()> {
        let any: &dyn Any = op;
        let typed = any.downcast_ref::<O>().ok_or_else(|| {
            kernel_err(
                op.name(),
                "its kernel table holds another op type's kernel".into(),
            )
        })?;
        (self.run)(typed, b, io)
    }
}

/// The scratch declaration with the op type erased.
type ErasedScratch =
    Box<dyn Fn(&dyn ExternOp, &[OutSpec], &[OutSpec]) -> Vec<OutSpec> + Send + Sync>;

/// One kernel of a [`Kernels`] table.
struct Entry {
    backend: BackendId,
    dtypes: SmallVec<[DType; 4]>,
    /// An `Arc<dyn RunOn<B>>` for the entry's backend `B`.
    run: Box<dyn Any + Send + Sync>,
    scratch: Option<ErasedScratch>,
}

/// An op's kernels: per backend, the input dtypes each kernel takes (every input's dtype must
/// be one of them) and the scratch it needs. Built once per op type (a `static`).
#[derive(Default)]
pub struct Kernels {
    entries: Vec<Entry>,
}

impl Kernels {
    /// No kernels: every call is [`TensorError::NoKernel`].
    pub fn new() -> Kernels {
        Kernels::default()
    }

    /// These and `run`, the kernel of op type `O` on backend `B` for inputs of `dtypes`.
    pub fn with<O: ExternOp, B: KernelBackend + 'static>(
        self,
        dtypes: &[DType],
        run: KernelFn<O, B>,
    ) -> Kernels {
        self.push::<O, B>(dtypes, run, None)
    }

    /// [`Kernels::with`] for a kernel that needs the scratch buffers `scratch` declares
    /// (allocated by the executor from the backend's allocator, given to the kernel in
    /// `KernelIo::scratch`).
    pub fn with_scratch<O: ExternOp, B: KernelBackend + 'static>(
        self,
        dtypes: &[DType],
        run: KernelFn<O, B>,
        scratch: ScratchFn<O>,
    ) -> Kernels {
        let erased: ErasedScratch = Box::new(move |op, ins, outs| {
            let any: &dyn Any = op;
            any.downcast_ref::<O>()
                .map_or_else(Vec::new, |o| scratch(o, ins, outs))
        });
        self.push::<O, B>(dtypes, run, Some(erased))
    }

    fn push<O: ExternOp, B: KernelBackend + 'static>(
        mut self,
        dtypes: &[DType],
        run: KernelFn<O, B>,
        scratch: Option<ErasedScratch>,
    ) -> Kernels {
        let run: Arc<dyn RunOn<B>> = Arc::new(Typed { run });
        self.entries.push(Entry {
            backend: BackendId::of::<B>(),
            dtypes: dtypes.iter().copied().collect(),
            run: Box::new(run),
            scratch,
        });
        self
    }

    /// The kernel for `backend` taking inputs of `dtypes`, or the typed error naming `op`,
    /// the backend, the dtypes and the kernels there are.
    fn find(&self, op: &'static str, backend: BackendId, dtypes: &[DType]) -> Result<&Entry> {
        let fits = |e: &&Entry| e.backend == backend && dtypes.iter().all(|d| e.dtypes.contains(d));
        self.entries
            .iter()
            .find(fits)
            .ok_or_else(|| TensorError::NoKernel {
                op,
                backend: backend.name(),
                dtypes: list(dtypes),
                available: if self.entries.is_empty() {
                    "none".into()
                } else {
                    self.entries
                        .iter()
                        .map(|e| format!("{} for {}", e.backend.name(), list(&e.dtypes)))
                        .collect::<Vec<_>>()
                        .join("; ")
                },
            })
    }
}

fn list(dtypes: &[DType]) -> String {
    dtypes
        .iter()
        .map(DType::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// An [`ExternOp`] as dispatch carries it (`Op::Extern`): shared, compared and hashed by the
/// op's type and attribute bytes.
#[derive(Clone)]
pub struct Extern {
    op: Arc<dyn ExternOp>,
    key: Arc<[u8]>,
}

impl Extern {
    /// The handle of `op`.
    pub fn new(op: impl ExternOp) -> Extern {
        let mut key = Vec::new();
        op.attrs(&mut key);
        Extern {
            op: Arc::new(op),
            key: key.into(),
        }
    }

    /// The op.
    pub fn op(&self) -> &dyn ExternOp {
        &*self.op
    }

    /// The op as its own type `O`, if it is one.
    pub fn downcast<O: ExternOp>(&self) -> Option<&O> {
        let any: &dyn Any = &*self.op;
        any.downcast_ref::<O>()
    }

    /// A typed error unless the op has a kernel on `backend` for inputs of `dtypes`: what
    /// dispatch checks, from metadata, before any communication.
    pub fn check_kernel(&self, backend: BackendId, dtypes: &[DType]) -> Result<()> {
        self.op
            .kernels()
            .find(self.op.name(), backend, dtypes)
            .map(|_| ())
    }

    /// The scratch buffers the op's kernel on `backend` needs for inputs and outputs of these
    /// specs (none when the kernel declares none; a typed error when there is no kernel).
    pub fn scratch(
        &self,
        backend: BackendId,
        inputs: &[OutSpec],
        outputs: &[OutSpec],
    ) -> Result<Vec<OutSpec>> {
        let dtypes: SmallVec<[DType; 4]> = inputs.iter().map(|s| s.dtype).collect();
        let e = self.op.kernels().find(self.op.name(), backend, &dtypes)?;
        Ok(e.scratch
            .as_ref()
            .map_or_else(Vec::new, |f| f(&*self.op, inputs, outputs)))
    }

    /// Runs the op's kernel on backend `b`: allocates the scratch its entry declares and
    /// writes every output buffer in `out`.
    pub(crate) fn run_on<B: KernelBackend + 'static>(
        &self,
        b: &B,
        x: &[&B::Piece],
        out: &mut [B::Out],
    ) -> Result<()> {
        let in_specs: SmallVec<[OutSpec; 3]> = x.iter().map(|p| b.piece_spec(p)).collect();
        let dtypes: SmallVec<[DType; 3]> = in_specs.iter().map(|s| s.dtype).collect();
        let entry = self
            .op
            .kernels()
            .find(self.op.name(), BackendId::of::<B>(), &dtypes)?;
        let run = entry
            .run
            .downcast_ref::<Arc<dyn RunOn<B>>>()
            .ok_or_else(|| {
                kernel_err(
                    self.op.name(),
                    format!("a {} kernel of another backend type", B::NAME),
                )
            })?;
        let mut scratch: SmallVec<[B::Out; 2]> = SmallVec::new();
        if let Some(f) = &entry.scratch {
            let out_specs: SmallVec<[OutSpec; 2]> = out.iter().map(|o| b.out_spec(o)).collect();
            for spec in f(&*self.op, &in_specs, &out_specs) {
                scratch.push(b.alloc(&spec)?);
            }
        }
        run.run(
            &*self.op,
            b,
            KernelIo {
                inputs: x,
                outputs: out,
                scratch: &mut scratch,
            },
        )
    }
}

impl OpFamily for Extern {
    fn name(&self) -> &'static str {
        self.op.name()
    }
    fn arity(&self) -> (usize, usize) {
        self.op.arity()
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        self.op.infer(shapes, dtypes, mode)
    }
    fn local(&self, at: &LocalAt<'_>) -> Option<Extern> {
        self.op.local(at)
    }
    fn differentiable(&self, output: usize) -> bool {
        self.op.differentiable(output)
    }
    fn saves(&self, needs: &[bool]) -> Saves {
        self.op.saves(needs)
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        self.op.backward(g)
    }
}

impl<B: ExternKernels> RunKernels<B> for Extern {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        b.run_extern(self, x, out)
    }
}

impl PartialEq for Extern {
    fn eq(&self, other: &Self) -> bool {
        let (a, b): (&dyn Any, &dyn Any) = (&*self.op, &*other.op);
        a.type_id() == b.type_id() && self.key == other.key
    }
}
impl Eq for Extern {}

impl Hash for Extern {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let a: &dyn Any = &*self.op;
        a.type_id().hash(state);
        self.key.hash(state);
    }
}

impl fmt::Debug for Extern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Extern({:?})", self.op)
    }
}

/// The kernels of extern ops on a backend: every backend has them, from each op's table.
pub trait ExternKernels: KernelBackend {
    fn run_extern(&self, op: &Extern, x: &[&Self::Piece], out: &mut [Self::Out]) -> Result<()>;
}

impl<T: KernelBackend + 'static> ExternKernels for T {
    fn run_extern(&self, op: &Extern, x: &[&T::Piece], out: &mut [T::Out]) -> Result<()> {
        op.run_on(self, x, out)
    }
}
