//! Fused element-wise CUDA kernel: the program's generated kernel (`cuda/fused_elementwise.rs`)
//! launched on the executor's pieces, each input read by how it broadcasts to the output.

use crate::cuda::fused_elementwise::{launch, reach, FusedArgs, FUSED_MAXD};
use crate::cuda::ops::CudaKernels;
use crate::cuda::storage::CudaStorage;
use crate::op::custom::{FusedElementwise, FusedElementwiseKernels, MAX_FUSED_INPUTS};
use crate::op::{kernel_err, OpFamily};
use crate::Result;

impl FusedElementwiseKernels for CudaKernels {
    fn fused_elementwise(
        &self,
        op: &FusedElementwise,
        x: &[&CudaStorage],
        out: &mut CudaStorage,
    ) -> Result<()> {
        let name = op.name();
        let program = &op.program;
        let out_dims = out.shape.dims().to_vec();
        if x.len() != program.inputs() || x.len() > MAX_FUSED_INPUTS {
            return Err(kernel_err(
                name,
                format!(
                    "the program reads {} inputs, got {}",
                    program.inputs(),
                    x.len()
                ),
            ));
        }
        if out.dtype != program.output_dtype() {
            return Err(kernel_err(
                name,
                format!(
                    "the output buffer is {}, the program writes {}",
                    out.dtype,
                    program.output_dtype()
                ),
            ));
        }
        let mut args = FusedArgs {
            n: out.numel() as i64,
            ndim: out_dims.len().min(FUSED_MAXD) as i32,
            pad: 0,
            dims: [1; FUSED_MAXD],
            ptr: [0; MAX_FUSED_INPUTS],
            repeat: [1; MAX_FUSED_INPUTS],
            strides: [[0; FUSED_MAXD]; MAX_FUSED_INPUTS],
            out: out.ptr(),
        };
        for (d, &n) in out_dims.iter().take(FUSED_MAXD).enumerate() {
            args.dims[d] = n as i64;
        }
        let mut reaches = Vec::with_capacity(x.len());
        for (k, p) in x.iter().enumerate() {
            if Some(p.dtype) != program.input_dtype(k) {
                return Err(kernel_err(
                    name,
                    format!(
                        "input {k} is {}, the program reads {:?}",
                        p.dtype,
                        program.input_dtype(k)
                    ),
                ));
            }
            let (r, repeat, strides) = reach(p.shape.dims(), &out_dims).ok_or_else(|| {
                kernel_err(
                    name,
                    format!(
                        "input {k} {} does not broadcast to the output {} (at most {FUSED_MAXD} dims when strided)",
                        p.shape, out.shape
                    ),
                )
            })?;
            reaches.push(r);
            args.ptr[k] = if p.numel() == 0 { 0 } else { p.ptr() };
            args.repeat[k] = repeat;
            args.strides[k] = strides;
        }
        Ok(launch(&self.rt, name, program, &reaches, args)?)
    }
}
