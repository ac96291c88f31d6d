//! Backend-independent pieces of the collectives: argument checks and count arithmetic.

pub(crate) mod args;
