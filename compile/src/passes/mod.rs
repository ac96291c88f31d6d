//! The passes over a captured program, each in its file: dead-code elimination, element-wise
//! fusion into generated kernels, liveness in the captured order, and memory planning into one
//! arena per rank.

pub mod arena;
pub mod dce;
pub mod fusion;
pub mod liveness;
