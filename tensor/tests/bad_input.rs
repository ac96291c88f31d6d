//! Bad input on global tensors: mismatched shapes, placements, device types, dtypes and SBP
//! lengths each give a typed error naming op, shapes and SBPs, identical on every rank and
//! raised before any communication (no rank waits in a collective: the test would time out).

use std::time::Duration;

use oxiflow_tensor::{run_ranks, DType, DeviceType, NdSbp, Placement, Sbp, Tensor, TensorError};

fn on_all_ranks(f: impl Fn() -> TensorError + Sync) -> String {
    let errs = run_ranks(4, Duration::from_secs(5), |_| f().to_string());
    for e in &errs {
        assert_eq!(e, &errs[0], "ranks disagree");
    }
    errs[0].clone()
}

fn p4() -> Placement {
    Placement::range(DeviceType::Cpu, 4).unwrap()
}

#[test]
fn mismatched_shapes() {
    let e = on_all_ranks(|| {
        let a = Tensor::randn_global([8, 3], 1, DType::F32, &p4(), Sbp::S(0)).unwrap();
        let b = Tensor::randn_global([8, 5], 2, DType::F32, &p4(), Sbp::B).unwrap();
        let err = a.add(&b).unwrap_err();
        assert!(matches!(err, TensorError::Shape { op: "add", .. }), "{err}");
        err
    });
    assert!(
        e.contains("add") && e.contains("[8, 3]") && e.contains("[8, 5]") && e.contains("S(0), B"),
        "{e}"
    );
    let e = on_all_ranks(|| {
        let a = Tensor::randn_global([8, 3], 1, DType::F32, &p4(), Sbp::S(0)).unwrap();
        a.matmul(&a).unwrap_err()
    });
    assert!(
        e.contains("matmul") && e.contains("[8, 3]") && e.contains("S(0)"),
        "{e}"
    );
}

#[test]
fn mismatched_placements() {
    let e = on_all_ranks(|| {
        let pa = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
        let pb = Placement::new_1d(DeviceType::Cpu, vec![2, 3]).unwrap();
        let a = Tensor::ones_global([4, 4], DType::F32, &pa, Sbp::S(0)).unwrap();
        let b = Tensor::ones_global([4, 4], DType::F32, &pb, Sbp::B).unwrap();
        let err = a.mul(&b).unwrap_err();
        assert!(
            matches!(err, TensorError::Placement { op: "mul", .. }),
            "{err}"
        );
        err
    });
    assert!(
        e.contains("cpu:[0, 1]")
            && e.contains("cpu:[2, 3]")
            && e.contains("[4, 4]")
            && e.contains("S(0), B"),
        "{e}"
    );
}

#[test]
fn mismatched_device_types() {
    let e = on_all_ranks(|| {
        let a = Tensor::ones_global([4, 4], DType::F32, &p4(), Sbp::S(0)).unwrap();
        // A global tensor on a cuda placement needs the CUDA backend: creation fails typed when
        // it is absent; compare metadata with a cuda-placed layout through to_global.
        let cuda = p4().with_device(DeviceType::Cuda);
        match a.to_global(&cuda, Sbp::S(0)) {
            Ok(b) => a.add(&b).unwrap_err(),
            Err(e) => e,
        }
    });
    assert!(e.contains("cuda"), "{e}");
}

#[test]
fn mismatched_dtypes() {
    let e = on_all_ranks(|| {
        let a = Tensor::ones_global([4, 4], DType::F32, &p4(), Sbp::S(0)).unwrap();
        let b = Tensor::ones_global([4, 4], DType::F64, &p4(), Sbp::S(0)).unwrap();
        let err = a.sub(&b).unwrap_err();
        assert!(matches!(err, TensorError::DType { op: "sub", .. }), "{err}");
        err
    });
    assert!(
        e.contains("f32") && e.contains("f64") && e.contains("[4, 4]") && e.contains("S(0)"),
        "{e}"
    );
}

