//! What the GPT's attention keeps for its backward pass, by the host allocator's count: the
//! fused op's node holds q, k, v, O and the log-sum-exp, never the `[B, H, T, T]`
//! probabilities, and the whole forward + backward never allocates them; the composed
//! attention, measured the same way, does (so the measure can see them). Grouped-query
//! attention keeps its key/value heads as they are: not the copies repeated to the query heads,
//! which repeating before a multi-head attention keeps (so the measure sees those too).

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_models::nn::gpt::{
    causal_attention, repeat_heads, Arch, CausalSelfAttention, GptConfig, GptLayout,
};
use oxiflow_models::nn::Module;
use oxiflow_tensor::memory::{self, CountingAllocator};
use oxiflow_tensor::Tensor;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The count is the process's: one test at a time.
static ONE_TEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_TEST.lock().unwrap_or_else(|e| e.into_inner())
}

const B: usize = 2;
const T: usize = 384;
const H: usize = 4;
const C: usize = 32;

/// Bytes kept after the forward pass (its result alive) and the peak over forward + backward,
/// both above what lived before, for the attention `attend` computes.
fn measure(attend: impl Fn(&Tensor) -> Tensor) -> (usize, usize) {
    let x = Tensor::randn([B, T, C], 7, DType::F64).requires_grad_(true);
    let before = memory::host().expect("the counting allocator is installed");
    memory::reset_peaks();
    let y = attend(&x);
    let kept = memory::host().unwrap().live.saturating_sub(before.live);
    y.sum_all().unwrap().backward().unwrap();
    drop(y);
    let peak = memory::host().unwrap().peak.saturating_sub(before.live);
    (kept, peak)
}

/// One layer of H heads over width C, f64.
fn config() -> GptConfig {
    GptConfig {
        vocab: 16,
        seq_len: T,
        layers: 1,
        heads: H,
        width: C,
        seed: 5,
        dtype: DType::F64,
        ..GptConfig::default()
    }
}

#[test]
fn the_attention_keeps_q_k_v_o_and_the_log_sum_exp_only() {
    let _alone = alone();
    let cfg = config();
    let attn = CausalSelfAttention::new("attn", &cfg, &GptLayout::Local).unwrap();
    let probs = B * H * T * T * 8;
    let activation = B * T * C * 8;
    let (kept, peak) = measure(|x| attn.attend(x).unwrap());
    println!("fused: kept {kept} B, peak {peak} B; probabilities {probs} B, an activation {activation} B");
    // q, k, v, O (and the merged view of O), the input the projections keep, the lse, and
    // allocator slack: about 5 activations, against probabilities of 24 activations.
    assert!(
        kept < 8 * activation && kept < probs / 3,
        "kept {kept} bytes after the forward (probabilities: {probs}, an activation: {activation})"
    );
    assert!(
        peak < probs / 2,
        "peak {peak} bytes over forward + backward (probabilities: {probs})"
    );
    let projections = [&attn.q, &attn.k, &attn.v];
    assert!(projections
        .iter()
        .flat_map(|l| l.parameters())
        .all(|p| p.grad().is_some()));

    // The composed attention keeps its probabilities: the same measure sees them.
    let heads = |y: Tensor| {
        y.reshape([B, T, H, C / H])
            .unwrap()
            .permute(&[0, 2, 1, 3])
            .unwrap()
    };
    let (kept, _) = measure(|x| {
        let (q, k, v) = (
            heads(attn.q.forward(x).unwrap()),
            heads(attn.k.forward(x).unwrap()),
            heads(attn.v.forward(x).unwrap()),
        );
        let scale = 1.0 / ((C / H) as f64).sqrt();
        q.attention_probs(&k, true, scale).unwrap().bmm(&v).unwrap()
    });
    assert!(
        kept >= probs,
        "the composed attention kept {kept} bytes (probabilities: {probs})"
    );
}

#[test]
fn grouped_query_attention_keeps_its_key_value_heads_unrepeated() {
    let _alone = alone();
    // H = 4 query heads over one key/value head: repeated copies of k and v are an activation
    // each, the heads themselves a quarter of one each (1.5 activations apart).
    let cfg = config();
    let arch = Arch {
        kv_heads: Some(1),
        ..Arch::gpt2()
    };
    let attn = CausalSelfAttention::with_arch("attn", &cfg, &arch, &GptLayout::Local).unwrap();
    let activation = B * T * C * 8;
    let grouped = |x: &Tensor| attn.attend(x).unwrap();
    let repeated = |x: &Tensor| {
        let (q, k, v) = attn.project(x, 0).unwrap();
        let (k, v) = (
            repeat_heads(&k, H, &q).unwrap(),
            repeat_heads(&v, H, &q).unwrap(),
        );
        causal_attention(&q, &k, &v, MatmulPrecision::F32)
            .unwrap()
            .reshape([B, T, C])
            .unwrap()
    };
    // Once each first: what a first call caches for later ones (dispatch plans, tables) is
    // not what the attention keeps.
    measure(grouped);
    measure(repeated);
    let (grouped, _) = measure(grouped);
    let (repeated, _) = measure(repeated);
    println!("grouped: kept {grouped} B; repeated first: kept {repeated} B; an activation {activation} B");
    assert!(
        repeated >= grouped + activation,
        "grouped heads kept {grouped} bytes, repeated ones {repeated} (an activation: {activation})"
    );
}
