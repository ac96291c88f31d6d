//! Fused element-wise CUDA kernel: the program's generated kernel (`cuda/fused_elementwise.rs`)
//! launched on the executor's pieces, each input read by how it broadcasts to the output.

use crate::fused_elementwise::{launch, reach, FusedArgs, FUSED_MAXD};
use crate::ops::CudaKernels;
use crate::storage::CudaStorage;
use oxiflow_tensor::backend::{kernel_err, OpFamily};
use oxiflow_tensor::custom::{
    FusedElementwise, FusedElementwiseKernels, MAX_FUSED_INPUTS, MAX_FUSED_OUTPUTS,
};
use oxiflow_tensor::Result;

/// A typed error unless `got` pieces are the `wanted` ones the program `verb`s (`noun`: inputs
/// or outputs; `unit`: what the count of pieces got is said in) and at most `max`.
fn check_arity(
    name: &'static str,
    (verb, noun, unit): (&str, &str, &str),
    wanted: usize,
    got: usize,
    max: usize,
) -> Result<()> {
    if got != wanted || got > max {
        return Err(kernel_err(
            name,
            format!("the program {verb} {wanted} {noun}, got {got}{unit}"),
        ));
    }
    Ok(())
}

impl FusedElementwiseKernels for CudaKernels {
    fn fused_elementwise(
        &self,
        op: &FusedElementwise,
        x: &[&CudaStorage],
        out: &mut [CudaStorage],
    ) -> Result<()> {
        let name = op.name();
        let program = &op.program;
        let Some(first) = out.first() else {
            return Err(kernel_err(name, "no output buffer".into()));
        };
        let out_dims = first.shape.dims().to_vec();
        let dtypes = program.output_dtypes();
        let outputs = ("writes", "outputs", " buffers");
        check_arity(name, outputs, dtypes.len(), out.len(), MAX_FUSED_OUTPUTS)?;
        let mut outs = [0u64; MAX_FUSED_OUTPUTS];
        for (m, (o, &dt)) in out.iter().zip(&dtypes).enumerate() {
            if o.dtype != dt || o.shape != first.shape {
                return Err(kernel_err(
                    name,
                    format!(
                        "output buffer {m} is {} {}, the program writes {dt} {}",
                        o.dtype, o.shape, first.shape
                    ),
                ));
            }
            outs[m] = o.ptr();
        }
        let inputs = ("reads", "inputs", "");
        check_arity(name, inputs, program.inputs(), x.len(), MAX_FUSED_INPUTS)?;
        let mut args = FusedArgs {
            n: first.numel() as i64,
            ndim: out_dims.len().min(FUSED_MAXD) as i32,
            pad: 0,
            dims: [1; FUSED_MAXD],
            ptr: [0; MAX_FUSED_INPUTS],
            repeat: [1; MAX_FUSED_INPUTS],
            strides: [[0; FUSED_MAXD]; MAX_FUSED_INPUTS],
            out: outs,
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
                        p.shape, first.shape
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
