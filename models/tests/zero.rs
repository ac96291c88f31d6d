//! ZeRO stages 0-3 and activation recomputation against one rank: a residual two-block MLP
//! trained with AdamW and SGD on meshes [2], [4] (data parallel) and [2, 2] (data x tensor
//! parallel), in-process ranks, f64. Every stage and recompute setting gives the one-rank losses
//! and parameters, whether stages 1 and 2 gather the updated shards per parameter or in
//! buckets; each stage keeps the bytes per rank it promises (state, gradients,
//! parameters split over the data-parallel axis). ZeRO-3 prefetches the next block's gathers;
//! a prefetched gather is used once, and only for the leaf and autograd mode it was made for.
//! Under mixed precision (f64 leaves computed as f32) stages 1 and 2 keep master shards whose
//! f32 copies are gathered once per update, give the whole leaves' bits on the same mesh, and
//! track one rank computing in f32.

use std::time::Duration;

use oxiflow_dtype::{DType, MatmulPrecision, MixedPrecision};
use oxiflow_models::footprint::Footprint;
use oxiflow_models::nn::{Activation, Mlp, Module, Parameter};
use oxiflow_models::optim::{
    AdamW, AdamWOptions, Optimizer, Sgd, SgdOptions, Zero, DEFAULT_GATHER_BYTES,
};
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{recompute, run_ranks, Tensor};

const F: DType = DType::F64;

/// The policy of f64 master weights computed with as `compute`.
fn computing_as(compute: DType) -> MixedPrecision {
    MixedPrecision::new(F, compute, F, MatmulPrecision::F32).unwrap()
}
const ROWS: usize = 6;
const WIDTH: usize = 5;
const STEPS: usize = 4;

struct Net {
    blocks: Vec<Mlp>,
}

impl Net {
    fn new(placement: Option<&Placement>, tp: Option<usize>) -> Net {
        let blocks = (0..2)
            .map(|i| {
                Mlp::new(
                    &format!("b{i}"),
                    WIDTH,
                    7,
                    WIDTH,
                    Activation::Tanh,
                    3,
                    F,
                    placement,
                    tp,
                )
                .unwrap()
            })
            .collect();
        Net { blocks }
    }
    fn forward(&self, x: &Tensor, recomputed: bool) -> Tensor {
        let mut h = x.clone();
        for (i, b) in self.blocks.iter().enumerate() {
            // ZeRO-3: the next block's gathers are issued before this block computes.
            if let Some(next) = self.blocks.get(i + 1) {
                next.prefetch().unwrap();
            }
            h = if recomputed {
                let b = b.clone();
                recompute(&[&h], move |xs| xs[0].add(&b.forward(&xs[0])?)).unwrap()
            } else {
                h.add(&b.forward(&h).unwrap()).unwrap()
            };
        }
        h
    }
}

impl Module for Net {
    fn parameters(&self) -> Vec<Parameter> {
        self.blocks.iter().flat_map(|b| b.parameters()).collect()
    }
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Adam,
    Sgd,
}

fn optimizer(params: Vec<Parameter>, opt: Opt, zero: Zero) -> Box<dyn Optimizer> {
    match opt {
        Opt::Adam => Box::new(
            AdamW::new(
                params,
                AdamWOptions {
                    lr: 0.05,
                    ..AdamWOptions::default()
                },
            )
            .with_zero(zero)
            .unwrap(),
        ),
        Opt::Sgd => Box::new(
            Sgd::new(
                params,
                SgdOptions {
                    lr: 0.1,
                    momentum: 0.9,
                    ..SgdOptions::default()
                },
            )
            .with_zero(zero)
            .unwrap(),
        ),
    }
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_dtype(F)
        .unwrap()
        .to_ndarray::<f64>()
        .unwrap()
        .into_raw_vec_and_offset()
        .0
}

/// Per-rank bytes after training: (parameters, gradients, optimizer state).
type Bytes = (usize, usize, usize);

/// Losses, final parameters (gathered) and per-rank bytes of one run.
type Run = (Vec<f64>, Vec<Vec<f64>>, Bytes);

fn train(placement: Option<&Placement>, tp: Option<usize>, opt: Opt, zero: Zero, rc: bool) -> Run {
    train_as(placement, tp, opt, zero, rc, None)
}

