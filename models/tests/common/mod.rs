//! Helpers shared by the model suites: for those that train the small GPT on every layout, the
//! mesh's in-process world, the model, a batch of token windows and a tensor's bits; for the
//! decoding suites, the Hugging Face fixtures of `tests/fixtures/hf` loaded in f64.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use oxiflow_dtype::{DType, MixedPrecision};
use oxiflow_models::hf::HfCheckpoint;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, StageSplit};
use oxiflow_models::nn::Module;
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{run_ranks, Tensor};

/// Runs `f` with the CPU placement of `mesh` ([dp, tp]; None: local) on every rank of an
/// in-process world (120 s timeout); rank 0's result.
pub fn on_mesh<T: Send>(mesh: Option<[usize; 2]>, f: impl Fn(Option<Placement>) -> T + Sync) -> T {
    let n = mesh.map_or(1, |m| m[0] * m[1]);
    let placement = || {
        mesh.map(|m| {
            Placement::range(DeviceType::Cpu, n)
                .and_then(|p| p.reshaped(m))
                .unwrap()
        })
    };
    let out = run_ranks(n, Duration::from_secs(120), |_| f(placement()));
    out.into_iter().next().unwrap()
}

/// The test GPT (vocabulary 24, 8 positions, 2 layers of width 8, 2 heads) from `seed` on
/// `placement` (None: local): f32 leaves computing in bf16, or `dtype` throughout.
pub fn tiny_gpt(placement: &Option<Placement>, dtype: DType, seed: u64) -> (Gpt, GptConfig) {
    let cfg = GptConfig {
        vocab: 24,
        seq_len: 8,
        layers: 2,
        heads: 2,
        width: 8,
        dropout: 0.0,
        seed,
        dtype,
        ..GptConfig::default()
    };
    let layout = match placement {
        Some(p) => GptLayout::Mesh(NamedMesh::of(p.clone(), &[DP, TP]).unwrap()),
        None => GptLayout::Local,
    };
    let model = Gpt::new(&cfg, &layout).unwrap();
    if dtype == DType::F32 {
        model
            .set_precision(&MixedPrecision::bf16_mixed(DType::F32).unwrap())
            .unwrap();
    }
    (model, cfg)
}

/// The ids of `b` windows of `t` + 1 tokens below `vocab` at step `step`: token `i` is
/// `(i * mul + step * step_mul + i / div) % vocab`, `(mul, step_mul, div)` a suite's pattern.
pub fn window_tokens(
    b: usize,
    t: usize,
    vocab: usize,
    step: u64,
    (mul, step_mul, div): (u64, u64, u64),
) -> Vec<i64> {
    (0..b * (t + 1))
        .map(|i| ((i as u64 * mul + step * step_mul + i as u64 / div) % vocab as u64) as i64)
        .collect()
}

/// The inputs and targets of step `step` of the GPT `cfg`: 4 windows of its length, their
/// tokens by `pattern` ([`window_tokens`]), split over the data axis of `placement`.
pub fn step_batch(
    cfg: &GptConfig,
    step: u64,
    pattern: (u64, u64, u64),
    placement: &Option<Placement>,
) -> (Tensor, Tensor) {
    let (b, t) = (4, cfg.seq_len);
    batch(
        window_tokens(b, t, cfg.vocab, step, pattern),
        b,
        t,
        placement,
    )
}

/// The inputs and targets of `b` windows of `t` + 1 tokens `ids`, split over the data axis
/// of `placement`.
pub fn batch(ids: Vec<i64>, b: usize, t: usize, placement: &Option<Placement>) -> (Tensor, Tensor) {
    let ids = Tensor::from_vec(ids, [b, t + 1]).unwrap();
    let ids = match placement {
        Some(p) => ids.to_global(p, NdSbp::new([Sbp::S(0), Sbp::B])).unwrap(),
        None => ids,
    };
    (ids.narrow(1, 0, t).unwrap(), ids.narrow(1, 1, t).unwrap())
}

/// The bits of `t`'s values, gathered and as f64 (every NaN as one NaN).
pub fn bits(t: &Tensor) -> Vec<u64> {
    let t = match t.placement() {
        Some(p) => t.to_global(p, NdSbp::broadcast(p.ndim())).unwrap(),
        None => t.clone(),
    };
    t.cast(DType::F64)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
        .iter()
        .map(|v| if v.is_nan() { f64::NAN } else { *v }.to_bits())
        .collect()
}

/// The Hugging Face fixtures' folder.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf")
}

/// The fixture `name` in f64 on `layout` (one stage), its weights loaded.
pub fn model(name: &str, layout: &GptLayout) -> Gpt {
    let ck = HfCheckpoint::open(&fixtures().join(name)).unwrap();
    let base = GptConfig {
        dtype: DType::F64,
        vocab_multiple: 64,
        ..GptConfig::default()
    };
    let split = StageSplit::single(2, layout);
    let m = Gpt::with_arch(&ck.config.gpt_config(&base), &ck.config.arch, split).unwrap();
    ck.load_into(&m.parameters()).unwrap();
    m
}
