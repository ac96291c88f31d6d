//! bench placeholder
fn main() {}
