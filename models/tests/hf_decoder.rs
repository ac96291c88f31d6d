//! The decoder family against transformers: each fixture of `tests/fixtures/hf` (GPT-2; Llama
//! with grouped-query attention, llama3 rope scaling, untied and sharded; Qwen2 with biases,
//! tied, stored bf16; Mistral with one key/value head, linear rope scaling, stored f16) read
//! with `HfCheckpoint` into a `Gpt` in f64 gives transformers' f64 loss on the fixture's
//! windows within 1e-9 relative, locally and on in-process meshes (tensor parallel with the
//! key/value heads split or replicated, data parallel with an uneven last batch, sequence
//! parallel, pipeline stages).

use std::path::{Path, PathBuf};
use std::time::Duration;

use oxiflow_dtype::DType;
use oxiflow_models::hf::HfCheckpoint;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, Pass, StageSplit};
use oxiflow_models::nn::Module;
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{no_grad, run_ranks, Context, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fixture's windows of T + 1 tokens as (inputs, targets) rows.
fn windows(t: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    let bytes = std::fs::read(fixtures().join("tokens.bin")).unwrap();
    let ids: Vec<i64> = bytes
        .chunks_exact(2)
        .map(|c| i64::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    ids.chunks_exact(t + 1)
        .map(|w| (w[..t].to_vec(), w[1..].to_vec()))
        .collect()
}

/// The model of fixture `name` in f64 on `split` (`sp`: sequence parallel), its weights read.
fn model(name: &str, split: StageSplit, sp: bool) -> Gpt {
    let ck = HfCheckpoint::open(&fixtures().join(name)).unwrap();
    let base = GptConfig {
        dtype: DType::F64,
        vocab_multiple: 64,
        sequence_parallel: sp,
        ..GptConfig::default()
    };
    let m = Gpt::with_arch(&ck.config.gpt_config(&base), &ck.config.arch, split).unwrap();
    ck.load_into(&m.parameters()).unwrap();
    m
}

/// The mean loss over every window, `batch` windows at a time, laid out by `lay` (ids: `true`,
/// targets: `false`); None on a rank outside the last stage, which holds the sums.
fn eval(m: &Gpt, t: usize, batch: usize, lay: &dyn Fn(Tensor, bool) -> Tensor) -> Option<f64> {
    let _ng = no_grad();
    let (mut sum, mut n) = (Some(0.0), 0usize);
    for rows in windows(t).chunks(batch) {
        let ids: Vec<i64> = rows.iter().flat_map(|r| r.0.clone()).collect();
        let tg: Vec<i64> = rows.iter().flat_map(|r| r.1.clone()).collect();
        let shape = [rows.len(), t];
        let ids = lay(Tensor::from_vec(ids, shape).unwrap(), true);
        let tg = lay(Tensor::from_vec(tg, shape).unwrap(), false);
        let (s, count) = m.loss_sum(&ids, &tg, Pass::Eval).unwrap();
        let rank = Context::current().map_or(0, |c| c.rank());
        sum = match sum {
            Some(v) if s.placement().is_none_or(|p| p.contains(rank)) => {
                Some(v + s.cast(DType::F64).unwrap().to_vec::<f64>().unwrap()[0])
            }
            _ => None,
        };
        n += count;
    }
    sum.map(|s| s / n as f64)
}

fn expected(name: &str) -> (f64, usize) {
    let r = reference();
    let m = &r["models"][name];
    (
        m["eval_loss"].as_f64().unwrap(),
        r["seq_len"].as_u64().unwrap() as usize,
    )
}

fn close(name: &str, what: &str, got: f64, want: f64) {
    let rel = (got - want).abs() / want.abs();
    eprintln!("{name} {what}: {got:.15} vs transformers {want:.15} (relative {rel:.2e})");
    assert!(
        rel < 1e-9,
        "{name} {what}: {got} vs {want}: relative {rel:e}"
    );
}

#[test]
fn parameter_shapes_are_the_built_models() {
    for name in MODELS {
        let ck = HfCheckpoint::open(&fixtures().join(name)).unwrap();
        for tie in [false, true] {
            let arch = oxiflow_models::nn::gpt::Arch {
                tie_embeddings: tie,
                ..ck.config.arch.clone()
            };
            let cfg = ck.config.gpt_config(&GptConfig::default());
            let m = Gpt::with_arch(&cfg, &arch, StageSplit::single(2, &GptLayout::Local)).unwrap();
            let built: Vec<(String, Vec<usize>)> = m
                .parameters()
                .iter()
                .map(|p| (p.name().to_string(), p.value().shape().dims().to_vec()))
                .collect();
            assert_eq!(
                Gpt::parameter_shapes(&cfg, &arch),
                built,
                "{name} tied {tie}"
            );
        }
    }
}

const MODELS: [&str; 4] = ["gpt2", "qwen2", "mistral", "llama"];

#[test]
fn every_fixture_gives_transformers_loss_on_one_rank() {
    for name in MODELS {
        let (want, t) = expected(name);
        let m = model(name, StageSplit::single(2, &GptLayout::Local), false);
        let got = eval(&m, t, 3, &|x, _| x).unwrap();
        let f32_rope = reference()["models"][name]["eval_loss_f32_rope"].as_f64();
        eprintln!("{name}: {got:.15} f64 rope {want:.15} f32 rope {f32_rope:?}");
        close(name, "local", got, want);
    }
}

/// `[dp, tp]` meshes over ranks `first..first + dp tp`.
fn mesh(first: usize, dp: usize, tp: usize) -> Placement {
    let ranks: Vec<usize> = (first..first + dp * tp).collect();
    Placement::new(DeviceType::Cpu, vec![dp, tp], ranks).unwrap()
}

/// Global ids split over dp on `p` (each rank holds the whole batch first).
fn on(p: &Placement, x: Tensor) -> Tensor {
    x.to_global(p, NdSbp::broadcast(2))
        .unwrap()
        .to_global(p, NdSbp::new([Sbp::S(0), Sbp::B]))
        .unwrap()
}

#[test]
fn meshes_give_transformers_loss() {
    // (ranks, dp, tp, sequence parallel, batch): TP with the key/value heads split (llama,
    // qwen2) or replicated (mistral's one), DP with batches of 3 windows over 2 ranks (the
    // last of one window), both, and sequence parallelism.
    let layouts = [
        (2, 1, 2, false, 3),
        (2, 2, 1, false, 3),
        (4, 2, 2, false, 3),
        (2, 1, 2, true, 2),
    ];
    for name in MODELS {
        let (want, t) = expected(name);
        for (n, dp, tp, sp, batch) in layouts {
            let got = run_ranks(n, Duration::from_secs(120), |_| {
                let p = mesh(0, dp, tp);
                let m = model(
                    name,
                    StageSplit::single(
                        2,
                        &GptLayout::Mesh(NamedMesh::of(p.clone(), &[DP, TP]).unwrap()),
                    ),
                    sp,
                );
                eval(&m, t, batch, &|x, _| on(&p, x))
            });
            for g in got {
                close(name, &format!("dp {dp} tp {tp} sp {sp}"), g.unwrap(), want);
            }
        }
    }
}

#[test]
fn pipeline_stages_give_transformers_loss() {
    for name in MODELS {
        let (want, t) = expected(name);
        let got = run_ranks(4, Duration::from_secs(120), |_| {
            let (a, b) = (mesh(0, 1, 2), mesh(2, 1, 2));
            let layouts = [&a, &b]
                .map(|p| GptLayout::Mesh(NamedMesh::of(p.clone(), &[DP, TP]).unwrap()))
                .to_vec();
            let m = model(name, StageSplit::new(2, layouts, 1).unwrap(), false);
            eval(&m, t, 4, &|x, input| on(if input { &a } else { &b }, x))
        });
        assert!(got[..2].iter().all(Option::is_none));
        for g in &got[2..] {
            close(name, "pp 2 x tp 2", g.unwrap(), want);
        }
    }
}

#[test]
fn decoding_through_the_cache_gives_the_whole_sequences_logits() {
    let _ng = no_grad();
    for name in MODELS {
        let m = model(name, StageSplit::single(2, &GptLayout::Local), false);
        let mut cache = m.new_cache();
        let seq: Vec<i64> = vec![5, 17, 3, 200, 11, 42, 7, 99];
        let ids = |v: &[i64]| Tensor::from_vec(v.to_vec(), [1, v.len()]).unwrap();
        let mut last = m.decode(&ids(&seq[..3]), &mut cache).unwrap();
        for t in 3..=seq.len() {
            let whole = m.forward(&ids(&seq[..t]), Pass::Eval).unwrap();
            let rows = whole.shape().dim(2);
            let want = whole
                .narrow(1, t - 1, 1)
                .unwrap()
                .reshape([1, rows])
                .unwrap();
            let (a, b) = (last.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-12, "{name} at {t}: {worst:e}");
            if t < seq.len() {
                last = m.decode(&ids(&seq[t..t + 1]), &mut cache).unwrap();
            }
        }
        assert_eq!(cache.len(), seq.len());
    }
}
