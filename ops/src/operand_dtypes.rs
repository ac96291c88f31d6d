//! What the fused ops share about dtypes: the check that every operand has one float dtype,
//! and their kernel tables (for the element-wise ops the CPU kernel for f32, f64 and bf16, the
//! CUDA kernel for those and f16); and the element type cuBLASLt and the fused attention take
//! for a dtype.

use oxiflow_cuda::kernel_layer::FloatType;
use oxiflow_cuda::{device_error, CudaKernels};
use oxiflow_dtype::DType;
use oxiflow_tensor::{
    CpuBackend, ExternOp, KernelFn, Kernels, MetaError, MetaResult, Result, ScratchFn,
};

/// The dtypes of every CPU kernel and of every CUDA kernel.
const CPU_DTYPES: &[DType] = &[DType::F32, DType::F64, DType::BF16];
const CUDA_DTYPES: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];

/// Every float dtype, what the fused ops whose CPU kernels compute 16-bit data through f32
/// take on both backends.
pub(crate) const FLOATS: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];
/// Every float dtype and i64 (for ops reading class ids beside their floats).
pub(crate) const FLOATS_AND_IDS: &[DType] =
    &[DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64];

/// The kernel table of op type `O`: `cpu` for inputs of `cpu_dtypes`, `cuda` for inputs of
/// `cuda_dtypes`.
pub(crate) fn cpu_and_cuda<O: ExternOp>(
    (cpu_dtypes, cpu): (&[DType], KernelFn<O, CpuBackend>),
    (cuda_dtypes, cuda): (&[DType], KernelFn<O, CudaKernels>),
) -> Kernels {
    Kernels::new()
        .with::<O, CpuBackend>(cpu_dtypes, cpu)
        .with::<O, CudaKernels>(cuda_dtypes, cuda)
}

/// The kernel table of op type `O`: `cpu` and `cuda`, both for inputs of `dtypes`.
pub(crate) fn kernels_for<O: ExternOp>(
    dtypes: &[DType],
    cpu: KernelFn<O, CpuBackend>,
    cuda: KernelFn<O, CudaKernels>,
) -> Kernels {
    cpu_and_cuda((dtypes, cpu), (dtypes, cuda))
}

/// The kernel table of a kernel `$run` generic over the backend, for inputs of `$dtypes`: on
/// the CPU with 16-bit data through f32 ([`wide_kernel`](crate::host_slices::wide_kernel)),
/// and on CUDA.
macro_rules! generic_kernels {
    ($dtypes:expr, $run:ident) => {
        $crate::operand_dtypes::kernels_for(
            $dtypes,
            |op: &_,
             b: &oxiflow_tensor::CpuBackend,
             io: oxiflow_tensor::KernelIo<'_, oxiflow_tensor::CpuBackend>| {
                $crate::host_slices::wide_kernel(op, b, io, $run)
            },
            $run::<oxiflow_cuda::CudaKernels>,
        )
    };
}

/// Declares the calling module's kernel tables `FORWARD` (its `cpu::forward` and
/// `cuda::forward`) and `BACKWARD` (`cpu::backward` and `cuda::backward`), each built by the
/// table function `$table` of this module with the arguments `$arg` before the two kernels.
macro_rules! forward_backward_kernels {
    ($table:ident($($arg:expr),*)) => {
        static FORWARD: std::sync::LazyLock<oxiflow_tensor::Kernels> =
            std::sync::LazyLock::new(|| {
                $crate::operand_dtypes::$table($($arg,)* cpu::forward, cuda::forward)
            });
        static BACKWARD: std::sync::LazyLock<oxiflow_tensor::Kernels> =
            std::sync::LazyLock::new(|| {
                $crate::operand_dtypes::$table($($arg,)* cpu::backward, cuda::backward)
            });
    };
}

pub(crate) use {forward_backward_kernels, generic_kernels};

/// The kernel table of op type `O`: `cpu` for inputs of `cpu_dtypes`, `cuda` with the scratch
/// buffers `scratch` declares for inputs of `cuda_dtypes`.
pub(crate) fn cpu_and_cuda_scratch<O: ExternOp>(
    (cpu_dtypes, cpu): (&[DType], KernelFn<O, CpuBackend>),
    (cuda_dtypes, cuda, scratch): (&[DType], KernelFn<O, CudaKernels>, ScratchFn<O>),
) -> Kernels {
    Kernels::new()
        .with::<O, CpuBackend>(cpu_dtypes, cpu)
        .with_scratch::<O, CudaKernels>(cuda_dtypes, cuda, scratch)
}

/// The kernel table of an element-wise fused op of type `O`: `cpu` for f32, f64 and bf16,
/// `cuda` for f32, f64, bf16 and f16.
pub(crate) fn float_kernels<O: ExternOp>(
    cpu: KernelFn<O, CpuBackend>,
    cuda: KernelFn<O, CudaKernels>,
) -> Kernels {
    cpu_and_cuda((CPU_DTYPES, cpu), (CUDA_DTYPES, cuda))
}

/// The one float dtype of `dtypes`, or why they are not.
pub(crate) fn one_float_dtype(dtypes: &[DType]) -> MetaResult<DType> {
    let d = dtypes[0];
    if dtypes.iter().any(|&x| x != d) {
        let all: Vec<String> = dtypes.iter().map(|d| d.to_string()).collect();
        return Err(MetaError::DType(format!(
            "operands must have the same dtype, got {}",
            all.join(", ")
        )));
    }
    if !d.is_float() {
        return Err(MetaError::DType(format!(
            "operands must be a float dtype, got {d}"
        )));
    }
    Ok(d)
}

/// The element type of cuBLASLt's products and the fused attention for `d` (f32, bf16, f16;
/// f64 has none: a typed error naming `op`).
pub(crate) fn cuda_float_type(op: &'static str, d: DType) -> Result<FloatType> {
    match d {
        DType::F32 => Ok(FloatType::F32),
        DType::BF16 => Ok(FloatType::Bf16),
        DType::F16 => Ok(FloatType::F16),
        d => Err(device_error(op, format!("no CUDA kernel for {d}"))),
    }
}
