//! LoRA adapters (`nn::Lora`, `Gpt::attach_lora`): a fresh (zero B) adapter leaves a fixture's
//! loss unchanged to the last bit; the adapters' gradients equal a hand-written f64 reference
//! and the frozen base gets none; under tensor parallelism (column- and row-parallel layers on
//! two ranks) the adapted product and the adapters' gradients equal one rank's; merging the
//! adapters into the weights gives the adapted model's loss; bad ranks and targets are named.

use std::path::{Path, PathBuf};
use std::time::Duration;

use oxiflow_dtype::DType;
use oxiflow_models::hf::HfCheckpoint;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, LoraSpec, Pass, StageSplit};
use oxiflow_models::nn::{
    Init, Linear, LinearOptions, LoraOptions, Module, Parallel, ParamPlacement, Parameter,
};
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::{no_grad, run_ranks, Tensor};

const F: DType = DType::F64;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf")
}

/// The fixture `name` in f64 on `layout`, its weights read.
fn fixture(name: &str, layout: &GptLayout) -> Gpt {
    let ck = HfCheckpoint::open(&fixtures().join(name)).unwrap();
    let base = GptConfig {
        dtype: F,
        ..GptConfig::default()
    };
    let cfg = ck.config.gpt_config(&base);
    let split = StageSplit::single(cfg.layers, layout);
    let m = Gpt::with_arch(&cfg, &ck.config.arch, split).unwrap();
    ck.load_into(&m.parameters()).unwrap();
    m
}

/// The first 4 windows of 8 + 1 fixture tokens as (inputs, targets), laid out as `layout`'s
/// batch (split over dp, whole over tp).
fn batch(layout: &GptLayout) -> (Tensor, Tensor) {
    let bytes = std::fs::read(fixtures().join("tokens.bin")).unwrap();
    let ids: Vec<i64> = bytes
        .chunks_exact(2)
        .map(|c| i64::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let (b, t) = (4, 8);
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for w in ids.chunks_exact(t + 1).take(b) {
        x.extend_from_slice(&w[..t]);
        y.extend_from_slice(&w[1..]);
    }
    let lay = |v: Vec<i64>| {
        let t = Tensor::from_vec(v, [b, t]).unwrap();
        match (
            layout.placement(),
            layout.activation_sbp(oxiflow_sbp::Sbp::B),
        ) {
            (Some(p), Some(nd)) => t
                .to_global(p, NdSbp::broadcast(p.ndim()))
                .unwrap()
                .to_global(p, nd)
                .unwrap(),
            _ => t,
        }
    };
    (lay(x), lay(y))
}

fn loss_of(m: &Gpt, layout: &GptLayout) -> f64 {
    let _ng = no_grad();
    let (x, y) = batch(layout);
    let l = m.loss(&x, &y, Pass::Eval).unwrap();
    let l = match l.placement() {
        Some(p) => l.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
        None => l,
    };
    l.to_vec::<f64>().unwrap()[0]
}

fn spec(rank: usize, targets: &str) -> LoraSpec {
    LoraSpec {
        options: LoraOptions { rank, alpha: 6.0 },
        targets: targets.split(',').map(str::to_string).collect(),
    }
}

/// Replaces `p`'s value by normal values of std 0.3 seeded by `seed`, in its own layout.
fn perturb(p: &Parameter, seed: u64) {
    let v = p.value();
    let at = match (v.placement(), v.nd_sbp()) {
        (Some(pl), Some(nd)) => ParamPlacement::Global {
            placement: pl.clone(),
            nd_sbp: nd.clone(),
        },
        _ => ParamPlacement::Local,
    };
    let t = Init::Normal { seed, std: 0.3 }
        .build(v.shape().clone(), v.dtype(), &at)
        .unwrap();
    p.set_value(&t).unwrap();
}

fn whole(t: &Tensor) -> Vec<f64> {
    match t.placement() {
        Some(p) => t
            .to_global(p, NdSbp::broadcast(p.ndim()))
            .unwrap()
            .to_vec::<f64>()
            .unwrap(),
        None => t.to_vec::<f64>().unwrap(),
    }
}

const LLAMA_ALL: &str = "q,k,v,o,gate,up,down";

#[test]
fn a_fresh_adapter_leaves_the_loss_unchanged_to_the_last_bit() {
    for (name, targets) in [
        ("llama", LLAMA_ALL),
        ("qwen2", LLAMA_ALL),
        ("gpt2", "c_fc,c_proj"),
    ] {
        let mut m = fixture(name, &GptLayout::Local);
        let before = loss_of(&m, &GptLayout::Local);
        m.attach_lora(&spec(2, targets)).unwrap();
        let after = loss_of(&m, &GptLayout::Local);
        eprintln!("{name}: {before:e} -> {after:e}");
        assert_eq!(before.to_bits(), after.to_bits(), "{name}");
        assert!(m.adapted().len() >= 2 * m.blocks.len(), "{name}");
    }
    // On a [1, 2] mesh (tensor-parallel adapters) too.
    let got = run_ranks(2, Duration::from_secs(120), |_| {
        let p = Placement::new(DeviceType::Cpu, vec![1, 2], vec![0, 1]).unwrap();
        let layout = GptLayout::Mesh(NamedMesh::of(p, &[DP, TP]).unwrap());
        let mut m = fixture("llama", &layout);
        let before = loss_of(&m, &layout);
        m.attach_lora(&spec(2, LLAMA_ALL)).unwrap();
        (before, loss_of(&m, &layout))
    });
    for (before, after) in got {
        assert_eq!(before.to_bits(), after.to_bits());
    }
}

/// y = x W + b + s (x A) B for x [N, I], W [I, O], A [I, R], B [R, O], row-major.
struct Reference {
    n: usize,
    i: usize,
    o: usize,
    r: usize,
    s: f64,
}

impl Reference {
    /// (dA, dB) of sum(y * g).
    fn grads(&self, x: &[f64], a: &[f64], b: &[f64], g: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (n, i, o, r) = (self.n, self.i, self.o, self.r);
        // h = x A [N, R]; dB = s h^T g; dh = s g B^T; dA = x^T dh.
        let mut h = vec![0.0; n * r];
        for row in 0..n {
            for k in 0..r {
                h[row * r + k] = (0..i).map(|j| x[row * i + j] * a[j * r + k]).sum();
            }
        }
        let mut db = vec![0.0; r * o];
        for k in 0..r {
            for c in 0..o {
                db[k * o + c] = self.s
                    * (0..n)
                        .map(|row| h[row * r + k] * g[row * o + c])
                        .sum::<f64>();
            }
        }
        let mut dh = vec![0.0; n * r];
        for row in 0..n {
            for k in 0..r {
                dh[row * r + k] =
                    self.s * (0..o).map(|c| g[row * o + c] * b[k * o + c]).sum::<f64>();
            }
        }
        let mut da = vec![0.0; i * r];
        for j in 0..i {
            for k in 0..r {
                da[j * r + k] = (0..n).map(|row| x[row * i + j] * dh[row * r + k]).sum();
            }
        }
        (da, db)
    }
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{k}]: {g} vs {w}"
        );
    }
}

