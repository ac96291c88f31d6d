//! Benchmark: signature inference (the op's rule builder, then `InferEngine::choose`) over
//! chains of 100,000 and 200,000 ops (a transformer-like layer repeated, each layer with its own
//! batch size). Every op is inferred from scratch: the cached path is the tensor crate's
//! dispatch plan (`dispatch_bench`). Prints time per op and the ratio t(200k) / t(100k). Run
//! with `cargo bench -p oxiflow-sbp --bench infer_chain`.

#[path = "../tests/reference/op.rs"]
#[allow(dead_code)]
mod op;

use std::hint::black_box;
use std::time::{Duration, Instant};

use op::RuleCall;
use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{BinaryOp, NdSbp, ReduceKind, Sbp, SbpError, Shape};

const HIDDEN: usize = 256;
const HEADS: usize = 8;
const OPS_PER_LAYER: usize = 10;

/// One op call of the chain: the op, its input shapes and nd-SBPs (weights are B; activations
/// carry the nd-SBP the previous op produced).
struct Step {
    op: RuleCall,
    weights: Vec<(Shape, NdSbp)>,
}

/// The layer pattern on an activation x [b, H] with B weights: matmul, bias add, activation,
/// layer norm, split heads (reshape, permute), softmax, merge heads, sum. Each op takes the
/// previous op's output, so the chain is a straight line.
fn layer(ndim: usize) -> Vec<Step> {
    let b = NdSbp::broadcast(ndim);
    let w = |dims: &[usize]| (Shape::from(dims), b.clone());
    let permute = || RuleCall::Permute {
        perm: [1, 0, 2].into_iter().collect(),
    };
    let reshape = || RuleCall::Reshape {
        shape: Shape::scalar(),
    };
    let sum = RuleCall::Reduce {
        kind: ReduceKind::Sum,
        dims: [1].into_iter().collect(),
        keepdim: true,
    };
    [
        (RuleCall::MatMul, vec![w(&[HIDDEN, HIDDEN])]),
        (RuleCall::Binary(BinaryOp::Add), vec![w(&[HIDDEN])]),
        (RuleCall::Unary { linear: false }, vec![]),
        (
            RuleCall::LayerNorm { normalized_dims: 1 },
            vec![w(&[HIDDEN]), w(&[HIDDEN])],
        ),
        (reshape(), vec![]),
        (permute(), vec![]),
        (RuleCall::Softmax { dim: 2 }, vec![]),
        (permute(), vec![]),
        (reshape(), vec![]),
        (sum, vec![]),
    ]
    .into_iter()
    .map(|(op, weights)| Step { op, weights })
    .collect()
}

/// Infers a chain of `n` ops; returns the elapsed time and a checksum of costs.
fn run_chain(
    n: usize,
    placement: &Placement,
    pattern: &[Step],
) -> Result<(Duration, u64), SbpError> {
    let t0 = Instant::now();
    let mut checksum = 0u64;
    let first = NdSbp::new([Sbp::S(0), Sbp::B]);
    let mut i = 0;
    let mut layer_idx = 0usize;
    while i < n {
        let batch = 16 + layer_idx;
        layer_idx += 1;
        let mut x = (Shape::from([batch, HIDDEN]), first.clone());
        for step in pattern {
            if i == n {
                break;
            }
            i += 1;
            // Reshapes alternate between [b, heads, H/heads] and back to [b, H].
            let op = match &step.op {
                RuleCall::Reshape { .. } if x.0.ndim() == 2 => RuleCall::Reshape {
                    shape: Shape::from([batch, HEADS, HIDDEN / HEADS]),
                },
                RuleCall::Reshape { .. } => RuleCall::Reshape {
                    shape: Shape::from([batch, HIDDEN]),
                },
                other => other.clone(),
            };
            let mut inputs: Vec<(&Shape, &NdSbp)> = Vec::with_capacity(3);
            inputs.push((&x.0, &x.1));
            for (s, nd) in &step.weights {
                inputs.push((s, nd));
            }
            let sig = op::infer(&op, &inputs, placement, 4)?;
            checksum = checksum.wrapping_add(sig.cost);
            x = (sig.output_shapes[0].clone(), sig.outputs[0].clone());
        }
    }
    Ok((t0.elapsed(), black_box(checksum)))
}

fn per_op(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e9 / n as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let placement = Placement::new(DeviceType::Cuda, [2, 4], (0..8).collect::<Vec<_>>())?;
    let pattern = layer(placement.ndim());
    println!(
        "signature inference over a chain of ops ({} ops per layer, mesh {:?}, every op inferred)",
        OPS_PER_LAYER,
        placement.shape()
    );
    // Three rounds over both sizes; per size the fastest pass counts, which keeps the numbers
    // steady on a busy machine. Every pass must choose the same signatures.
    let sizes = [100_000usize, 200_000];
    let mut best = [Duration::MAX; 2];
    let mut sums = [None; 2];
    for round in 0..3 {
        for (k, &n) in sizes.iter().enumerate() {
            let (t, sum) = run_chain(n, &placement, &pattern)?;
            if *sums[k].get_or_insert(sum) != sum {
                return Err("a pass chose different signatures than the first".into());
            }
            println!(
                "round {round}, n = {n:>7}: {:>8.1} ns/op ({:.3} s)",
                per_op(t, n),
                t.as_secs_f64()
            );
            best[k] = best[k].min(t);
        }
    }
    for (k, &n) in sizes.iter().enumerate() {
        println!("best, n = {n:>7}: {:>8.1} ns/op", per_op(best[k], n));
    }
    let ratio = best[1].as_secs_f64() / best[0].as_secs_f64();
    println!("ratio t(200k)/t(100k): {ratio:.3} (linear: <= 2.2)");
    if ratio > 2.2 {
        return Err("inference is not linear in the chain length".into());
    }
    Ok(())
}
