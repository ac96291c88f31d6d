//! bf16 and f16 tensors on the CPU: every op family's kernel (through the CPU backend's one
//! f32 entry) against an f64 reference on random, never-zero data; global ops on random layouts
//! (1-d and 2-d meshes, uneven splits, P inputs) against one rank's f32 computation rounded
//! once; `to_dtype` and its gradients across 16-bit dtypes; creation ops equal to the f32
//! values rounded once in any layout; typed errors for dtypes an op does not take.

mod common;
mod half_cases;

use std::time::Duration;

use common::{nd_sbp, placement};
use half_cases::{
    global_inputs, half_cases, local_inputs, out_dtype, round_to, within, HalfCase, Input,
};
use oxiflow_tensor::{bf16, f16, run_ranks, DType, NdSbp, Sbp, Tensor, TensorElement, TensorError};
use proptest::prelude::*;

const HALVES: [DType; 2] = [DType::BF16, DType::F16];

fn values(t: &Tensor) -> oxiflow_tensor::Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.to_vec::<f64>()
}

#[test]
fn every_16_bit_kernel_matches_the_f64_reference() {
    let mut checked = 0;
    for dtype in HALVES {
        for (k, c) in half_cases().iter().enumerate() {
            let seed = 1000 * k as u64 + 7;
            let got = (c.op)(&local_inputs(c, dtype, seed).unwrap())
                .unwrap_or_else(|e| panic!("{} on {dtype}: {e}", c.name));
            assert_eq!(got.dtype(), out_dtype(c, dtype), "{} on {dtype}", c.name);
            let want = (c.op)(
                &local_inputs(c, DType::F64, seed)
                    .map(|v| {
                        // The same values: inputs rounded to `dtype`, held in f64.
                        v.into_iter()
                            .map(|t| match t.dtype() {
                                DType::I64 => t,
                                _ => t
                                    .to_dtype(dtype)
                                    .and_then(|h| h.to_dtype(DType::F64))
                                    .unwrap(),
                            })
                            .collect::<Vec<_>>()
                    })
                    .unwrap(),
            )
            .unwrap();
            let (g, w) = (values(&got).unwrap(), values(&want).unwrap());
            assert!(
                w.iter().any(|&x| x != 0.0),
                "{}: an all-zero reference",
                c.name
            );
            if let Err(e) = within(&g, &w, dtype, c.ulps) {
                panic!("{} on {dtype}: {e}", c.name);
            }
            checked += 1;
        }
    }
    println!("{checked} 16-bit kernel cases within their rounding of the f64 reference");
    assert_eq!(checked, 2 * half_cases().len());
}

#[test]
fn a_16_bit_kernel_rounds_once() {
    // The sum of 64 values that f32 holds exactly rounds once: summing in bf16 would drift.
    let v: Vec<f64> = (0..64)
        .map(|i| round_to(DType::BF16, 1.0 + i as f64 / 61.0))
        .collect();
    let exact: f64 = v.iter().sum();
    let x = Tensor::from_vec(v, [64])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let s = x.sum_all().unwrap().to_vec::<bf16>().unwrap()[0];
    assert_eq!(s, bf16::from_f64(exact));
    let y = x.matmul(&x.reshape([64, 1]).unwrap()).unwrap();
    let dot: f64 = (0..64)
        .map(|i| x.to_vec::<bf16>().unwrap()[i].to_f64().powi(2))
        .sum();
    assert_eq!(y.to_vec::<bf16>().unwrap()[0], bf16::from_f64(dot));
}

