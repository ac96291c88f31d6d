//! Vocabulary parallelism: an embedding with its weight split on the vocabulary and a
//! cross-entropy with its logits split on the classes, on 1-d and 2-d meshes with uneven
//! splits, equal one rank in value and gradient, keep the split layouts, and move only
//! per-row partials between ranks (the logits are never gathered: checked on the flight
//! recorder, which is why this file holds a single test).

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::{placement, vals, weighted_sum};
use oxiflow_collectives::flight_recorder;
use oxiflow_tensor::{run_ranks, Context, DType, NdSbp, Placement, Sbp, Tensor};

const F: DType = DType::F64;

fn labels(n: usize, classes: usize, seed: u64) -> Vec<i64> {
    (0..n as u64)
        .map(|i| ((i * 7 + seed * 3) % classes as u64) as i64)
        .collect()
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() < 1e-9 * (1.0 + b.abs()),
            "{what} [{i}]: {a} vs {b}"
        );
    }
}

/// Embedding rows of a vocabulary-split weight, then a loss: output P on the vocabulary axis,
/// dweight in the weight's own layout, values equal to one rank.
fn check_embedding(p: &Placement, w_sbp: NdSbp, vocab: usize, hidden: usize) {
    let ids_v = labels(6, vocab, 1);
    let r = Tensor::randn([6, hidden], 22, F);
    let w = Tensor::randn([vocab, hidden], 21, F).requires_grad_(true);
    let ids = Tensor::from_vec(ids_v.clone(), [6]).unwrap();
    let y = Tensor::embedding(&ids, &w).unwrap();
    weighted_sum(&y, &r).backward().unwrap();
    let (want_y, want_g) = (vals(&y), vals(&w.grad().unwrap()));
    let n = p.num_ranks();
    let got = run_ranks(n, Duration::from_secs(30), |_| {
        let b = NdSbp::broadcast(p.ndim());
        let w = Tensor::randn_global([vocab, hidden], 21, F, p, w_sbp.clone())
            .unwrap()
            .requires_grad_(true);
        let ids = Tensor::from_vec(ids_v.clone(), [6])
            .unwrap()
            .to_global(p, b.clone())
            .unwrap();
        let r = Tensor::randn_global([6, hidden], 22, F, p, b.clone()).unwrap();
        // An id outside the vocabulary is a typed error on every rank, not a zero row.
        let bad = Tensor::from_vec(vec![0i64, vocab as i64], [2])
            .unwrap()
            .to_global(p, b.clone())
            .unwrap();
        let err = Tensor::embedding(&bad, &w).unwrap_err().to_string();
        assert!(err.contains("out of range"), "{err}");
        let y = Tensor::embedding(&ids, &w).unwrap();
        let y_sbp = y.nd_sbp().unwrap().clone();
        weighted_sum(&y, &r).backward().unwrap();
        let g = w.grad().unwrap();
        let g_sbp = g.nd_sbp().unwrap().clone();
        let all = |t: &Tensor| vals(&t.to_global(p, b.clone()).unwrap());
        (y_sbp, g_sbp, all(&y), all(&g))
    });
    for (y_sbp, g_sbp, y, g) in got {
        for a in 0..p.ndim() {
            if w_sbp[a] == Sbp::S(0) {
                assert_eq!(y_sbp[a], Sbp::P, "lookup on {p} with weight {w_sbp}");
            }
        }
        assert_eq!(g_sbp, w_sbp, "dweight layout on {p}");
        close(&y, &want_y, "embedding");
        close(&g, &want_g, "dweight");
    }
}

