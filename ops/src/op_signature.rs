//! The name and input count of an op's `ExternOp` impl, written as one line per op.

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

pub(crate) use op_signature;