/// [`train`] with layers computing as `compute` (None: the leaves' f64).
fn train_as(
    placement: Option<&Placement>,
    tp: Option<usize>,
    opt: Opt,
    zero: Zero,
    rc: bool,
    compute: Option<DType>,
) -> Run {
    let net = Net::new(placement, tp);
    net.set_precision(&computing_as(compute.unwrap_or(F)))
        .unwrap();
    let params = net.parameters();
    let mut o = optimizer(params.clone(), opt, zero);
    let d = compute.unwrap_or(F);
    let x = Tensor::randn([ROWS, WIDTH], 11, F).to_dtype(d).unwrap();
    let y = Tensor::randn([ROWS, WIDTH], 12, F).to_dtype(d).unwrap();
    let (x, y) = match placement {
        Some(p) => {
            let data = NdSbp::broadcast(p.ndim()).with_axis(0, Sbp::S(0));
            (
                x.to_global(p, NdSbp::broadcast(p.ndim()))
                    .unwrap()
                    .to_global(p, data.clone())
                    .unwrap(),
                y.to_global(p, NdSbp::broadcast(p.ndim()))
                    .unwrap()
                    .to_global(p, data)
                    .unwrap(),
            )
        }
        None => (x, y),
    };
    let mut losses = Vec::new();
    let mut bytes = (0, 0, 0);
    for step in 0..STEPS {
        o.zero_grad();
        let loss = net
            .forward(&x, rc)
            .sub(&y)
            .unwrap()
            .square()
            .unwrap()
            .mean_all()
            .unwrap();
        loss.backward().unwrap();
        if step == STEPS - 1 {
            bytes.1 = Footprint::measure(&params, o.as_ref()).gradients;
        }
        o.step().unwrap();
        let l = match placement {
            Some(p) => loss.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
            None => loss,
        };
        losses.push(vals(&l)[0]);
    }
    let after = Footprint::measure(&params, o.as_ref());
    bytes.0 = after.parameters;
    bytes.2 = after.optimizer_state;
    let finals = params
        .iter()
        .map(|p| {
            let v = p.value();
            match placement {
                Some(pl) => vals(&v.to_global(pl, NdSbp::broadcast(pl.ndim())).unwrap()),
                None => vals(&v),
            }
        })
        .collect();
    (losses, finals, bytes)
}

/// `a` equals `b` element by element within `rel` of `1 + |b|`.
fn within(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= rel * (1.0 + y.abs()), "{what}: {x} vs {y}");
    }
}

fn close(a: &[f64], b: &[f64], what: &str) {
    within(a, b, 1e-10, what);
}

fn check_layout(mesh: &[usize], tp: Option<usize>) {
    let n: usize = mesh.iter().product();
    let dp = mesh[0];
    for opt in [Opt::Adam, Opt::Sgd] {
        let (want_losses, want_params, _) = train(None, None, opt, Zero::OFF, false);
        let mut full: Option<Bytes> = None;
        // Stages 1 and 2 gather the updated shards per parameter, in buckets of a few
        // parameters, and in one bucket.
        let runs = (0..=3u8).flat_map(|stage| {
            let gathers: &[usize] = match stage {
                1 | 2 => &[DEFAULT_GATHER_BYTES, 600, 25 << 20],
                _ => &[DEFAULT_GATHER_BYTES],
            };
            gathers
                .iter()
                .flat_map(move |&g| [(stage, g, false), (stage, g, true)])
        });
        for (stage, gather, rc) in runs {
            {
                let what =
                    format!("mesh {mesh:?} {opt:?} zero {stage} gather {gather} recompute {rc}");
                let runs = run_ranks(n, Duration::from_secs(60), |_| {
                    let p = Placement::new_1d(DeviceType::Cpu, (0..n).collect::<Vec<_>>())
                        .unwrap()
                        .reshaped(mesh.to_vec())
                        .unwrap();
                    let zero = Zero::new(stage, 0).unwrap().with_gather_bytes(gather);
                    train(Some(&p), tp, opt, zero, rc)
                });
                for (losses, params, _) in &runs {
                    close(losses, &want_losses, &format!("{what}: losses"));
                    for (a, b) in params.iter().zip(&want_params) {
                        close(a, b, &format!("{what}: parameters"));
                    }
                }
                let bytes = runs[0].2;
                let base = *full.get_or_insert(bytes);
                // Each sharded quantity is at most its share over dp, plus the rows an uneven
                // split rounds up (one row of each tensor).
                let slack = 8 * 2 * WIDTH * 7;
                let share = |b: usize| b / dp + slack;
                if stage >= 1 {
                    assert!(
                        bytes.2 <= share(base.2),
                        "{what}: state {bytes:?} vs {base:?}"
                    );
                }
                if stage >= 2 {
                    assert!(
                        bytes.1 <= share(base.1),
                        "{what}: grads {bytes:?} vs {base:?}"
                    );
                }
                if stage == 3 {
                    assert!(
                        bytes.0 <= share(base.0),
                        "{what}: params {bytes:?} vs {base:?}"
                    );
                } else {
                    assert_eq!(bytes.0, base.0, "{what}: parameters stay whole");
                }
            }
        }
    }
}

