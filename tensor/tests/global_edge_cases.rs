//! Global-tensor edge cases: signatures never mix partial reductions over the mesh axes (so
//! boxing can always run them), reductions of 0-d tensors, and `to_global_checked` agreeing on
//! every rank whatever ranks outside the placement hold.

mod common;

use std::time::Duration;

use common::{nd_sbp, on_ranks, one_mesh_of, placed};
use oxiflow_tensor::{run_ranks, DType, NdSbp, Placement, Sbp, Tensor, TensorError};
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_secs(30);

fn close(got: &ndarray::ArrayD<f64>, want: &ndarray::ArrayD<f64>, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes");
    for (g, w) in got.iter().zip(want.iter()) {
        assert!(
            (g - w).abs() <= 1e-9 * (1.0 + w.abs()),
            "{what}: {g} vs {w}"
        );
    }
}

/// `x - x.max(dim)` and the gradient of `max` on x laid out with any nd-SBP, P included.
fn max_chain(x: &Tensor, dim: isize, keepdim: bool) -> (Tensor, Tensor) {
    let m = x.max(&[dim], keepdim).expect("max");
    let mk = if keepdim {
        m.clone()
    } else {
        let mut s = x.shape().dims().to_vec();
        s[dim as usize] = 1;
        m.reshape(s).expect("reshape")
    };
    let y = x.sub(&mk).expect("x - max");
    let xg = x.detach().requires_grad_(true);
    xg.max(&[dim], keepdim)
        .expect("max")
        .square()
        .expect("square")
        .sum_all()
        .expect("sum_all")
        .backward()
        .expect("backward of max");
    (y, xg.grad().expect("grad of x"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn max_and_its_gradient_run_on_every_layout(
        dims in prop::collection::vec(1usize..5, 1..4),
        p in placed(one_mesh_of(&[&[2, 2], &[4], &[1, 3], &[3, 1]])),
        sbp_seed: u64,
        dim_pick: usize,
        keepdim: bool,
    ) {
        let nd = nd_sbp(p.ndim(), dims.len(), sbp_seed, true);
        let dim = (dim_pick % dims.len()) as isize;
        let want_x = Tensor::randn(dims.clone(), 7, DType::F64);
        let (want_y, want_g) = max_chain(&want_x, dim, keepdim);
        let (want_y, want_g) = (want_y.to_ndarray::<f64>().unwrap(), want_g.to_ndarray::<f64>().unwrap());
        let got = on_ranks(&p, |_| {
            let x = Tensor::randn_global(dims.clone(), 7, DType::F64, &p, nd.clone()).unwrap();
            let (y, g) = max_chain(&x, dim, keepdim);
            let b = NdSbp::broadcast(p.ndim());
            (
                y.to_global(&p, b.clone()).unwrap().to_ndarray::<f64>().unwrap(),
                g.to_global(&p, b).unwrap().to_ndarray::<f64>().unwrap(),
            )
        });
        for (y, g) in &got {
            close(y, &want_y, "x - max");
            close(g, &want_g, "grad of max");
        }
    }
}

#[test]
fn reductions_of_zero_dim_global_tensors() {
    let p = Placement::range(oxiflow_tensor::DeviceType::Cpu, 2).unwrap();
    let want = Tensor::randn([3, 4], 3, DType::F64)
        .sum_all()
        .unwrap()
        .to_ndarray::<f64>()
        .unwrap();
    let got = run_ranks(2, TIMEOUT, |_| {
        let x = Tensor::randn_global([3, 4], 3, DType::F64, &p, Sbp::S(0)).unwrap();
        let s = x.sum_all().unwrap();
        let s2 = s.sum_all().unwrap();
        let m = s2.mean_all().unwrap().max(&[], false).unwrap();
        assert_eq!(m.ndim(), 0);
        m.to_global(&p, Sbp::B)
            .unwrap()
            .to_ndarray::<f64>()
            .unwrap()
    });
    for g in got {
        close(&g, &want, "sum_all of sum_all");
    }
}

#[test]
fn to_global_checked_ignores_what_ranks_outside_the_placement_hold() {
    let p = Placement::new(oxiflow_tensor::DeviceType::Cpu, vec![3], vec![0, 1, 2]).unwrap();
    let got = run_ranks(4, TIMEOUT, |rank| {
        // Rank 3 is outside the placement and passes a tensor of another rank and dtype.
        let mine = if rank == 3 {
            Tensor::zeros([5, 5, 5], DType::I64)
        } else {
            Tensor::ones([2, 2], DType::F32)
        };
        let g = mine.to_global_checked(&p, Sbp::S(0))?;
        Ok::<_, TensorError>((g.shape().clone(), g.dtype()))
    });
    for r in &got {
        let (shape, dtype) = r.as_ref().expect("every rank succeeds");
        assert_eq!(shape.dims(), &[6, 2]);
        assert_eq!(*dtype, DType::F32);
    }
}

#[test]
fn to_global_checked_mismatch_inside_the_placement_fails_alike_everywhere() {
    let p = Placement::new(oxiflow_tensor::DeviceType::Cpu, vec![3], vec![0, 1, 2]).unwrap();
    let got = run_ranks(4, TIMEOUT, |rank| {
        let mine = if rank == 1 {
            Tensor::ones([2, 2], DType::F64)
        } else {
            Tensor::ones([2, 2], DType::F32)
        };
        match mine.to_global_checked(&p, Sbp::S(0)) {
            Ok(_) => "ok".to_string(),
            Err(e) => e.to_string(),
        }
    });
    assert!(got[0].contains("rank 1"), "{}", got[0]);
    assert!(got.iter().all(|e| e == &got[0]), "{got:?}");
}

#[test]
fn integer_ops_are_defined_once_for_every_backend() {
    let x = Tensor::from_vec(vec![-3i64, 0, 2, -1], [4]).unwrap();
    let y = x.relu().unwrap().to_ndarray::<i64>().unwrap();
    assert_eq!(y.as_slice().unwrap(), &[0, 0, 2, 0]);
    let e = x.div(&x).unwrap_err();
    assert!(matches!(e, TensorError::DType { .. }), "{e}");
    assert!(x.exp().is_err());
}
