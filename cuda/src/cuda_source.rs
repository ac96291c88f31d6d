//! `CudaSource`: a CUDA source of a crate outside the library (its kernels named by a
//! `KernelIds` enum), made ready once per process through the library's NVRTC path.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaFunction, CudaModule};

use crate::error::derr;
use crate::nvrtc_module::load_source;
use crate::runtime::CudaRuntime;

/// The kernels of one CUDA source as a typed id: an enum naming every `extern "C"` entry
/// point the source defines, so launches look kernels up by value, never by a built string.
pub trait KernelIds: Copy + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// Every kernel of the source.
    const ALL: &'static [Self];
    /// The kernel's entry point in the source.
    fn entry(self) -> &'static str;
}

/// The kernels of a loaded source, in `K::ALL`'s order.
struct Loaded {
    funcs: Vec<CudaFunction>,
    _module: Arc<CudaModule>,
}

// SAFETY: as for `Module`: driver handles the CUDA driver lets any thread use.
unsafe impl Sync for Loaded {}
// SAFETY: as above.
unsafe impl Send for Loaded {}

/// A CUDA source of a crate outside the library, made ready once per process through the
/// library's path (the on-disk kernel cache, else NVRTC, with the library's options for the
/// device's own architecture; build times recorded in `kernel_builds`), after the library's
/// device prelude (`bf16_t`/`f16_t` with `ld`/`st` through f32, warp reductions); its kernels
/// named by `K`.
pub struct CudaSource<K: KernelIds> {
    what: &'static str,
    text: &'static str,
    loaded: OnceLock<Result<Loaded, String>>,
    _kernels: PhantomData<K>,
}

impl<K: KernelIds> CudaSource<K> {
    /// The source `text` (named `what` in build records and errors).
    pub const fn new(what: &'static str, text: &'static str) -> Self {
        CudaSource {
            what,
            text,
            loaded: OnceLock::new(),
            _kernels: PhantomData,
        }
    }

