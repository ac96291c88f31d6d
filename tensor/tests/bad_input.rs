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

/// The error of the binary `op` on the pair `make` gives, made on every rank (the same text on
/// all); `kind` must hold of it.
fn binary_err(
    op: fn(&Tensor, &Tensor) -> oxiflow_tensor::Result<Tensor>,
    make: impl Fn() -> (Tensor, Tensor) + Sync,
    kind: fn(&TensorError) -> bool,
) -> String {
    on_all_ranks(|| {
        let (a, b) = make();
        let err = op(&a, &b).unwrap_err();
        assert!(kind(&err), "{err}");
        err
    })
}

/// Asserts that the error text `e` names each of `names`.
fn assert_names(e: &str, names: &[&str]) {
    assert!(names.iter().all(|n| e.contains(n)), "{e}");
}

fn p4() -> Placement {
    Placement::range(DeviceType::Cpu, 4).unwrap()
}

#[test]
fn mismatched_shapes() {
    let e = binary_err(
        Tensor::add,
        || {
            let a = Tensor::randn_global([8, 3], 1, DType::F32, &p4(), Sbp::S(0)).unwrap();
            let b = Tensor::randn_global([8, 5], 2, DType::F32, &p4(), Sbp::B).unwrap();
            (a, b)
        },
        |err| matches!(err, TensorError::Shape { op: "add", .. }),
    );
    assert_names(&e, &["add", "[8, 3]", "[8, 5]", "S(0), B"]);
    let e = on_all_ranks(|| {
        let a = Tensor::randn_global([8, 3], 1, DType::F32, &p4(), Sbp::S(0)).unwrap();
        a.matmul(&a).unwrap_err()
    });
    assert_names(&e, &["matmul", "[8, 3]", "S(0)"]);
}

#[test]
fn mismatched_placements() {
    let e = binary_err(
        Tensor::mul,
        || {
            let pa = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
            let pb = Placement::new_1d(DeviceType::Cpu, vec![2, 3]).unwrap();
            let a = Tensor::ones_global([4, 4], DType::F32, &pa, Sbp::S(0)).unwrap();
            let b = Tensor::ones_global([4, 4], DType::F32, &pb, Sbp::B).unwrap();
            (a, b)
        },
        |err| matches!(err, TensorError::Placement { op: "mul", .. }),
    );
    assert_names(&e, &["cpu:[0, 1]", "cpu:[2, 3]", "[4, 4]", "S(0), B"]);
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
    assert_names(&e, &["cuda"]);
}

#[test]
fn mismatched_dtypes() {
    let e = binary_err(
        Tensor::sub,
        || {
            let a = Tensor::ones_global([4, 4], DType::F32, &p4(), Sbp::S(0)).unwrap();
            let b = Tensor::ones_global([4, 4], DType::F64, &p4(), Sbp::S(0)).unwrap();
            (a, b)
        },
        |err| matches!(err, TensorError::DType { op: "sub", .. }),
    );
    assert_names(&e, &["f32", "f64", "[4, 4]", "S(0)"]);
}

#[test]
fn wrong_sbp_length() {
    let e = on_all_ranks(|| {
        let err = Tensor::ones_global([4, 4], DType::F32, &p4(), NdSbp::new([Sbp::S(0), Sbp::B]))
            .unwrap_err();
        assert!(matches!(err, TensorError::Sbp { op: "ones", .. }), "{err}");
        err
    });
    assert_names(&e, &["(S(0), B)", "[4, 4]", "cpu:[0, 1, 2, 3]"]);
    let e = on_all_ranks(|| {
        let local = Tensor::ones([1, 4], DType::F32);
        local
            .to_global(&p4(), NdSbp::new([Sbp::S(0), Sbp::S(1)]))
            .unwrap_err()
    });
    assert_names(&e, &["to_global", "(S(0), S(1))", "[1, 4]"]);
    let e = on_all_ranks(|| {
        let local = Tensor::ones([1, 4], DType::F32);
        local.to_global(&p4(), Sbp::S(2)).unwrap_err()
    });
    assert_names(&e, &["S(2)", "[1, 4]"]);
}

#[test]
fn mixed_local_global() {
    let e = binary_err(
        Tensor::add,
        || {
            let a = Tensor::ones_global([4, 4], DType::F32, &p4(), Sbp::S(0)).unwrap();
            (a, Tensor::ones([4, 4], DType::F32))
        },
        |err| matches!(err, TensorError::Mixed { op: "add", .. }),
    );
    assert_names(&e, &["global, local", "[4, 4]"]);
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