#[test]
fn data_parallel_two_ranks() {
    check_layout(&[2], None);
}

#[test]
fn data_parallel_four_ranks() {
    check_layout(&[4], None);
}

#[test]
fn data_and_tensor_parallel() {
    check_layout(&[2, 2], Some(1));
}

#[test]
fn stage_out_of_range_is_an_error() {
    assert!(Zero::new(4, 0).is_err());
}

/// One backward pass of the sum of `net` on ones of `dtype` broadcast over `p`.
fn backward_on_ones(net: &Net, p: &Placement, dtype: DType) {
    let x = Tensor::ones([ROWS, WIDTH], dtype)
        .to_global(p, NdSbp::broadcast(1))
        .unwrap();
    net.forward(&x, false)
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
}

#[test]
fn a_prefetched_gather_is_used_once_and_only_for_its_leaf() {
    let runs = run_ranks(2, Duration::from_secs(60), |_| {
        let p = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
        let net = Net::new(Some(&p), None);
        let params = net.parameters();
        let w = params[0].clone();
        // Not sharded: nothing to prefetch.
        assert!(w.prefetch().unwrap().is_none());
        let mut o = optimizer(params, Opt::Sgd, Zero::new(3, 0).unwrap());
        assert!(w.value().nd_sbp().unwrap().as_slice()[0].is_split());
        let ahead = w.prefetch().unwrap().expect("a sharded leaf is gathered");
        assert_eq!(ahead.nd_sbp(), w.compute_layout().as_ref());
        assert!(w.compute().unwrap().same(&ahead), "the prefetch is taken");
        let again = w.compute().unwrap();
        assert!(!again.same(&ahead), "and only once");
        assert_eq!(vals(&again), vals(&ahead));
        // A prefetch made before the leaf changed is not used.
        backward_on_ones(&net, &p, F);
        let stale = w.prefetch().unwrap().unwrap();
        o.step().unwrap();
        let fresh = w.compute().unwrap();
        assert!(!fresh.same(&stale));
        assert_ne!(vals(&fresh), vals(&stale), "the step changed the weight");
        // Nor one made without autograd for a compute with it.
        let untracked = {
            let _g = oxiflow_tensor::no_grad();
            w.prefetch().unwrap().unwrap()
        };
        assert!(!w.compute().unwrap().same(&untracked));
        vals(&fresh)
    });
    assert_eq!(runs[0], runs[1]);
}

