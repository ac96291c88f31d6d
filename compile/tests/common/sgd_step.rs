//! The training step the compile suites and examples capture: a GPT's loss, its backward pass
//! and an SGD update with momentum, its outputs the loss, the parameters and (optionally) their
//! momentum buffers, in that order.

use oxiflow_models::nn::gpt::{Gpt, Pass};
use oxiflow_models::nn::Parameter;
use oxiflow_models::optim::{Optimizer, Sgd, SgdOptions};
use oxiflow_tensor::Tensor;

/// SGD over `params` with momentum 0.9, learning rate `lr` and weight decay `weight_decay`.
pub fn momentum_sgd(params: Vec<Parameter>, lr: f64, weight_decay: f64) -> Sgd {
    Sgd::new(
        params,
        SgdOptions {
            lr,
            momentum: 0.9,
            weight_decay,
            ..SgdOptions::default()
        },
    )
}

/// One step of `model` on `ids` against `targets`, updated by `opt`: the detached loss, then
/// the values of `params` (the optimizer's parameters, in order), then with `momentum` each
/// parameter's momentum buffer where it has one.
pub fn sgd_step(
    model: &Gpt,
    opt: &mut Sgd,
    params: &[Parameter],
    ids: &Tensor,
    targets: &Tensor,
    momentum: bool,
) -> oxiflow_compile::Result<Vec<Tensor>> {
    let loss = model.loss(ids, targets, Pass::Train { step: 0 })?;
    loss.backward()?;
    opt.step()?;
    let mut out = vec![loss.detach()];
    out.extend(params.iter().map(Parameter::value));
    if momentum {
        out.extend((0..params.len()).filter_map(|i| opt.state(i, "momentum_buffer")));
    }
    Ok(out)
}
