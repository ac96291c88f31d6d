//! Host memory accounting through `CountingAllocator`: a tensor's bytes show in the live count
//! while it lives and in the peak after it is dropped; `reset_peaks` starts over at live.

use oxiflow_tensor::memory::{self, CountingAllocator};
use oxiflow_tensor::{DType, Tensor};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn tensors_show_in_live_and_peak_bytes() {
    let before = memory::host().expect("the counting allocator is installed");
    memory::reset_peaks();
    let bytes = 1 << 22;
    let t = Tensor::zeros([bytes / 8], DType::F64);
    let during = memory::host().unwrap();
    assert!(
        during.live >= before.live + bytes,
        "{before:?} -> {during:?}"
    );
    drop(t);
    let after = memory::host().unwrap();
    assert!(after.peak >= before.live + bytes, "{after:?}");
    assert!(
        after.live + bytes / 2 < during.live,
        "{during:?} -> {after:?}"
    );
    memory::reset_peaks();
    assert!(memory::host().unwrap().peak < during.live);
    assert_eq!(memory::device().live, 0, "no device blocks without CUDA");
}
