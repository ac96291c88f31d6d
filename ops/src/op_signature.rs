//! What every op's `ExternOp` impl writes alike, one line per op: its name and input count,
//! and its kernel table with which outputs carry a gradient (the first alone, or none and
//! why) or which inputs its backward reads.

/// Writes an `ExternOp` impl's `name` (the literal `$name`) and `arity` (exactly `$n` inputs,
/// or `$min..=$max`).
macro_rules! op_signature {
    ($name:literal, $n:literal) => {
        $crate::op_signature::op_signature!($name, $n..=$n);
    };
    ($name:literal, $min:literal..=$max:expr) => {
        fn name(&self) -> &'static str {
            $name
        }
        fn arity(&self) -> (usize, usize) {
            ($min, $max)
        }
    };
}

/// Writes an `ExternOp` impl's `kernels` (the table `$kernels`) and `no_gradient` (always
/// `$why`; without it, that a backward op has no gradient of its own).
macro_rules! kernels_without_gradient {
    ($kernels:expr) => {
        $crate::op_signature::kernels_without_gradient!(
            $kernels,
            "higher-order gradients are not supported"
        );
    };
    ($kernels:expr, $why:expr) => {
        fn kernels(&self) -> &oxiflow_tensor::Kernels {
            &$kernels
        }
        fn no_gradient(&self) -> Option<&'static str> {
            Some($why)
        }
    };
}

/// Writes an `ExternOp` impl's `kernels` (the table `$kernels`) and `differentiable`: the
/// first output alone carries a gradient (the others are kept for the backward).
macro_rules! kernels_first_output_differentiable {
    ($kernels:expr) => {
        fn kernels(&self) -> &oxiflow_tensor::Kernels {
            &$kernels
        }
        fn differentiable(&self, output: usize) -> bool {
            output == 0
        }
    };
}

/// Writes an `ExternOp` impl's `kernels` (the table `$kernels`) and `saves`: the inputs
/// `$inputs` alone, whichever inputs need a gradient.
macro_rules! kernels_saving_inputs {
    ($kernels:expr, [$($input:literal),+]) => {
        fn kernels(&self) -> &oxiflow_tensor::Kernels {
            &$kernels
        }
        fn saves(&self, _needs: &[bool]) -> oxiflow_tensor::Saves {
            oxiflow_tensor::Saves::inputs(&[$($input),+])
        }
    };
}

pub(crate) use {
    kernels_first_output_differentiable, kernels_saving_inputs, kernels_without_gradient,
    op_signature,
};