/// Runs case `c` on global inputs laid out as `layouts` on a `mesh` of in-process ranks;
/// every rank's gathered result.
fn run_global(
    c: &HalfCase,
    dtype: DType,
    seed: u64,
    mesh: &[usize],
    perm: u64,
    layouts: &[NdSbp],
) -> Vec<Result<Vec<f64>, String>> {
    let n: usize = mesh.iter().product();
    run_ranks(n, Duration::from_secs(60), |_| {
        let pl = placement(mesh, perm);
        let run = || -> oxiflow_tensor::Result<Vec<f64>> {
            let inputs = global_inputs(c, dtype, seed, &pl)?
                .into_iter()
                .zip(layouts)
                .map(|(t, nd)| t.to_global(&pl, nd.clone()))
                .collect::<oxiflow_tensor::Result<Vec<_>>>()?;
            let y = (c.op)(&inputs)?;
            if y.dtype() != out_dtype(c, dtype) {
                return Err(TensorError::Kernel {
                    op: "test",
                    detail: format!("output dtype {}", y.dtype()),
                });
            }
            values(&y)
        };
        run().map_err(|e| e.to_string())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// A 16-bit op on global inputs of random layouts equals one rank's f32 computation on the
    /// same values, rounded once, within the rounding a layout adds (partial results are
    /// rounded before their sum).
    #[test]
    fn sixteen_bit_ops_on_global_layouts_equal_one_rank_rounded(
        k in 0usize..200, half in 0usize..2, mesh_kind in 0usize..4, perm in any::<u64>(), sbp_seed in any::<u64>(),
    ) {
        let cases = half_cases();
        let c = &cases[k % cases.len()];
        let dtype = HALVES[half];
        let mesh: &[usize] = [&[1usize][..], &[3], &[4], &[2, 2]][mesh_kind];
        let layouts: Vec<NdSbp> = c
            .inputs
            .iter()
            .enumerate()
            .map(|(i, (shape, kind))| {
                let p = !matches!(kind, Input::Ids(_));
                nd_sbp(mesh.len(), shape.len(), sbp_seed.wrapping_add(i as u64), p)
            })
            .collect();
        let seed = 31 * k as u64 + 5;
        let f32_inputs: Vec<Tensor> = local_inputs(c, dtype, seed)
            .unwrap()
            .into_iter()
            .map(|t| if t.dtype() == DType::I64 { t } else { t.to_dtype(DType::F32).unwrap() })
            .collect();
        let reference = (c.op)(&f32_inputs).unwrap();
        let want: Vec<f64> = values(&reference)
            .unwrap()
            .into_iter()
            .map(|v| round_to(out_dtype(c, dtype), v))
            .collect();
        let partial = layouts.iter().any(|l| l.iter().any(|s| s.is_partial()));
        let ulps = 2.0 * c.ulps + if partial { 2.0 } else { 1.0 } + mesh.iter().product::<usize>() as f64;
        for (rank, got) in run_global(c, dtype, seed, mesh, perm, &layouts).into_iter().enumerate() {
            let got = got.map_err(|e| TestCaseError::fail(format!("{} {dtype} {layouts:?} rank {rank}: {e}", c.name)))?;
            within(&got, &want, dtype, ulps)
                .map_err(|e| TestCaseError::fail(format!("{} {dtype} {layouts:?} rank {rank}: {e}", c.name)))?;
        }
    }
}

#[test]
fn to_dtype_carries_gradients_across_16_bit_dtypes() {
    let x = Tensor::from_vec(vec![0.3f32, -1.7, 2.25, 0.1], [4])
        .unwrap()
        .requires_grad_(true);
    let h = x.to_dtype(DType::BF16).unwrap();
    assert_eq!(h.dtype(), DType::BF16);
    h.square().unwrap().sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F32);
    let hv = h.to_vec::<bf16>().unwrap();
    for (gi, hi) in g.to_vec::<f32>().unwrap().iter().zip(&hv) {
        assert_eq!(*gi, bf16::from_f32(2.0 * hi.to_f32()).to_f32());
    }
    // A 16-bit leaf through f32 (and f16) gets a 16-bit gradient.
    let y = Tensor::from_vec(vec![f16::from_f32(1.5), f16::from_f32(-0.75)], [2])
        .unwrap()
        .requires_grad_(true);
    let z = y.to_dtype(DType::F32).unwrap().mul_scalar(3.0).unwrap();
    let z = z.to_dtype(DType::BF16).unwrap().sum_all().unwrap();
    z.backward().unwrap();
    let gy = y.grad().unwrap();
    assert_eq!(gy.dtype(), DType::F16);
    assert_eq!(gy.to_vec::<f16>().unwrap(), vec![f16::from_f32(3.0); 2]);
    // cast is to_dtype.
    assert_eq!(
        y.cast(DType::BF16).unwrap().to_vec::<bf16>().unwrap(),
        y.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap()
    );
}

#[test]
fn to_dtype_rounds_once_between_every_pair() {
    let v = vec![
        1.0 + 2f64.powi(-9) + 2f64.powi(-30),
        -3.0625 - 2f64.powi(-20),
        65504.0,
        1e-6,
        0.0,
        -2.5,
    ];
    let x = Tensor::from_vec(v.clone(), [6]).unwrap();
    for a in DType::ALL {
        for b in DType::ALL {
            let got = values(&x.to_dtype(a).unwrap().to_dtype(b).unwrap()).unwrap();
            let want: Vec<f64> = v
                .iter()
                .map(|&e| {
                    let once = |d: DType, e: f64| {
                        if d == DType::I64 {
                            e.trunc()
                        } else {
                            round_to(d, e)
                        }
                    };
                    once(b, once(a, e))
                })
                .collect();
            assert_eq!(got, want, "{a} -> {b}");
        }
    }
    // f64 -> bf16 directly: a tie that f32 would break the wrong way rounds up.
    let tie = Tensor::from_vec(vec![1.0 + 2f64.powi(-8) + 2f64.powi(-40)], [1]).unwrap();
    assert_eq!(
        tie.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap()[0].to_f64(),
        1.0 + 2f64.powi(-7)
    );
}

/// The bits of a tensor's 16-bit values.
fn bits(t: &Tensor) -> Vec<u16> {
    fn of<T: TensorElement>(t: &Tensor, to_bits: fn(T) -> u16) -> Vec<u16> {
        t.to_vec::<T>().unwrap().into_iter().map(to_bits).collect()
    }
    match t.dtype() {
        DType::BF16 => of(t, bf16::to_bits),
        _ => of(t, f16::to_bits),
    }
}

#[test]
fn creation_gives_the_f32_values_rounded_once_in_any_layout() {
    for dtype in HALVES {
        let round = |t: Tensor| -> Vec<u16> {
            let v = t.to_vec::<f32>().unwrap();
            let h = Tensor::from_vec(v, t.shape().clone()).unwrap();
            bits(&h.to_dtype(dtype).unwrap())
        };
        type Maker = Box<dyn Fn(DType) -> Tensor>;
        let makers: Vec<(&str, Maker)> = vec![
            ("rand", Box::new(|d| Tensor::rand([7, 5], 3, d))),
            ("randn", Box::new(|d| Tensor::randn([7, 5], 4, d))),
            ("full", Box::new(|d| Tensor::full([7, 5], 0.1, d))),
            (
                "arange",
                Box::new(|d| Tensor::arange(-1.3, 2.0, 0.1, d).unwrap()),
            ),
        ];
        for (name, make) in &makers {
            assert_eq!(
                bits(&make(dtype)),
                round(make(DType::F32)),
                "{name} {dtype}"
            );
        }
        // The same values when created split over 3 ranks (uneven) or on a [2, 2] mesh.
        let want = bits(&Tensor::randn([7, 5], 4, dtype));
        for mesh in [&[3usize][..], &[2, 2]] {
            let n: usize = mesh.iter().product();
            let got = run_ranks(n, Duration::from_secs(30), |_| {
                let pl = placement(mesh, 9);
                let nd = NdSbp::new((0..mesh.len()).map(|a| Sbp::S(a % 2)));
                bits(&Tensor::randn_global([7, 5], 4, dtype, &pl, nd).unwrap())
            });
            for g in got {
                assert_eq!(g, want, "randn {dtype} on {mesh:?}");
            }
        }
        let z = Tensor::zeros([3], dtype);
        assert_eq!(bits(&z), vec![0; 3]);
    }
}

#[test]
fn an_op_on_a_dtype_it_does_not_take_is_a_typed_error() {
    let ids = Tensor::from_vec(vec![1i64, 2, 3], [3]).unwrap();
    let h = Tensor::from_vec(vec![bf16::from_f32(1.0); 6], [2, 3]).unwrap();
    let check = |r: oxiflow_tensor::Result<Tensor>, op: &str, dtype: &str| match r {
        Err(e @ TensorError::DType { .. }) => {
            let m = e.to_string();
            assert!(m.contains(op) && m.contains(dtype), "{m}");
        }
        other => panic!("{op} on {dtype}: {other:?}"),
    };
    check(ids.softmax(0), "softmax", "i64");
    check(ids.unary(oxiflow_tensor::UnaryOp::Exp), "exp", "i64");
    check(
        h.cross_entropy(&h.narrow(1, 0, 1).unwrap().reshape([2]).unwrap()),
        "cross_entropy",
        "bf16",
    );
    check(
        Tensor::embedding(&h.reshape([6]).unwrap(), &h),
        "embedding",
        "bf16",
    );
    check(h.add(&h.to_dtype(DType::F16).unwrap()), "add", "f16");
    // The same error on every rank, before any communication.
    let errs = run_ranks(3, Duration::from_secs(10), |_| {
        let pl = placement(&[3], 1);
        let x = Tensor::from_vec(vec![1i64; 6], [6])
            .unwrap()
            .to_global(&pl, Sbp::S(0))
            .unwrap();
        x.softmax(0).map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(errs.iter().all(|e| e.is_err() && *e == errs[0]), "{errs:?}");
}
