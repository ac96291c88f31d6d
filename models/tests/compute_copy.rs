//! The bf16 compute copies AdamW writes with each update (mixed precision: f32 leaves, bf16
//! layers) against the cast path: a GPT trained with the copies gives bit for bit the losses
//! and parameters of the same GPT whose copies are dropped after every step (so every forward
//! pass casts its leaves), one rank and in-process meshes (DP2, TP2, DP2xTP2, ZeRO-1, 2 and
//! 3). A copy is there exactly where the update ran in the leaf's layout (everywhere: ZeRO-1
//! and 2 keep master shards whose copies are gathered), equals the leaf's cast, and a leaf
//! replaced by `set_value` is never computed with its old copy (nor with its old gathered
//! copy).

mod common;

use common::{bits, on_mesh, step_batch, tiny_gpt, window_tokens};
use oxiflow_dtype::{DType, MixedPrecision};
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, Pass};
use oxiflow_models::nn::Module;
use oxiflow_models::optim::{AdamW, AdamWOptions, Optimizer, Zero};
use oxiflow_tensor::{no_grad, Tensor};

const STEPS: u64 = 3;

/// The pattern of the token ids the steps train on ([`window_tokens`]).
const TOKENS: (u64, u64, u64) = (5, 11, 3);

/// Losses and final parameters (as bits) of `STEPS` steps on `mesh` (None: local) with ZeRO
/// `stage` gathering updated shards in buckets of `gather` bytes (0: each alone); `cast_path`
/// drops every copy after each step. Also checks the copies after each step: present, equal
/// to the leaf's cast.
fn train(
    mesh: Option<[usize; 2]>,
    (stage, gather): (u8, usize),
    cast_path: bool,
) -> (Vec<u64>, Vec<Vec<u64>>) {
    on_mesh(mesh, |placement| {
        let (model, cfg) = tiny_gpt(&placement, DType::F32, 7);
        let mut opt = AdamW::new(model.parameters(), AdamWOptions::default())
            .with_zero(if stage == 0 {
                Zero::OFF
            } else {
                Zero::new(stage, 0).unwrap().with_gather_bytes(gather)
            })
            .unwrap();
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (x, y) = step_batch(&cfg, s, TOKENS, &placement);
            opt.zero_grad();
            let loss = model.loss(&x, &y, Pass::Train { step: s }).unwrap();
            loss.backward().unwrap();
            opt.step_with_norm(Some(1.0)).unwrap();
            losses.extend(bits(&loss));
            for p in model.parameters() {
                let c = p.compute_copy();
                let c = c.unwrap_or_else(|| panic!("{} has no copy after step {s}", p.name()));
                {
                    let _ng = no_grad();
                    let cast = p.value().to_dtype(DType::BF16).unwrap();
                    assert_eq!(bits(&c), bits(&cast), "{}'s copy vs its cast", p.name());
                }
                if cast_path {
                    p.set_value(&p.value()).unwrap();
                    assert!(p.compute_copy().is_none(), "set_value keeps a stale copy");
                    assert!(p.gathered_copy().is_none(), "or a stale gathered copy");
                }
            }
        }
        let params = model
            .parameters()
            .iter()
            .map(|p| bits(&p.value()))
            .collect();
        (losses, params)
    })
}

#[test]
fn the_copies_give_the_cast_paths_bits_in_every_layout() {
    for (mesh, stage) in [
        (None, (0, 0)),
        (Some([1, 1]), (0, 0)),
        (Some([2, 1]), (0, 0)),
        (Some([1, 2]), (0, 0)),
        (Some([2, 2]), (0, 0)),
        (Some([2, 1]), (1, 0)),
        (Some([2, 1]), (2, 0)),
        (Some([2, 1]), (2, 4096)),
        (Some([2, 2]), (2, 0)),
        (Some([2, 2]), (1, 1 << 20)),
        (Some([2, 1]), (3, 0)),
        (Some([2, 2]), (3, 0)),
    ] {
        let with = train(mesh, stage, false);
        let without = train(mesh, stage, true);
        assert_eq!(with.0, without.0, "{mesh:?} ZeRO {stage:?}: losses");
        assert_eq!(with.1, without.1, "{mesh:?} ZeRO {stage:?}: parameters");
        let first = f64::from_bits(with.0[0]);
        assert!(first.is_finite(), "{mesh:?}: {first}");
    }
}

/// A leaf replaced by `set_value` (a checkpoint load, a user) is computed with its own cast,
/// never with the copy of the leaf before it.
#[test]
fn a_replaced_leaf_is_never_computed_with_a_stale_copy() {
    let cfg = GptConfig {
        vocab: 16,
        seq_len: 4,
        layers: 1,
        heads: 2,
        width: 8,
        dropout: 0.0,
        seed: 2,
        dtype: DType::F32,
        ..GptConfig::default()
    };
    let model = Gpt::new(&cfg, &GptLayout::Local).unwrap();
    model
        .set_precision(&MixedPrecision::bf16_mixed(DType::F32).unwrap())
        .unwrap();
    let mut opt = AdamW::new(model.parameters(), AdamWOptions::default());
    let ids = Tensor::from_vec(window_tokens(2, 4, 16, 0, TOKENS), [2, 5]).unwrap();
    let (x, y) = (ids.narrow(1, 0, 4).unwrap(), ids.narrow(1, 1, 4).unwrap());
    model
        .loss(&x, &y, Pass::Train { step: 0 })
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    let p = model.parameters()[0].clone();
    let c = p.compute_copy().expect("AdamW wrote a copy");
    let computed = p.compute().unwrap();
    assert_eq!(computed.grad_fn_name().as_deref(), Some("cast"));
    assert_eq!(bits(&computed), bits(&c));
    let other = p.value().mul_scalar(2.0).unwrap().add_scalar(1.0).unwrap();
    p.set_value(&other).unwrap();
    assert!(p.compute_copy().is_none());
    let computed = p.compute().unwrap();
    assert_eq!(bits(&computed), bits(&other.to_dtype(DType::BF16).unwrap()));
    // A copy that does not fit the value is refused.
    let bad = Tensor::zeros([1], DType::BF16);
    let e = p
        .set_value_with_copy(&other, Some(&bad))
        .unwrap_err()
        .to_string();
    assert!(e.contains("set_value_with_copy"), "{e}");
}
