//! The matmul precision in the compiled step's cache: a step captured with its products at one
//! precision carries it in every product op it recorded, forward and backward, and is replayed
//! only for calls at that precision; a call at another compiles a program of its own (naming
//! the change), and each is replayed afterwards. On the CPU the precisions give equal bits.

use oxiflow_compile::ir::NodeKind;
use oxiflow_compile::{CompiledStep, StepRun};
use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_ops::linear::linear_at;
use oxiflow_ops::linear::Activation;
use oxiflow_tensor::{Op, Tensor};

type R<T> = oxiflow_compile::Result<T>;

/// The loss of a linear layer, a product and a transposed product at `mp`, and the gradients.
fn step(x: &Tensor, w: &Tensor, b: &Tensor, mp: MatmulPrecision) -> R<Vec<Tensor>> {
    let (w, b) = (
        w.detach().requires_grad_(true),
        b.detach().requires_grad_(true),
    );
    let h = linear_at(x, &w, Some(&b), Activation::Gelu, mp)?;
    let y = h.matmul_t_at(&w, (false, true), mp)?.matmul_at(&w, mp)?;
    let loss = y.square()?.sum_all()?;
    loss.backward()?;
    let grads = [&w, &b].map(|t| t.grad().map(|g| g.detach()));
    let mut out = vec![loss.detach()];
    out.extend(grads.into_iter().flatten());
    Ok(out)
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u32>> {
    ts.iter()
        .map(|t| {
            let v = t.to_vec::<f32>().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

/// The precisions of the recorded ops that run products: the matmul family's, and every
/// other op carrying one (a linear layer, the fused MLP, attention, the fused classifier).
fn product_precisions(run: &StepRun) -> Vec<String> {
    let StepRun::Compiled(c) = run else {
        panic!("expected a compile, got a replay")
    };
    c.program
        .nodes
        .iter()
        .filter_map(|n| match &n.kind {
            NodeKind::Op(o) => match &o.op {
                Op::Matmul(m) => Some(m.precision.to_string()),
                op => {
                    let text = format!("{op:?}");
                    MatmulPrecision::ALL
                        .into_iter()
                        .find(|p| text.contains(&format!("precision: {p:?}")))
                        .map(|p| p.to_string())
                }
            },
            _ => None,
        })
        .collect()
}

#[test]
fn a_changed_matmul_precision_is_another_program() {
    let x = Tensor::randn([6, 5], 1, DType::F32);
    let w = Tensor::randn([5, 5], 2, DType::F32)
        .mul_scalar(0.4)
        .unwrap();
    let b = Tensor::randn([5], 3, DType::F32);
    let inputs = [x.clone(), w.clone(), b.clone()];
    let mut compiled = CompiledStep::new();
    let at = |compiled: &mut CompiledStep, mp| {
        compiled
            .run_at(&inputs, mp, || step(&x, &w, &b, mp))
            .unwrap()
    };

    let (tf32_out, run) = at(&mut compiled, MatmulPrecision::Tf32);
    let recorded = product_precisions(&run);
    // linear, 2 products forward; their backward: 2 products each, the linear's dx and dw.
    assert!(recorded.len() >= 6, "{recorded:?}");
    assert!(recorded.iter().all(|p| p == "tf32"), "{recorded:?}");

    let (f32_out, run) = at(&mut compiled, MatmulPrecision::F32);
    let recorded = product_precisions(&run);
    assert!(recorded.iter().all(|p| p == "f32"), "{recorded:?}");
    assert_eq!(compiled.programs().len(), 2, "one program per precision");
    assert_eq!(
        bits(&tf32_out),
        bits(&f32_out),
        "tf32 changes nothing on the CPU"
    );

    for mp in [MatmulPrecision::Tf32, MatmulPrecision::F32] {
        let (out, run) = at(&mut compiled, mp);
        assert!(matches!(run, StepRun::Replayed), "{mp}: replayed");
        assert_eq!(bits(&out), bits(&f32_out), "{mp}: the replay's bits");
    }
    assert_eq!(compiled.programs().len(), 2);
}

#[test]
fn the_key_names_a_changed_precision() {
    let x = Tensor::randn([2, 3], 1, DType::F32);
    let key = |mp| oxiflow_compile::StepKey::of(std::slice::from_ref(&x), mp);
    let (f32_key, tf32_key) = (key(MatmulPrecision::F32), key(MatmulPrecision::Tf32));
    assert_ne!(f32_key, tf32_key);
    let why = tf32_key.changes_from(&f32_key);
    assert!(
        why.contains("matmul precision tf32 instead of f32"),
        "{why}"
    );
}

/// A GPT given a TF32 policy (`Module::set_precision`) builds every op that runs products (the
/// attention, the linear layers, the fused MLP, the head's classifier, and their backward) at
/// TF32, as the compiled program records them; at the default policy they are f32.
#[test]
fn a_model_builds_its_products_at_its_policy() {
    use oxiflow_dtype::MixedPrecision;
    use oxiflow_models::nn::gpt::{Gpt, GptConfig, GptLayout, Pass};
    use oxiflow_models::nn::{Module, Parameter};

    let config = GptConfig {
        vocab: 16,
        seq_len: 8,
        layers: 1,
        heads: 2,
        width: 8,
        dropout: 0.0,
        seed: 7,
        dtype: DType::F32,
        sequence_parallel: false,
        vocab_multiple: 1,
        ..GptConfig::default()
    };
    let ids: Vec<i64> = (0..16).map(|i| (i * 5 % 16) as i64).collect();
    let targets: Vec<i64> = (0..16).map(|i| (i * 3 % 16) as i64).collect();
    let (ids, targets) = (
        Tensor::from_vec(ids, [2, 8]).unwrap(),
        Tensor::from_vec(targets, [2, 8]).unwrap(),
    );
    for mp in [MatmulPrecision::Tf32, MatmulPrecision::F32] {
        let model = Gpt::new(&config, &GptLayout::Local).unwrap();
        let policy = MixedPrecision::full(DType::F32)
            .and_then(|p| p.with_matmul(mp))
            .unwrap();
        model.set_precision(&policy).unwrap();
        assert_eq!(model.matmul_precision(), mp);
        let params: Vec<Parameter> = model.parameters();
        let mut inputs = vec![ids.clone(), targets.clone()];
        inputs.extend(params.iter().map(Parameter::value));
        let mut compiled = CompiledStep::new();
        let (_, run) = compiled
            .run_at(&inputs, mp, || -> R<Vec<Tensor>> {
                let loss = model.loss(&ids, &targets, Pass::Train { step: 0 })?;
                loss.backward()?;
                let mut out = vec![loss.detach()];
                out.extend(params.iter().filter_map(Parameter::grad));
                Ok(out)
            })
            .unwrap();
        let StepRun::Compiled(c) = &run else {
            panic!("the first call compiles")
        };
        let names: Vec<&str> = c
            .program
            .nodes
            .iter()
            .filter_map(|n| match &n.kind {
                NodeKind::Op(o) => Some(o.op.name()),
                _ => None,
            })
            .collect();
        let recorded = product_precisions(&run);
        assert!(recorded.len() >= 4, "{mp}: {recorded:?} among {names:?}");
        assert!(
            recorded.iter().all(|p| *p == mp.to_string()),
            "{mp}: {recorded:?}"
        );
        // The fused ops that run products are among them.
        for fused in ["flash_attention", "linear_classifier"] {
            assert!(names.contains(&fused), "{mp}: no {fused} in {names:?}");
        }
        let mlp = ["residual_mlp", "linear_gelu"];
        assert!(mlp.iter().any(|m| names.contains(m)), "{mp}: {names:?}");
    }
}
