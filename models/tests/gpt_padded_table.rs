//! The GPT with its token table padded (`GptConfig::vocab_multiple`) computes the unpadded
//! model's function: the table has the padded rows, the logits the padded width, and the loss
//! and every gradient equal the unpadded model's (the padded rows' gradient exactly 0), locally
//! and on in-process meshes with the vocabulary split over tp (uneven shards, one of only
//! padding) or the batch over dp; the padded size and its checks.

use std::time::Duration;

use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{padded_vocab, Gpt, GptConfig, GptLayout, Pass, TOKEN_TABLE};
use oxiflow_models::nn::Module;
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{run_ranks, Tensor};

/// A tiny GPT over a vocabulary of 40 (64 rows with the default multiple), 4 heads.
fn cfg(vocab_multiple: usize) -> GptConfig {
    GptConfig {
        vocab: 40,
        vocab_multiple,
        seq_len: 8,
        layers: 2,
        heads: 4,
        width: 16,
        seed: 5,
        dtype: DType::F64,
        ..GptConfig::default()
    }
}

const B: usize = 4;
const T: usize = 6;

fn ids(seed: i64) -> Vec<i64> {
    (0..(B * T) as i64)
        .map(|i| (i * 11 + seed * 7) % 40)
        .collect()
}

/// The loss of one forward and backward, and every parameter's gradient (by name, whole).
type Run = (f64, Vec<(String, Vec<f64>)>);

fn step(m: &Gpt, x: &Tensor, y: &Tensor, whole: impl Fn(&Tensor) -> Tensor) -> Run {
    let loss = m.loss(x, y, Pass::Train { step: 0 }).unwrap();
    loss.backward().unwrap();
    let l = whole(&loss).to_vec::<f64>().unwrap()[0];
    let grads = m
        .parameters()
        .iter()
        .map(|p| {
            let g = whole(&p.grad().unwrap()).to_vec::<f64>().unwrap();
            (p.name().to_string(), g)
        })
        .collect();
    (l, grads)
}

fn local_run(multiple: usize) -> Run {
    let m = Gpt::new(&cfg(multiple), &GptLayout::Local).unwrap();
    let x = Tensor::from_vec(ids(1), [B, T]).unwrap();
    let y = Tensor::from_vec(ids(2), [B, T]).unwrap();
    step(&m, &x, &y, |t| t.clone())
}

fn mesh_run(dp: usize, tp: usize, multiple: usize) -> Run {
    let p = Placement::new(
        DeviceType::Cpu,
        vec![dp, tp],
        (0..dp * tp).collect::<Vec<_>>(),
    )
    .unwrap();
    let got = run_ranks(dp * tp, Duration::from_secs(120), |_| {
        let m = Gpt::new(
            &cfg(multiple),
            &GptLayout::Mesh(NamedMesh::of(p.clone(), &[DP, TP]).unwrap()),
        )
        .unwrap();
        let rows = NdSbp::new([Sbp::S(0), Sbp::B]);
        let put = |v: Vec<i64>| {
            Tensor::from_vec(v, [B, T])
                .unwrap()
                .to_global(&p, rows.clone())
                .unwrap()
        };
        let whole = |t: &Tensor| t.to_global(&p, NdSbp::broadcast(2)).unwrap();
        step(&m, &put(ids(1)), &put(ids(2)), whole)
    });
    got.into_iter().next().unwrap()
}

/// `padded` equals `plain` (loss and gradients to 1e-12 relative), its table's gradient has
/// the plain one's rows first and exact zeros after them.
fn same_function(plain: &Run, padded: &Run, what: &str) {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * (1.0 + b.abs());
    assert!(
        close(padded.0, plain.0),
        "{what}: loss {} vs {}",
        padded.0,
        plain.0
    );
    assert_eq!(plain.1.len(), padded.1.len());
    for ((name, g0), (name1, g1)) in plain.1.iter().zip(&padded.1) {
        assert_eq!(name, name1);
        let (real, pad) = if name == TOKEN_TABLE {
            g1.split_at(g0.len())
        } else {
            (g1.as_slice(), &[][..])
        };
        assert_eq!(real.len(), g0.len(), "{what}: {name}");
        for (i, (a, b)) in real.iter().zip(g0).enumerate() {
            assert!(close(*a, *b), "{what}: {name}[{i}] {a} vs {b}");
        }
        assert!(
            pad.iter().all(|&v| v == 0.0),
            "{what}: the padded rows of {name} get a gradient"
        );
    }
}

#[test]
fn the_padded_table_has_the_padded_rows_and_the_logits_the_padded_width() {
    assert_eq!(cfg(64).table_rows(), 64);
    assert_eq!(cfg(1).table_rows(), 40);
    assert_eq!(cfg(8).table_rows(), 40);
    assert_eq!(padded_vocab(50257, 64), Some(50304));
    assert_eq!(padded_vocab(256, 64), Some(256));
    assert_eq!(padded_vocab(5, 0), None);
    assert_eq!(padded_vocab(usize::MAX, 64), None);
    let m = Gpt::new(&cfg(64), &GptLayout::Local).unwrap();
    assert_eq!(m.wte.weight.value().shape().dims(), &[64, 16]);
    let x = Tensor::from_vec(ids(1), [B, T]).unwrap();
    let logits = m.forward(&x, Pass::Eval).unwrap();
    assert_eq!(logits.shape().dims(), &[B, T, 64]);
    // The first 40 rows are the unpadded table's.
    let plain = Gpt::new(&cfg(1), &GptLayout::Local).unwrap();
    let (w0, w1) = (
        plain.wte.weight.value().to_vec::<f64>().unwrap(),
        m.wte.weight.value().to_vec::<f64>().unwrap(),
    );
    assert_eq!(w0[..], w1[..w0.len()]);
}

#[test]
fn a_padded_gpt_computes_the_unpadded_function() {
    let plain = local_run(1);
    for multiple in [64, 48, 7] {
        same_function(
            &plain,
            &local_run(multiple),
            &format!("local, multiple {multiple}"),
        );
    }
}

#[test]
fn a_padded_gpt_computes_the_unpadded_function_on_meshes() {
    let plain = local_run(1);
    // tp 4 splits 64 rows 16 per rank: the last shard (48..64) holds only padding; tp 3
    // (4 heads do not split over 3) is not a layout, so tp 2 and 4 and dp 2.
    for (dp, tp) in [(1, 2), (1, 4), (2, 1), (2, 2)] {
        for multiple in [1, 64] {
            let what = format!("dp {dp} tp {tp}, multiple {multiple}");
            same_function(&plain, &mesh_run(dp, tp, multiple), &what);
        }
    }
}

#[test]
fn bad_multiples_are_refused() {
    let e = GptConfig {
        vocab_multiple: 0,
        ..cfg(1)
    }
    .validate(&GptLayout::Local)
    .unwrap_err();
    assert!(
        e.to_string().contains("vocab_multiple must be at least 1"),
        "{e}"
    );
    let e = GptConfig {
        vocab: usize::MAX - 3,
        ..cfg(64)
    }
    .validate(&GptLayout::Local)
    .unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
    assert!(Gpt::new(
        &GptConfig {
            vocab_multiple: 0,
            ..cfg(1)
        },
        &GptLayout::Local
    )
    .is_err());
}