fn linear(parallel: Parallel, placement: Option<&Placement>) -> Linear {
    let o = LinearOptions {
        bias: true,
        seed: 7,
        dtype: F,
        placement: placement.cloned(),
        parallel,
    };
    let mut l = Linear::new("lin", 6, 4, &o).unwrap();
    l.attach_lora(
        LoraOptions {
            rank: 3,
            alpha: 5.0,
        },
        11,
    )
    .unwrap();
    let lora = l.lora.as_ref().unwrap();
    // A nonzero B, so dA is not zero.
    perturb(&lora.b, 13);
    l
}

/// The adapted layer's output, dA and dB on x [5, 6] (seed 1) and dy = g [5, 4] (seed 2).
fn run_layer(l: &Linear, placement: Option<&Placement>) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let lay = |t: Tensor| match placement {
        Some(p) => t.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
        None => t,
    };
    let x = lay(Tensor::randn([5, 6], 1, F));
    let g = lay(Tensor::randn([5, 4], 2, F));
    let y = l.forward(&x).unwrap();
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let lora = l.lora.as_ref().unwrap();
    assert!(
        l.weight.grad().is_none(),
        "the frozen weight got a gradient"
    );
    assert!(
        l.bias.as_ref().unwrap().grad().is_none(),
        "the frozen bias got a gradient"
    );
    (
        whole(&y),
        whole(&lora.a.grad().unwrap()),
        whole(&lora.b.grad().unwrap()),
    )
}

#[test]
fn adapter_gradients_equal_a_hand_written_f64_reference() {
    let l = linear(Parallel::Replicated, None);
    let (y, da, db) = run_layer(&l, None);
    let lora = l.lora.as_ref().unwrap();
    let (a, b) = (whole(&lora.a.value()), whole(&lora.b.value()));
    let (w, bias) = (
        whole(&l.weight.value()),
        whole(&l.bias.as_ref().unwrap().value()),
    );
    let x = Tensor::randn([5, 6], 1, F).to_vec::<f64>().unwrap();
    let g = Tensor::randn([5, 4], 2, F).to_vec::<f64>().unwrap();
    let r = Reference {
        n: 5,
        i: 6,
        o: 4,
        r: 3,
        s: 5.0 / 3.0,
    };
    // The forward pass by hand too.
    let mut want_y = vec![0.0; 5 * 4];
    for row in 0..5 {
        for c in 0..4 {
            let base: f64 = (0..6).map(|j| x[row * 6 + j] * w[j * 4 + c]).sum();
            let ab: f64 = (0..3)
                .map(|k| (0..6).map(|j| x[row * 6 + j] * a[j * 3 + k]).sum::<f64>() * b[k * 4 + c])
                .sum();
            want_y[row * 4 + c] = base + bias[c] + r.s * ab;
        }
    }
    let (want_da, want_db) = r.grads(&x, &a, &b, &g);
    close("y", &y, &want_y, 1e-12);
    close("dA", &da, &want_da, 1e-12);
    close("dB", &db, &want_db, 1e-12);
    assert!(want_da.iter().any(|v| v.abs() > 1e-3) && want_db.iter().any(|v| v.abs() > 1e-3));
}