#[test]
fn wrong_sbp_length() {
    let e = on_all_ranks(|| {
        let err = Tensor::ones_global([4, 4], DType::F32, &p4(), NdSbp::new([Sbp::S(0), Sbp::B]))
            .unwrap_err();
        assert!(matches!(err, TensorError::Sbp { op: "ones", .. }), "{err}");
        err
    });
    assert!(
        e.contains("(S(0), B)") && e.contains("[4, 4]") && e.contains("cpu:[0, 1, 2, 3]"),
        "{e}"
    );
    let e = on_all_ranks(|| {
        let local = Tensor::ones([1, 4], DType::F32);
        local
            .to_global(&p4(), NdSbp::new([Sbp::S(0), Sbp::S(1)]))
            .unwrap_err()
    });
    assert!(
        e.contains("to_global") && e.contains("(S(0), S(1))") && e.contains("[1, 4]"),
        "{e}"
    );
    let e = on_all_ranks(|| {
        let local = Tensor::ones([1, 4], DType::F32);
        local.to_global(&p4(), Sbp::S(2)).unwrap_err()
    });
    assert!(e.contains("S(2)") && e.contains("[1, 4]"), "{e}");
}

#[test]
fn mixed_local_global() {
    let e = on_all_ranks(|| {
        let a = Tensor::ones_global([4, 4], DType::F32, &p4(), Sbp::S(0)).unwrap();
        let b = Tensor::ones([4, 4], DType::F32);
        let err = a.add(&b).unwrap_err();
        assert!(matches!(err, TensorError::Mixed { op: "add", .. }), "{err}");
        err
    });
    assert!(e.contains("global, local") && e.contains("[4, 4]"), "{e}");
}

#[test]
fn uneven_pieces_need_checked() {
    // Rank 3 holds one row fewer: to_global (unchecked) fails with a typed error on the ranks
    // whose piece disagrees with the even assumption; to_global_checked gets it right.
    let p = p4();
    let out = run_ranks(4, Duration::from_secs(5), |rank| {
        let rows = if rank == 3 { 1 } else { 2 };
        let local = Tensor::full([rows, 3], rank as f64, DType::F32);
        let g = local.to_global_checked(&p, Sbp::S(0)).unwrap();
        assert_eq!(g.shape().dims(), &[7, 3]);
        g.sum(&[0], false).unwrap().to_vec::<f32>().unwrap()
    });
    for v in out {
        assert_eq!(v, vec![9.0; 3]);
    }
    let errs = run_ranks(4, Duration::from_secs(5), |rank| {
        let local = Tensor::full([rank + 1, 3], 1.0, DType::F32);
        local
            .to_global_checked(&p, Sbp::S(0))
            .unwrap_err()
            .to_string()
    });
    assert!(
        errs.iter()
            .all(|e| e == &errs[0] && e.contains("ranks disagree")),
        "{errs:?}"
    );
}

/// Shapes whose byte size overflows (or is absurd) are typed errors from every fallible local
/// constructor, never a panic or an abort.
#[test]
fn hostile_local_shapes_are_errors() {
    let huge: [&[usize]; 4] = [
        &[usize::MAX, 2],
        &[usize::MAX],
        &[1 << 40, 1 << 40],
        &[isize::MAX as usize / 2 + 1, 1],
    ];
    for shape in huge {
        let results = [
            ("zeros", Tensor::try_zeros(shape.to_vec(), DType::F32)),
            ("ones", Tensor::try_ones(shape.to_vec(), DType::F64)),
            ("full", Tensor::try_full(shape.to_vec(), 3.0, DType::F32)),
            ("rand", Tensor::try_rand(shape.to_vec(), 7, DType::F32)),
            ("randn", Tensor::try_randn(shape.to_vec(), 7, DType::F64)),
        ];
        for (op, r) in results {
            match r {
                Err(TensorError::Shape { op: named, .. }) => assert_eq!(named, op, "{shape:?}"),
                other => panic!("{op} {shape:?}: {:?}", other.map(|t| t.shape().clone())),
            }
        }
    }
    let ok = Tensor::try_full(vec![2, 3], 1.5, DType::F32).unwrap();
    assert_eq!(ok.shape().dims(), &[2, 3]);
}
