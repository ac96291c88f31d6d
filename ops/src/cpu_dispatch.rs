//! The CPU kernels' entry points by dtype: one macro that defines a kernel entry (the
//! `KernelFn` signature) running its generic body for the element type of the first input's
//! dtype, or the typed kernel error naming the op for a dtype the entry has no body for.

/// Defines CPU kernel entries `fn name(op: &Op, _b: &CpuBackend, io: KernelIo<'_, CpuBackend>)
/// -> Result<()>`, each calling its generic body `typed::<T>` with `T` the first of the listed
/// element types whose dtype the first input has (no such type: the kernel error `no CPU
/// kernel for ..` naming the op). The body takes `(op, io)`; written `typed(name)` it takes
/// the op's name and `io`, written `typed(op, name)` the op, its name and `io`.
///
/// ```text
/// cpu_kernels_by_dtype! {
///     [f32, f64, bf16];
///     pub(super) fn forward(RmsNorm) => forward_typed;
///     pub(super) fn backward(RmsNormGrad) => backward_typed;
/// }
/// ```
macro_rules! cpu_kernels_by_dtype {
    ($types:tt; $($vis:vis fn $name:ident($op:ty) => $typed:ident $(($($args:ident),+))?;)+) => {
        $(
            $crate::cpu_dispatch::cpu_kernels_by_dtype!(
                @entry $types $vis fn $name($op) => $typed [$($($args),+)?]
            );
        )+
    };
    (@entry [$($t:ty),+ $(,)?] $vis:vis fn $name:ident($op:ty) => $typed:ident $args:tt) => {
        $vis fn $name(
            op: &$op,
            _b: &oxiflow_tensor::CpuBackend,
            io: oxiflow_tensor::KernelIo<'_, oxiflow_tensor::CpuBackend>,
        ) -> oxiflow_tensor::Result<()> {
            let name = oxiflow_tensor::ExternOp::name(op);
            let dtype = io.inputs.first().map(|a| a.dtype());
            $(
                if dtype == Some(<$t as oxiflow_dtype::Element>::DTYPE) {
                    return $crate::cpu_dispatch::cpu_kernels_by_dtype!(
                        @call $typed::<$t>(op, name, io) $args
                    );
                }
            )+
            Err($crate::host_slices::kernel_err(
                name,
                format!("no CPU kernel for {dtype:?}"),
            ))
        }
    };
    (@call $typed:ident::<$t:ty>($op:ident, $name:ident, $io:ident) []) => {
        $typed::<$t>($op, $io)
    };
    (@call $typed:ident::<$t:ty>($op:ident, $name:ident, $io:ident) [name]) => {
        $typed::<$t>($name, $io)
    };
    (@call $typed:ident::<$t:ty>($op:ident, $name:ident, $io:ident) [op, name]) => {
        $typed::<$t>($op, $name, $io)
    };
}

pub(crate) use cpu_kernels_by_dtype;
