//! The vocabulary-parallel cross-entropy's memory: on class-split, padded logits the loss and
//! its backward allocate one tensor of the logits' size (their gradient) beyond per-row values:
//! no masked copy, no temporaries of the shard's size (host bytes through
//! `CountingAllocator`, both ranks of one process counted; a single test in this binary, so
//! nothing else allocates meanwhile).

use std::sync::Mutex;
use std::time::Duration;

use oxiflow_ops::classifier::classifier_loss_padded;
use oxiflow_tensor::memory::{self, CountingAllocator};
use oxiflow_tensor::{run_ranks, Context, DType, NdSbp, Placement, Sbp, Tensor};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Host bytes the padded loss of `dtype` logits `[rows, width]` (split on the classes over 2
/// ranks) and its backward allocate beyond what was live before, both ranks together.
fn extra_bytes(rows: usize, width: usize, classes: usize, dtype: DType, classifier: bool) -> usize {
    let p = Placement::new_1d(oxiflow_tensor::DeviceType::Cpu, vec![0, 1]).unwrap();
    let base = Mutex::new(0usize);
    let peak = Mutex::new(0usize);
    run_ranks(2, Duration::from_secs(60), |rank| {
        let b = NdSbp::broadcast(1);
        let x = Tensor::randn_global([rows, width], 1, dtype, &p, NdSbp::new([Sbp::S(1)]))
            .unwrap()
            .requires_grad_(true);
        let ids: Vec<i64> = (0..rows as i64).map(|i| (i * 7) % classes as i64).collect();
        let t = Tensor::from_vec(ids, [rows])
            .unwrap()
            .to_global(&p, b)
            .unwrap();
        let world = Context::current().unwrap().world().clone();
        world.barrier().unwrap();
        if rank == 0 {
            memory::reset_peaks();
            *base.lock().unwrap() = memory::host().unwrap().live;
        }
        world.barrier().unwrap();
        let loss = if classifier {
            classifier_loss_padded(&x, &t, classes).unwrap()
        } else {
            x.cross_entropy_padded(&t, classes).unwrap()
        };
        loss.mean_all().unwrap().backward().unwrap();
        assert!(x.grad().is_some());
        world.barrier().unwrap();
        if rank == 0 {
            *peak.lock().unwrap() = memory::host().unwrap().peak;
        }
        world.barrier().unwrap();
    });
    let (base, peak) = (base.into_inner().unwrap(), peak.into_inner().unwrap());
    peak.saturating_sub(base)
}

#[test]
fn class_split_padded_loss_allocates_only_the_logits_gradient() {
    // 2 x 2048 columns, the last 96 padding: a shard of 2 MiB (f32) per rank.
    let (rows, width, classes) = (256, 4096, 4000);
    for dtype in [DType::F32, DType::F64] {
        let logits = rows * width * dtype.size();
        for classifier in [true, false] {
            let extra = extra_bytes(rows, width, classes, dtype, classifier);
            // The gradient (one logits' worth over both ranks) plus per-row values and
            // boxing buffers; each shard-sized temporary or copy would add half a logits.
            assert!(
                extra < logits + logits / 4,
                "{dtype} (classifier {classifier}): the loss and backward allocated {extra} bytes \
                 beyond the {logits} bytes of logits (at most their gradient expected)"
            );
        }
    }
}