#[test]
fn stages_one_and_two_under_mixed_precision_keep_master_shards_and_dps_bits() {
    const C: DType = DType::F32;
    for (opt, stage) in [Opt::Adam, Opt::Sgd]
        .into_iter()
        .flat_map(|o| [(o, 1), (o, 2)])
    {
        let (want_losses, want_params, _) = train_as(None, None, opt, Zero::OFF, false, Some(C));
        for (mesh, tp) in [(vec![2], None), (vec![2, 2], Some(1))] {
            let n: usize = mesh.iter().product();
            let runs = run_ranks(n, Duration::from_secs(60), |_| {
                let p = Placement::new_1d(DeviceType::Cpu, (0..n).collect::<Vec<_>>())
                    .unwrap()
                    .reshaped(mesh.clone())
                    .unwrap();
                let net = Net::new(Some(&p), tp);
                net.set_precision(&computing_as(C)).unwrap();
                let params = net.parameters();
                let _o = optimizer(params.clone(), opt, Zero::new(stage, 0).unwrap());
                for w in &params {
                    let (leaf, full) = (w.value(), w.compute_layout().unwrap());
                    assert!(w.keeps_gathered(), "{w:?}");
                    assert!(leaf.nd_sbp().unwrap().as_slice()[0].is_split(), "{w:?}");
                    assert_eq!(leaf.dtype(), F, "{w:?}: the master stays f64");
                    let c = w.compute().unwrap();
                    assert_eq!((c.dtype(), c.nd_sbp()), (C, Some(&full)), "{w:?}");
                    let kept = w.gathered_copy().expect("compute gathered the copy");
                    assert!(c.shares_piece(&kept), "{w:?}: the copy is kept");
                }
                let run = |zero, rc| train_as(Some(&p), tp, opt, zero, rc, Some(C));
                let sharded = Zero::new(stage, 0).unwrap();
                (
                    run(sharded, false),
                    run(Zero::OFF, false),
                    run(sharded, true),
                )
            });
            for (mixed, whole, recomputed) in &runs {
                let what = format!("{opt:?} ZeRO-{stage} mesh {mesh:?}");
                // The gradients reach the master shards as whole partial sums and are reduced
                // in the leaves' dtype, as the whole leaves' are: the same bits.
                assert_eq!(mixed.0, whole.0, "{what}: losses against whole leaves");
                assert_eq!(mixed.1, whole.1, "{what}: parameters against whole leaves");
                for run in [mixed, recomputed] {
                    near(&run.0, &want_losses, &format!("{what}: losses"));
                    for (a, b) in run.1.iter().zip(&want_params) {
                        near(a, b, &format!("{what}: parameters"));
                    }
                }
                if let Opt::Sgd = opt {
                    // SGD writes no copies: the whole leaves' are cast at each use.
                    continue;
                }
                // AdamW: master shards (f64 / dp), their f32 copies and the whole f32 copy,
                // against whole f64 leaves and their f32 copies.
                let slack = 8 * 2 * WIDTH * 7;
                assert!(
                    mixed.2 .0 <= whole.2 .0 / mesh[0] + whole.2 .0 / 3 + slack,
                    "{what}: parameters {:?} vs {:?}",
                    mixed.2,
                    whole.2
                );
                assert!(
                    mixed.2 .0 < whole.2 .0,
                    "{what}: {:?} vs {:?}",
                    mixed.2,
                    whole.2
                );
            }
        }
    }
}

/// Within f32 rounding: the reductions sum f32 partials in another order than one rank.
fn near(a: &[f64], b: &[f64], what: &str) {
    within(a, b, 1e-5, what);
}

#[test]
fn a_master_shards_gathered_copy_follows_its_leaf() {
    let runs = run_ranks(2, Duration::from_secs(60), |_| {
        let p = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
        let net = Net::new(Some(&p), None);
        net.set_precision(&computing_as(DType::F32)).unwrap();
        let params = net.parameters();
        let w = params[0].clone();
        let mut o = optimizer(params, Opt::Adam, Zero::new(2, 0).unwrap());
        assert!(
            w.gathered_copy().is_none(),
            "nothing is gathered before use"
        );
        let first = w
            .prefetch()
            .unwrap()
            .expect("a master shard gathers its copy");
        assert!(w.prefetch().unwrap().unwrap().same(&first), "once per leaf");
        backward_on_ones(&net, &p, DType::F32);
        let g = w.grad().expect("the shard has a gradient");
        assert_eq!((g.dtype(), g.nd_sbp()), (F, w.value().nd_sbp()));
        o.step().unwrap();
        // The update gathered the new copy; the old one is gone with its leaf.
        let next = w.gathered_copy().expect("the update gathers the new copy");
        assert!(!next.same(&first));
        assert_ne!(vals(&next), vals(&first), "the step changed the weight");
        let copy = w.compute_copy().expect("the update wrote the shard's copy");
        let whole = copy.to_global(&p, NdSbp::broadcast(1)).unwrap();
        assert_eq!(
            vals(&whole),
            vals(&next),
            "the gathered copy is the shard's"
        );
        // A value set from outside (a checkpoint load) is gathered anew at use.
        w.set_value(&w.value().mul_scalar(2.0).unwrap()).unwrap();
        assert!(w.gathered_copy().is_none() && w.compute_copy().is_none());
        let fresh = w.compute().unwrap();
        let want: Vec<f64> = vals(&next).iter().map(|v| v * 2.0).collect();
        assert_eq!(vals(&fresh), want, "the new leaf's copy");
        // Computing in the leaf's own dtype, the leaf itself is gathered.
        w.set_compute_dtype(None);
        let own = w.compute().unwrap();
        assert_eq!(own.dtype(), F, "no stale f32 copy");
        let whole = w.value().to_global(&p, NdSbp::broadcast(1)).unwrap();
        assert_eq!(vals(&own), vals(&whole));
        vals(&fresh)
    });
    assert_eq!(runs[0], runs[1]);
}