#[test]
fn tensor_parallel_adapters_equal_one_rank() {
    for parallel in [Parallel::Column(1), Parallel::Row(1)] {
        let one = run_layer(&linear(Parallel::Replicated, None), None);
        let got = run_ranks(2, Duration::from_secs(60), |_| {
            let p = Placement::new(DeviceType::Cpu, vec![1, 2], vec![0, 1]).unwrap();
            let l = linear(parallel, Some(&p));
            let lora = l.lora.as_ref().unwrap();
            // The adapter follows its layer's split.
            let (a_nd, b_nd) = (
                format!("{:?}", lora.a.value().nd_sbp().unwrap()),
                format!("{:?}", lora.b.value().nd_sbp().unwrap()),
            );
            (run_layer(&l, Some(&p)), a_nd, b_nd)
        });
        for (rank, ((y, da, db), a_nd, b_nd)) in got.into_iter().enumerate() {
            eprintln!("{parallel:?} rank {rank}: A {a_nd} B {b_nd}");
            let split = match parallel {
                Parallel::Column(_) => &b_nd,
                _ => &a_nd,
            };
            assert!(split.contains('S'), "{parallel:?}: {a_nd} {b_nd}");
            close("y", &y, &one.0, 1e-12);
            close("dA", &da, &one.1, 1e-12);
            close("dB", &db, &one.2, 1e-12);
        }
    }
}

#[test]
fn merged_weights_give_the_adapted_models_loss() {
    for (name, targets) in [("llama", LLAMA_ALL), ("gpt2", "c_fc,c_proj")] {
        let mut m = fixture(name, &GptLayout::Local);
        m.attach_lora(&spec(3, targets)).unwrap();
        for (i, l) in m.adapted().iter().enumerate() {
            perturb(&l.lora.as_ref().unwrap().b, 100 + i as u64);
        }
        let adapted = loss_of(&m, &GptLayout::Local);
        let merged = m.merged_parameters().unwrap();
        assert_eq!(
            merged.len(),
            fixture(name, &GptLayout::Local).parameters().len()
        );
        let plain = fixture(name, &GptLayout::Local);
        for (p, q) in plain.parameters().iter().zip(&merged) {
            assert_eq!(p.name(), q.name());
            p.set_value(&q.value()).unwrap();
        }
        let reloaded = loss_of(&plain, &GptLayout::Local);
        let base = loss_of(&fixture(name, &GptLayout::Local), &GptLayout::Local);
        eprintln!("{name}: base {base} adapted {adapted} merged {reloaded}");
        assert!((adapted - reloaded).abs() <= 1e-12 * adapted.abs());
        assert!(
            (adapted - base).abs() > 1e-6,
            "{name}: the adapters changed nothing"
        );
    }
}

#[test]
fn bad_ranks_and_targets_are_named() {
    let mut m = fixture("llama", &GptLayout::Local);
    let err = |m: &mut Gpt, s: LoraSpec| m.attach_lora(&s).unwrap_err().to_string();
    let e = err(&mut m, spec(0, "q"));
    assert!(e.contains("rank 0"), "{e}");
    let e = err(&mut m, spec(10_000, "k"));
    assert!(
        e.contains("rank 10000 is above min(") && e.contains("attn.k"),
        "{e}"
    );
    let e = err(&mut m, spec(2, "q,fc"));
    assert!(
        e.contains("\"fc\"") && e.contains("q,k,v,o,gate,up,down"),
        "{e}"
    );
    let e = err(&mut m, spec(2, "q,q_proj"));
    assert!(e.contains("named twice"), "{e}");
    assert!(m.adapted().is_empty() && m.trainable_parameters().len() == m.parameters().len());
    let mut g = fixture("gpt2", &GptLayout::Local);
    let e = err(&mut g, spec(2, "c_attn"));
    assert!(e.contains("c_attn") && e.contains("c_fc,c_proj"), "{e}");
    // Attached: only the adapters train.
    m.attach_lora(&spec(2, "q,v")).unwrap();
    let names: Vec<String> = m
        .trainable_parameters()
        .iter()
        .map(|p| p.name().to_string())
        .collect();
    assert_eq!(names.len(), 4 * m.blocks.len());
    // The count the memory estimate uses, from the sizes alone.
    let numel: usize = m
        .trainable_parameters()
        .iter()
        .map(|p| p.value().numel())
        .sum();
    assert_eq!(spec(2, "q,v").parameter_count(&m.cfg, &m.arch), numel);
    let e = err(&mut m, spec(2, "k"));
    assert!(e.contains("adapters already"), "{e}");
    assert!(
        names
            .iter()
            .all(|n| n.ends_with(".lora_A") || n.ends_with(".lora_B")),
        "{names:?}"
    );
}
