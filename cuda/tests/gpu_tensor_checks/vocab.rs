//! The GPU suite's check of the vocabulary-parallel cross-entropy kernels (`vp_lse`, `vp_loss`,
//! `vp_bw`): the three ops dispatched on logits split on the classes over the world's ranks
//! (each rank one class shard, padding columns included, 16-bit logits read as they are) and
//! the padded classifier loss that composes them, against the CPU kernels on local tensors of
//! the same values, in f32, bf16, f16 and f64; the padding's gradient exactly 0.

use super::*;
use oxiflow_ops::classifier::classifier_loss_padded;
use oxiflow_tensor::{dispatch, ClassShard, LossOp, Op};

/// The per-row log-sum-exp from the per-shard partials `[N, shards]`.
fn combine(partials: &Tensor) -> Result<Tensor> {
    let m = partials.max(&[1], true)?;
    partials.sub(&m)?.exp()?.sum(&[1], true)?.log()?.add(&m)
}

/// (log-sum-exp, loss, dlogits of the direct ops, loss and dlogits of the padded classifier)
/// of logits `x` `[N, C]` against `labels` `[N]` over `classes`, with incoming gradients `dy`
/// `[N, 1]` and `c` `[N]` (compute dtype), `shards` the logits' class shards; whole values.
fn vocab_outputs(
    x: &Tensor,
    labels: &Tensor,
    dy: &Tensor,
    c: &Tensor,
    classes: usize,
    shards: usize,
    whole: &dyn Fn(&Tensor) -> Result<Vec<f64>>,
) -> Result<Vec<Vec<f64>>> {
    let n = x.shape().dim(0);
    let at = ClassShard { start: 0, classes };
    let partials = dispatch(
        Op::from(LossOp::VocabParallelLse { at, parts: shards }),
        &[x],
    )?;
    let partials = match x.placement() {
        Some(p) => partials.to_global(p, NdSbp::broadcast(p.ndim()))?,
        None => partials,
    };
    let lse = combine(&partials)?;
    let lab = labels.reshape([n, 1])?;
    let loss = dispatch(Op::from(LossOp::VocabParallel { at }), &[x, &lab, &lse])?;
    let dx = dispatch(
        Op::from(LossOp::VocabParallelBackward { at }),
        &[x, &lab, &lse, dy],
    )?;
    let xg = x.detach().requires_grad_(true);
    let l2 = classifier_loss_padded(&xg, labels, classes)?;
    l2.mul(c)?.sum_all()?.backward()?;
    let g2 = grad_of(&xg, "vocab check")?;
    [&lse, &loss, &dx, &l2, &g2]
        .into_iter()
        .map(whole)
        .collect()
}

/// Checks every (dtype, shape) case on a 1-d placement of `world` ranks of `dev` (logits S(1))
/// against local CPU tensors; the number of cases checked.
pub(crate) fn child_vocab_parallel(world: usize, dev: DeviceType) -> Checked {
    let pl = world_placement(world, dev)?;
    let mut checked = 0;
    // Uneven splits, shards of padding only ([4, 7] over 2 classes on 2 or more ranks),
    // classes == C, rows longer than a block.
    let shapes = [
        (6usize, 13usize, 9usize),
        (5, 16, 16),
        (4, 7, 2),
        (3, 1031, 1000),
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for (i, &(rows, width, classes)) in shapes.iter().enumerate() {
            let what = format!("vocab-parallel [{rows}, {width}] over {classes} in {dtype}");
            let e = |x: oxiflow_tensor::TensorError| format!("{what}: {x}");
            let seed = 70 + i as u64;
            let ids: Vec<i64> = (0..rows as i64)
                .map(|r| (r * 5 + 3) % classes as i64)
                .collect();
            let stats = dtype.compute();
            let run = |global: bool| -> Result<Vec<Vec<f64>>> {
                let (x, labels, dy, c) = if global {
                    let b = NdSbp::broadcast(1);
                    (
                        Tensor::randn_global([rows, width], seed, dtype, &pl, Sbp::S(1))?,
                        Tensor::from_vec(ids.clone(), [rows])?.to_global(&pl, b.clone())?,
                        Tensor::randn_global([rows, 1], seed + 1, stats, &pl, Sbp::B)?,
                        Tensor::randn_global([rows], seed + 2, stats, &pl, Sbp::B)?,
                    )
                } else {
                    (
                        Tensor::randn([rows, width], seed, dtype),
                        Tensor::from_vec(ids.clone(), [rows])?,
                        Tensor::randn([rows, 1], seed + 1, stats),
                        Tensor::randn([rows], seed + 2, stats),
                    )
                };
                let x = x.mul_scalar(3.0)?;
                let shards = if global { world } else { 1 };
                let whole = |t: &Tensor| -> Result<Vec<f64>> {
                    let t = match t.placement() {
                        Some(p) => t.to_global(p, NdSbp::broadcast(1))?,
                        None => t.clone(),
                    };
                    t.cast(DType::F64)?.to_vec::<f64>()
                };
                vocab_outputs(&x, &labels, &dy, &c, classes, shards, &whole)
            };
            let got = run(true).map_err(e)?;
            let want = run(false).map_err(e)?;
            // Losses are in the compute dtype; 16-bit gradients are rounded once on each side
            // (one 16-bit ulp apart at most).
            let grad_tol = match dtype {
                DType::BF16 => 2f64.powi(-7),
                DType::F16 => 2f64.powi(-10),
                _ => 2e-4,
            };
            let names = [
                "lse",
                "loss",
                "dlogits",
                "classifier loss",
                "classifier dlogits",
            ];
            for (k, ((name, g), w)) in names.iter().zip(&got).zip(&want).enumerate() {
                let tol = if k == 2 || k == 4 { grad_tol } else { 2e-4 };
                close_to(g, w, tol).map_err(|d| format!("{what} {name} on {dev:?}: {d}"))?;
            }
            for name in [2, 4] {
                for (r, row) in got[name].chunks(width).enumerate() {
                    if let Some(j) = (classes..width).find(|&j| row[j] != 0.0) {
                        return Err(format!(
                            "{what} {}: row {r} padding column {j} is {}",
                            names[name], row[j]
                        ));
                    }
                }
            }
            checked += 1;
        }
    }
    Ok(checked)
}
