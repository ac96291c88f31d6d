//! The GPT model on local tensors: output shapes, the tied input/output embedding (one
//! parameter, reached by the output projection), causality (future tokens do not change
//! earlier logits), configuration checks and dropout; and on a mesh with an axis the model
//! has no use for (`ep`): whole along it, the loss one rank's.

use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, Pass};
use oxiflow_models::nn::Module;
use std::time::Duration;

use oxiflow_models::nn::ParamPlacement;
use oxiflow_placement::{
    AxisRole, DeviceType, MeshAxis, MeshLayout, NamedMesh, Placement, DP, EP, PP, TP,
};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{run_ranks, Tensor};

fn tiny() -> GptConfig {
    GptConfig {
        vocab: 32,
        seq_len: 8,
        layers: 2,
        heads: 2,
        width: 16,
        seed: 3,
        dtype: DType::F64,
        ..GptConfig::default()
    }
}

fn ids(v: &[i64], b: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), [b, v.len() / b]).unwrap()
}

#[test]
fn logits_have_one_row_per_token_and_the_loss_is_a_scalar() {
    let m = Gpt::new(&tiny(), &GptLayout::Local).unwrap();
    let x = ids(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2);
    let logits = m.forward(&x, Pass::Eval).unwrap();
    assert_eq!(logits.shape().dims(), &[2, 5, 32]);
    let loss = m.loss(&x, &x, Pass::Eval).unwrap();
    assert_eq!(loss.ndim(), 0);
    // Too long a sequence and float ids are refused.
    assert!(m.forward(&ids(&[0; 9], 1), Pass::Eval).is_err());
    let f = Tensor::zeros([1, 4], DType::F64);
    assert!(m.forward(&f, Pass::Eval).is_err());
}

#[test]
fn the_token_embedding_is_the_only_vocabulary_matrix_and_gets_output_gradients() {
    let cfg = tiny();
    let m = Gpt::new(&cfg, &GptLayout::Local).unwrap();
    let params = m.parameters();
    let vocab_sized: Vec<_> = params
        .iter()
        .filter(|p| p.value().shape().dims().contains(&cfg.vocab))
        .map(|p| p.name().to_string())
        .collect();
    assert_eq!(vocab_sized, ["wte.weight"]);
    assert!(m.registry().is_ok(), "parameter names are unique");
    // Inputs use ids 1..=4 only; rows of other ids get gradient only through the logits.
    let x = ids(&[1, 2, 3, 4, 1, 2, 3, 4], 2);
    m.loss(&x, &x, Pass::Train { step: 0 })
        .unwrap()
        .backward()
        .unwrap();
    let g = m.wte.weight.grad().unwrap().to_vec::<f64>().unwrap();
    let row20: f64 = g[20 * cfg.width..21 * cfg.width]
        .iter()
        .map(|v| v.abs())
        .sum();
    assert!(
        row20 > 0.0,
        "an id absent from the input gets an output gradient"
    );
}

#[test]
fn future_tokens_do_not_change_earlier_logits() {
    let m = Gpt::new(&tiny(), &GptLayout::Local).unwrap();
    let a = [5, 9, 2, 7, 1, 3, 8, 4];
    let mut b = a;
    for x in &mut b[5..] {
        *x = (*x + 11) % 32;
    }
    let la = m
        .forward(&ids(&a, 1), Pass::Eval)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    let lb = m
        .forward(&ids(&b, 1), Pass::Eval)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    let v = 32;
    assert_eq!(
        la[..5 * v],
        lb[..5 * v],
        "positions 0..5 see only tokens 0..5"
    );
    assert_ne!(
        la[5 * v..6 * v],
        lb[5 * v..6 * v],
        "position 5 sees its own token"
    );
}

#[test]
fn configurations_that_cannot_be_laid_out_are_refused() {
    let mesh = Placement::new_1d(DeviceType::Cpu, [0, 1, 2, 3])
        .unwrap()
        .reshaped([1, 4])
        .unwrap();
    let layout = GptLayout::Mesh(NamedMesh::of(mesh, &[DP, TP]).unwrap());
    let e = GptConfig { heads: 2, ..tiny() }
        .validate(&layout)
        .unwrap_err();
    assert!(e.to_string().contains("tensor-parallel degree 4"), "{e}");
    let e = GptConfig { heads: 3, ..tiny() }
        .validate(&GptLayout::Local)
        .unwrap_err();
    assert!(e.to_string().contains("not a multiple of heads 3"), "{e}");
    let sp = GptConfig {
        sequence_parallel: true,
        ..tiny()
    };
    assert!(sp.validate(&GptLayout::Local).is_err());
    assert!(GptConfig {
        layers: 0,
        ..tiny()
    }
    .validate(&GptLayout::Local)
    .is_err());
    assert!(GptConfig {
        dropout: 1.0,
        ..tiny()
    }
    .validate(&GptLayout::Local)
    .is_err());
    assert!(GptConfig { heads: 4, ..tiny() }.validate(&layout).is_ok());
}