/// Mean cross-entropy of class-split logits: loss and dlogits equal one rank, dlogits keeps the
/// logits' layout, and no recorded transfer is larger than a few per-row values.
fn check_cross_entropy(p: &Placement, x_sbp: NdSbp, l_sbp: NdSbp, rows: usize, classes: usize) {
    let lab = labels(rows, classes, 2);
    let x = Tensor::randn([rows, classes], 31, F).requires_grad_(true);
    let y = Tensor::from_vec(lab.clone(), [rows]).unwrap();
    let loss = x.cross_entropy(&y).unwrap();
    loss.mean_all().unwrap().backward().unwrap();
    let (want_l, want_g) = (vals(&loss), vals(&x.grad().unwrap()));
    let n = p.num_ranks();
    let moved = Mutex::new(Vec::new());
    let got = run_ranks(n, Duration::from_secs(30), |rank| {
        let b = NdSbp::broadcast(p.ndim());
        let x = Tensor::randn_global([rows, classes], 31, F, p, x_sbp.clone())
            .unwrap()
            .requires_grad_(true);
        let y = Tensor::from_vec(lab.clone(), [rows])
            .unwrap()
            .to_global(p, b.clone())
            .unwrap()
            .to_global(p, l_sbp.clone())
            .unwrap();
        // A label outside the classes is a typed error on every rank.
        let bad = Tensor::from_vec(vec![classes as i64; rows], [rows])
            .unwrap()
            .to_global(p, b.clone())
            .unwrap();
        let err = x.cross_entropy(&bad).unwrap_err().to_string();
        assert!(err.contains("out of range"), "{err}");
        flight_recorder().set_capacity(4096);
        let world = Context::current().unwrap().world().clone();
        world.barrier().unwrap();
        let loss = x.cross_entropy(&y).unwrap();
        loss.mean_all().unwrap().backward().unwrap();
        let g = x.grad().unwrap();
        // Every rank is done with the loss and its backward before the recorder is read, and
        // nothing is gathered before it is read.
        world.barrier().unwrap();
        if rank == 0 {
            *moved.lock().unwrap() = flight_recorder().snapshot();
        }
        world.barrier().unwrap();
        (
            g.nd_sbp().cloned(),
            vals(&loss.to_global(p, b.clone()).unwrap()),
            vals(&g.to_global(p, b).unwrap()),
        )
    });
    let moved = moved.into_inner().unwrap();
    let largest = moved.iter().map(|e| e.bytes).max().unwrap_or(0);
    let row_bytes = (rows * F.size()) as u64;
    assert!(
        moved.iter().any(|e| e.bytes > 0),
        "the partials must be reduced between ranks"
    );
    assert!(
        largest <= row_bytes,
        "on {p} with logits {x_sbp} a transfer of {largest} bytes exceeds the {row_bytes} bytes \
         of a per-row value: {moved:?}"
    );
    for (g_sbp, l, g) in got {
        assert_eq!(g_sbp, Some(x_sbp.clone()), "dlogits layout");
        close(&l, &want_l, "loss");
        close(&g, &want_g, "dlogits");
    }
}

#[test]
fn vocabulary_parallel_embedding_and_cross_entropy_equal_one_rank() {
    const B: Sbp = Sbp::B;
    #[allow(non_snake_case)]
    fn S(d: usize) -> Sbp {
        Sbp::S(d)
    }
    let meshes: [(&[usize], NdSbp, NdSbp); 5] = [
        (&[2], NdSbp::new([S(1)]), NdSbp::new([B])),
        (&[4], NdSbp::new([S(1)]), NdSbp::new([B])),
        (&[3], NdSbp::new([S(1)]), NdSbp::new([B])),
        (&[2, 2], NdSbp::new([S(0), S(1)]), NdSbp::new([S(0), B])),
        (&[2, 2], NdSbp::new([B, S(1)]), NdSbp::new([B, B])),
    ];
    for (i, (mesh, x_sbp, l_sbp)) in meshes.into_iter().enumerate() {
        let p = placement(mesh, i as u64);
        // Uneven: 7 and 11 classes over 2, 3 or 4 ranks; more ranks than classes too.
        for classes in [7, 11, 3] {
            check_cross_entropy(&p, x_sbp.clone(), l_sbp.clone(), 4, classes);
        }
        let w_sbp = NdSbp::new(x_sbp.iter().map(|s| if s == S(1) { S(0) } else { B }));
        for vocab in [7, 3] {
            check_embedding(&p, w_sbp.clone(), vocab, 5);
        }
    }
}
