//! oflaunch entry point.
fn main() {}
