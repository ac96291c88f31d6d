//! What training state occupies on this rank: the bytes of its pieces of the parameters (their
//! leaves and the compute copies kept with them), their gradients and the optimizer state
//! (partial-sum pieces count whole, shards count their share), for the memory table `train`
//! prints beside the allocators' peaks.

use oxiflow_tensor::Tensor;

use crate::nn::Parameter;
use crate::optim::Optimizer;

/// Bytes of this rank's pieces of the training state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    pub parameters: usize,
    pub gradients: usize,
    pub optimizer_state: usize,
}

impl Footprint {
    /// The footprint of `params` (and their gradients now) and `optimizer`'s state.
    pub fn measure(params: &[Parameter], optimizer: &dyn Optimizer) -> Footprint {
        let parameters = params
            .iter()
            .map(|p| {
                let copies = [p.compute_copy(), p.gathered_copy()];
                piece_bytes(&p.value()) + copies.iter().flatten().map(piece_bytes).sum::<usize>()
            })
            .sum();
        let gradients = params
            .iter()
            .filter_map(Parameter::grad)
            .map(|g| piece_bytes(&g))
            .sum();
        let optimizer_state = (0..optimizer.params().len())
            .flat_map(|i| optimizer.slot_names().iter().map(move |s| (i, *s)))
            .filter_map(|(i, s)| optimizer.state(i, s))
            .map(|t| piece_bytes(&t))
            .sum();
        Footprint {
            parameters,
            gradients,
            optimizer_state,
        }
    }
    pub fn total(&self) -> usize {
        self.parameters + self.gradients + self.optimizer_state
    }
}

/// Bytes of this rank's piece of `t` (0 outside its placement).
pub fn piece_bytes(t: &Tensor) -> usize {
    if t.is_global() && t.storage().is_none() {
        return 0;
    }
    t.local_shape().numel().saturating_mul(t.dtype().size())
}