    /// Kernel `k` on `rt`'s device, loading the source on first use (a failure is kept and
    /// reported again, naming `op`).
    pub fn function(
        &self,
        rt: &CudaRuntime,
        op: &'static str,
        k: K,
    ) -> oxiflow_tensor::Result<&CudaFunction> {
        let loaded = self.loaded.get_or_init(|| {
            let text = format!("{}{}", crate::library_sources::DEVICE_TYPES, self.text);
            let module = load_source(rt.context(), self.what, &text)?;
            let funcs = K::ALL
                .iter()
                .map(|id| {
                    module
                        .load_function(id.entry())
                        .map_err(|e| format!("kernel {}: {e}", id.entry()))
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Loaded {
                funcs,
                _module: module,
            })
        });
        let loaded = loaded
            .as_ref()
            .map_err(|e| derr(op, format!("{}: {e}", self.what)))?;
        K::ALL
            .iter()
            .position(|&id| id == k)
            .and_then(|i| loaded.funcs.get(i))
            .ok_or_else(|| derr(op, format!("{k:?} is not listed in its KernelIds::ALL")))
    }
}

/// Implements [`KernelIds`] for the kernels of a source whose ids are kinds over values (an
/// element type, a byte width): `ALL` lists every kind with every value of its group, in
/// order, then the kinds without a value; a kernel's entry point is its kind's prefix, `_` and
/// the value's suffix (`F32` -> `f32`, `F64` -> `f64`, `BF16` -> `bf16`, `F16` -> `f16`, a
/// byte width `2` -> `b2`). Element types are written as `DType`'s variants (with `DType` in
/// scope where the macro is called). An id outside `ALL` has no entry point (`""`).
///
/// ```text
/// kernel_ids!(DecodeKernel {
///     [F32, F64, BF16, F16] { Rotary => "rotary_at", Attention => "decode_attention" },
///     [2, 4, 8] { Rows => "write_rows" },
///     Fill => "fill",
/// });
/// kernel_ids!(ArgMaxKernel([F32, F64, BF16, F16]) => "argmax"); // a tuple struct over values
/// ```
#[macro_export]
macro_rules! kernel_ids {
    ($ty:ident([$($v:tt),+ $(,)?]) => $prefix:literal) => {
        impl $crate::KernelIds for $ty {
            const ALL: &'static [Self] = &[$($ty($crate::kernel_ids!(@value $v))),+];
            fn entry(self) -> &'static str {
                $(
                    if self == $ty($crate::kernel_ids!(@value $v)) {
                        return concat!($prefix, "_", $crate::kernel_ids!(@suffix $v));
                    }
                )+
                ""
            }
        }
    };
    ($ty:ident { $($body:tt)* }) => {
        impl $crate::KernelIds for $ty {
            const ALL: &'static [Self] = $crate::kernel_ids!(@all $ty [] $($body)*);
            fn entry(self) -> &'static str {
                $crate::kernel_ids!(@entry self $ty $($body)*);
                ""
            }
        }
    };
    // `ALL`, accumulated kind by kind.
    (@all $ty:ident [$($acc:tt)*] $(,)?) => {
        &[$($acc)*]
    };
    (@all $ty:ident [$($acc:tt)*] [$($v:tt),+ $(,)?] {} $($rest:tt)*) => {
        $crate::kernel_ids!(@all $ty [$($acc)*] $($rest)*)
    };
    (@all $ty:ident [$($acc:tt)*] [$($v:tt),+ $(,)?]
        { $kind:ident => $prefix:literal $(, $($more:tt)*)? } $($rest:tt)*) => {
        $crate::kernel_ids!(
            @all $ty [$($acc)* $($ty::$kind($crate::kernel_ids!(@value $v)),)+]
            [$($v),+] { $($($more)*)? } $($rest)*
        )
    };
    (@all $ty:ident [$($acc:tt)*] , $($rest:tt)*) => {
        $crate::kernel_ids!(@all $ty [$($acc)*] $($rest)*)
    };
    (@all $ty:ident [$($acc:tt)*] $unit:ident => $entry:literal $($rest:tt)*) => {
        $crate::kernel_ids!(@all $ty [$($acc)* $ty::$unit,] $($rest)*)
    };
    // `entry`, one `if` per kernel.
    (@entry $self:ident $ty:ident $(,)?) => {};
    (@entry $self:ident $ty:ident [$($v:tt),+ $(,)?] {} $($rest:tt)*) => {
        $crate::kernel_ids!(@entry $self $ty $($rest)*)
    };
    (@entry $self:ident $ty:ident [$($v:tt),+ $(,)?]
        { $kind:ident => $prefix:literal $(, $($more:tt)*)? } $($rest:tt)*) => {
        $(
            if $self == $ty::$kind($crate::kernel_ids!(@value $v)) {
                return concat!($prefix, "_", $crate::kernel_ids!(@suffix $v));
            }
        )+
        $crate::kernel_ids!(@entry $self $ty [$($v),+] { $($($more)*)? } $($rest)*)
    };
    (@entry $self:ident $ty:ident , $($rest:tt)*) => {
        $crate::kernel_ids!(@entry $self $ty $($rest)*)
    };
    (@entry $self:ident $ty:ident $unit:ident => $entry:literal $($rest:tt)*) => {
        if $self == $ty::$unit {
            return $entry;
        }
        $crate::kernel_ids!(@entry $self $ty $($rest)*)
    };
    (@value $d:ident) => {
        DType::$d
    };
    (@value $bytes:literal) => {
        $bytes
    };
    (@suffix F32) => {
        "f32"
    };
    (@suffix F64) => {
        "f64"
    };
    (@suffix BF16) => {
        "bf16"
    };
    (@suffix F16) => {
        "f16"
    };
    (@suffix $bytes:literal) => {
        concat!("b", $bytes)
    };
}
