//! The public op contract seen from outside the tensor crate: an op defined here (`Axpy`, with
//! a scratch buffer) runs through dispatch on local and global tensors, keys the dispatch cache
//! by its attribute bytes, gets its declared scratch from the executor, fails with the typed
//! `NoKernel` error for a dtype it has no kernel for, records and replays in a compiled step,
//! and an op that says it cannot be replayed makes the compile refuse the step by its name.

mod common;

use std::sync::LazyLock;
use std::time::Duration;

use common::vals;

use oxiflow_compile::{CompileError, CompiledStep};
use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, run_ranks, CpuArray, CpuBackend, DeviceType, Extern, ExternOp, Grad, Inferred,
    KernelIo, Kernels, MetaError, MetaResult, OutSpec, Result, Saves, Sbp, Tensor, TensorError,
};

/// `a * x` computed into a scratch buffer, then copied out (a kernel that needs scratch).
#[derive(Debug)]
struct Axpy {
    a: f64,
    /// Says the op cannot be replayed (for the compile's refusal).
    unreplayable: bool,
}

static KERNELS: LazyLock<Kernels> = LazyLock::new(|| {
    Kernels::new().with_scratch::<Axpy, CpuBackend>(
        &[DType::F64],
        scaled_via_scratch,
        |_, ins, _| ins.to_vec(),
    )
});

fn scaled_via_scratch(op: &Axpy, _b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let bad = |detail: &str| TensorError::Kernel {
        op: "axpy",
        detail: detail.into(),
    };
    let ([CpuArray::F64(x)], [CpuArray::F64(y)], [CpuArray::F64(s)]) =
        (io.inputs, &mut *io.outputs, &mut *io.scratch)
    else {
        return Err(bad("expects one f64 input, output and scratch buffer"));
    };
    if s.shape() != x.shape() {
        return Err(bad("the scratch buffer is not the declared input's shape"));
    }
    s.zip_mut_with(x, |s, &x| *s = op.a * x);
    y.assign(s);
    Ok(())
}

impl ExternOp for Axpy {
    fn name(&self) -> &'static str {
        "axpy"
    }
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend(self.a.to_bits().to_le_bytes());
        key.push(u8::from(self.unreplayable));
    }
    fn arity(&self) -> (usize, usize) {
        (1, 1)
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        if !dtypes[0].is_float() && dtypes[0] != DType::I64 {
            return Err(MetaError::DType(format!("got {}", dtypes[0])));
        }
        Ok(Inferred::new(
            rules::unary(shapes[0], true, mode),
            dtypes[0],
        ))
    }
    fn kernels(&self) -> &Kernels {
        &KERNELS
    }
    fn saves(&self, _needs: &[bool]) -> Saves {
        Saves::NOTHING
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g.dy()?.scale(self.a)?)])
    }
    fn replay_refusal(&self) -> Option<String> {
        self.unreplayable
            .then(|| "it stands in for an op acting on the host".into())
    }
}

fn axpy(x: &Tensor, a: f64) -> Result<Tensor> {
    dispatch(
        Extern::new(Axpy {
            a,
            unreplayable: false,
        })
        .into(),
        &[x],
    )
}

#[test]
fn an_outside_op_runs_with_scratch_and_a_backward() {
    let x = Tensor::randn([3, 4], 1, DType::F64).requires_grad_(true);
    let y = axpy(&x, 2.5).unwrap();
    let want: Vec<f64> = vals(&x).iter().map(|v| 2.5 * v).collect();
    assert_eq!(vals(&y), want);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![2.5; 12]);
    let scratch = Extern::new(Axpy {
        a: 1.0,
        unreplayable: false,
    })
    .scratch(
        oxiflow_tensor::BackendId::of::<CpuBackend>(),
        &[OutSpec {
            shape: Shape::from(&[3, 4][..]),
            dtype: DType::F64,
        }],
        &[],
    )
    .unwrap();
    assert_eq!(
        scratch.len(),
        1,
        "the declared scratch is what the executor allocates"
    );
}

#[test]
fn attributes_key_the_dispatch_cache() {
    let p = Placement::new(DeviceType::Cpu, vec![2], vec![0, 1]).unwrap();
    run_ranks(2, Duration::from_secs(20), |_| {
        let x = Tensor::randn_global([5, 2], 1, DType::F64, &p, Sbp::S(0)).unwrap();
        let ctx = x.context().unwrap().clone();
        let y = axpy(&x, 2.0).unwrap();
        let n = ctx.dispatch_cache_len();
        let _ = axpy(&x, 2.0).unwrap();
        assert_eq!(ctx.dispatch_cache_len(), n, "equal attributes: one entry");
        let z = axpy(&x, 3.0).unwrap();
        assert_eq!(
            ctx.dispatch_cache_len(),
            n + 1,
            "other attributes: another entry"
        );
        assert_eq!(y.nd_sbp().unwrap().to_string(), "S(0)");
        let whole = Tensor::randn([5, 2], 1, DType::F64);
        let want: Vec<f64> = vals(&whole).iter().map(|v| 3.0 * v).collect();
        assert_eq!(vals(&z), want);
    });
}

#[test]
fn a_dtype_without_a_kernel_is_a_typed_error_naming_both() {
    let x = Tensor::randn([2, 2], 1, DType::F32);
    let e = axpy(&x, 1.0).unwrap_err();
    assert!(
        matches!(
            &e,
            TensorError::NoKernel { op: "axpy", backend: "cpu", dtypes, available }
                if dtypes == "f32" && available == "cpu for f64"
        ),
        "{e}"
    );
    let ids = x.cast(DType::I64).unwrap();
    assert!(matches!(axpy(&ids, 1.0), Err(TensorError::NoKernel { .. })));
}

#[test]
fn an_outside_op_records_and_replays_or_is_refused_by_name() {
    let x0 = Tensor::randn([4, 3], 7, DType::F64);
    let mut step = CompiledStep::new();
    let run = |step: &mut CompiledStep, x: &Tensor| {
        step.run::<CompileError, _>(std::slice::from_ref(x), || Ok(vec![axpy(x, 4.0)?.add(x)?]))
    };
    let (first, _) = run(&mut step, &x0).unwrap();
    let x1 = Tensor::randn([4, 3], 8, DType::F64);
    let (again, how) = run(&mut step, &x1).unwrap();
    assert!(matches!(how, oxiflow_compile::StepRun::Replayed));
    let want = |x: &Tensor| vals(x).iter().map(|v| 5.0 * v).collect::<Vec<_>>();
    assert_eq!(vals(&first[0]), want(&x0));
    assert_eq!(
        vals(&again[0]),
        want(&x1),
        "the replay ran the op's kernel on the new input"
    );

    let mut refusing = CompiledStep::new();
    let e = refusing
        .run::<CompileError, _>(std::slice::from_ref(&x0), || {
            let op = Axpy {
                a: 1.0,
                unreplayable: true,
            };
            Ok(vec![dispatch(Extern::new(op).into(), &[&x0])?])
        })
        .unwrap_err();
    assert!(
        matches!(&e, CompileError::Unreplayable { op: "axpy", why } if why.contains("host")),
        "{e}"
    );
}