#[test]
fn dropout_is_the_identity_at_zero_and_scales_what_it_keeps() {
    let x = Tensor::ones([64, 64], DType::F64);
    let same = x.dropout(0.0, 1).unwrap();
    assert!(same.same(&x));
    let y = x.dropout(0.25, 1).unwrap().to_vec::<f64>().unwrap();
    let kept = y.iter().filter(|&&v| v != 0.0).count();
    assert!(y
        .iter()
        .all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-12));
    assert!(
        (2800..3350).contains(&kept),
        "kept {kept} of 4096 at p 0.25"
    );
    let again = x.dropout(0.25, 1).unwrap().to_vec::<f64>().unwrap();
    assert_eq!(y, again, "the seed decides the mask");
}

#[test]
fn an_experts_axis_splits_the_batch_of_a_dense_model_and_leaves_the_loss_unchanged() {
    let layout = MeshLayout::resolve(&[(DP, None), (EP, Some(2)), (TP, Some(2))], 4).unwrap();
    let xs = [1, 5, 9, 2, 7, 3, 30, 4, 6, 8, 10, 11, 12, 13, 14, 15];
    let ys = [5, 9, 2, 7, 3, 30, 4, 0, 8, 10, 11, 12, 13, 14, 15, 31];
    let local = Gpt::new(&tiny(), &GptLayout::Local).unwrap();
    let (x, y) = (ids(&xs, 2), ids(&ys, 2));
    let want = local
        .loss(&x, &y, Pass::Eval)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()[0];
    let got = run_ranks(4, Duration::from_secs(120), |_| {
        let mesh = layout.stages(DeviceType::Cpu).unwrap().remove(0);
        let gl = GptLayout::Mesh(mesh.clone());
        assert_eq!(mesh.axis(AxisRole::Experts), Some(1));
        // The expert-parallel ranks are data-parallel ranks too: the batch splits over both.
        assert_eq!(
            gl.activation_sbp(Sbp::B),
            Some(NdSbp::new([Sbp::S(0), Sbp::S(0), Sbp::B]))
        );
        match gl.token_embedding() {
            ParamPlacement::Global { nd_sbp, .. } => {
                assert_eq!(nd_sbp, NdSbp::new([Sbp::B, Sbp::B, Sbp::S(0)]))
            }
            ParamPlacement::Local => panic!("a mesh layout gave a local parameter"),
        }
        let m = Gpt::new(&tiny(), &gl).unwrap();
        let p = mesh.placement();
        let on = |t: Tensor| t.to_global(p, NdSbp::broadcast(3)).unwrap();
        let (x, y) = (on(ids(&xs, 2)), on(ids(&ys, 2)));
        m.loss(&x, &y, Pass::Eval).unwrap().to_vec::<f64>().unwrap()[0]
    });
    for g in got {
        assert!((g - want).abs() <= 1e-9 * want.abs(), "{g} vs {want}");
    }
}

#[test]
fn meshes_the_model_cannot_use_are_refused_naming_their_axes() {
    let p = Placement::range(DeviceType::Cpu, 2).unwrap();
    let staged = NamedMesh::new(p.clone(), vec![MeshAxis::new(PP, 2)]).unwrap();
    let e = tiny().validate(&GptLayout::Mesh(staged)).unwrap_err();
    assert!(e.to_string().contains("has the pipeline axis pp"), "{e}");
    let no_heads = NamedMesh::of(p, &[DP]).unwrap();
    let sp = GptConfig {
        sequence_parallel: true,
        ..tiny()
    };
    let e = sp.validate(&GptLayout::Mesh(no_heads)).unwrap_err();
    assert!(
        e.to_string()
            .contains("sequence parallelism needs a tensor-parallel axis; the mesh cpu:[0, 1] (--dp 2) has none"),
        "{e}"
    );
}
