//! Context attention's CUDA kernels against its CPU kernels in f64 on the same (rounded)
//! values: the output, log-sum-exp and the gradients of q, k and v, on one device, for tokens in
//! the natural order and in the load-balanced orders of 2 and 4 ranks (runs that meet in full,
//! causally and not at all, and uneven runs cut into one-token pieces), grouped-query heads, causal and not, f32 (the NVRTC flash kernels)
//! and bf16/f16 (cuDNN's), with sequences up to 1,024 tokens; and the typed error of runs of
//! unequal lengths. The ring between devices runs in `scripts/gpu/cp_there.sh`. Without a CUDA
//! device it prints that it was skipped.

mod common;

use oxiflow_ops::context_parallel::{context_attention_lse, CpAlgorithm, CpAttrs, SeqOrder};
use oxiflow_tensor::{DType, F64Bits, NdSbp, Placement, Sbp, Tensor};

/// q `[b, t, h, d]`, k and v `[b, t, hkv, d]`.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    order: SeqOrder,
}

/// o, lse and the gradients of q, k, v of `sum(o * w)`, as f64 values.
fn run(q: &Tensor, k: &Tensor, v: &Tensor, w: &Tensor, attrs: CpAttrs) -> [Vec<f64>; 5] {
    let (q, k, v) = (
        q.detach().requires_grad_(true),
        k.detach().requires_grad_(true),
        v.detach().requires_grad_(true),
    );
    let (o, lse) = context_attention_lse(&q, &k, &v, attrs, CpAlgorithm::Ring).unwrap();
    o.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
    let vals = common::vals;
    [
        vals(&o),
        vals(&lse),
        vals(&q.grad().unwrap()),
        vals(&k.grad().unwrap()),
        vals(&v.grad().unwrap()),
    ]
}

/// Asserts `got` within `rel` of `want`, relative to the largest element of `want`.
fn near(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let big = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * big.max(1.0),
            "{what}: element {i}: {g} vs {w} (largest {big})"
        );
    }
}

fn check(c: Case, dt: DType, p: &Placement) {
    let shapes = [
        vec![c.b, c.t, c.h, c.d],
        vec![c.b, c.t, c.hkv, c.d],
        vec![c.b, c.t, c.hkv, c.d],
        vec![c.b, c.t, c.h, c.d],
    ];
    let host: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.iter().product();
            Tensor::from_vec(common::never_zero(n, 40 + i as u64), s.clone())
                .unwrap()
                .cast(dt)
                .unwrap()
        })
        .collect();
    let attrs = CpAttrs {
        causal: c.causal,
        scale: F64Bits::new(1.0 / (c.d as f64).sqrt()),
        order: c.order,
    };
    let wide: Vec<Tensor> = host.iter().map(|t| t.cast(DType::F64).unwrap()).collect();
    let want = run(&wide[0], &wide[1], &wide[2], &wide[3], attrs);
    let on = |t: &Tensor| t.to_global(p, NdSbp::broadcast(1)).unwrap();
    let dev: Vec<Tensor> = host.iter().map(on).collect();
    let got = run(&dev[0], &dev[1], &dev[2], &dev[3], attrs);
    let rel = match dt {
        DType::F32 => 2e-4,
        _ => 4e-2,
    };
    for (i, name) in ["o", "lse", "dq", "dk", "dv"].iter().enumerate() {
        near(&got[i], &want[i], rel, &format!("{dt} {c:?} {name}"));
    }
}

#[test]
fn context_attention_on_cuda_matches_the_cpu_kernels_in_f64() {
    let Some((_world, p)) = common::cuda_device_or_skip("context_parallel_cuda") else {
        return;
    };
    let case = |b, t, h, hkv, causal, order| Case {
        b,
        t,
        h,
        hkv,
        d: 64,
        causal,
        order,
    };
    let cases = [
        case(2, 32, 4, 2, true, SeqOrder::Balanced { ranks: 2 }),
        case(2, 32, 4, 4, true, SeqOrder::Balanced { ranks: 4 }),
        case(1, 48, 6, 2, true, SeqOrder::Natural),
        case(2, 24, 4, 4, false, SeqOrder::Balanced { ranks: 3 }),
        case(1, 30, 2, 1, true, SeqOrder::Balanced { ranks: 2 }),
        case(1, 1024, 8, 2, true, SeqOrder::Balanced { ranks: 4 }),
    ];
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for c in cases {
            check(c, dt, &p);
        }
    }
}

#[test]
fn unequal_runs_are_a_typed_error_on_cuda() {
    let Some((_world, p)) = common::cuda_device_or_skip("context_parallel_cuda") else {
        return;
    };
    // 130 tokens in the order of 2 ranks: runs of 33, 32 and 65 tokens, equal only as 130
    // pieces of one token.
    let x = Tensor::randn_global(vec![1, 130, 2, 64], 1, DType::BF16, &p, Sbp::B).unwrap();
    let attrs = CpAttrs {
        causal: true,
        scale: F64Bits::new(0.125),
        order: SeqOrder::Balanced { ranks: 2 },
    };
    let e = context_attention_lse(&x, &x, &x, attrs, CpAlgorithm::Ring)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("equal runs"), "{e}");
}
