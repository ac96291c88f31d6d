//! Replay from the planned arena, measured by the counting allocator: a small GPT's forward and
//! backward step compiled once and replayed runs in one arena per program, allocated by the
//! first replay and reused by every later one (the same address, no other arena); the host
//! memory the replays keep is the planned arena's bytes; a replay allocates none of its
//! planned values (its peak above what was live stays below the planned values' own peak);
//! and every replay's loss and gradients are bit-identical to the eager step's; on the host
//! every replay runs launch by launch (no device graph) and says nothing about it.

mod common;

use common::{bits, small_gpt};
use oxiflow_compile::{CompiledStep, StepRun};
use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::{Gpt, GptLayout, Pass};
use oxiflow_models::nn::{Module, Parameter};
use oxiflow_tensor::arena::arenas_allocated;
use oxiflow_tensor::memory::{self, CountingAllocator};
use oxiflow_tensor::Tensor;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const BATCH: usize = 8;
const SEQ: usize = 32;

fn batch(step: usize) -> (Tensor, Tensor) {
    let tok = |i: usize| ((i * 7 + step * 5 + i / 3) % 32) as i64;
    let ids: Vec<i64> = (0..BATCH * SEQ).map(tok).collect();
    let targets: Vec<i64> = (0..BATCH * SEQ).map(|i| tok(i + 1)).collect();
    (
        Tensor::from_vec(ids, [BATCH, SEQ]).unwrap(),
        Tensor::from_vec(targets, [BATCH, SEQ]).unwrap(),
    )
}

fn host_live() -> usize {
    memory::host()
        .expect("the counting allocator is installed")
        .live
}

#[test]
fn replays_reuse_one_arena_of_the_planned_bytes_with_eager_bits() {
    let config = small_gpt(SEQ, DType::F64, false);
    let model = Gpt::new(&config, &GptLayout::Local).unwrap();
    let params: Vec<Parameter> = model.parameters();
    let step = |ids: &Tensor, targets: &Tensor| -> oxiflow_compile::Result<Vec<Tensor>> {
        let loss = model.loss(ids, targets, Pass::Train { step: 0 })?;
        loss.backward()?;
        let mut out = vec![loss.detach()];
        out.extend(params.iter().map(|p| p.grad().unwrap()));
        Ok(out)
    };
    let zero_grads = || params.iter().for_each(Parameter::zero_grad);
    let inputs_of = |ids: &Tensor, targets: &Tensor| {
        let mut inputs = vec![ids.clone(), targets.clone()];
        inputs.extend(params.iter().map(Parameter::value));
        inputs
    };

    let mut compiled = CompiledStep::new();
    let (ids, targets) = batch(0);
    zero_grads();
    let (_, run) = compiled
        .run(&inputs_of(&ids, &targets), || step(&ids, &targets))
        .unwrap();
    let StepRun::Compiled(c) = run else {
        panic!("the first call compiles")
    };
    let plan_bytes = c.arena.bytes;
    let planned_peak = c.live.peak_live_bytes;
    assert!(plan_bytes >= planned_peak && planned_peak > 0);
    assert!(
        c.arena_in_use().is_none(),
        "no arena before the first replay"
    );
    let arenas_before = arenas_allocated();

    let mut address = None;
    for s in 1..6 {
        let (ids, targets) = batch(s);
        zero_grads();
        let eager = step(&ids, &targets).unwrap();
        let eager_bits: Vec<Vec<u64>> = eager.iter().map(bits).collect();
        drop(eager);
        zero_grads();
        let before = host_live();
        memory::reset_peaks();
        let (outs, run) = compiled
            .run(&inputs_of(&ids, &targets), || step(&ids, &targets))
            .unwrap();
        let peak_above = memory::host().unwrap().peak - before;
        assert!(matches!(run, StepRun::Replayed), "step {s} replays");
        let output_bytes: usize = outs.iter().map(|t| t.shape().numel() * 8).sum();
        let got: Vec<Vec<u64>> = outs.iter().map(bits).collect();
        assert_eq!(got, eager_bits, "step {s}: the replay's bits are eager's");
        drop((outs, got));
        let kept = host_live() as isize - before as isize;
        let (bytes, at) = c.arena_in_use().expect("the replay's arena");
        assert_eq!(bytes, plan_bytes);
        eprintln!(
            "step {s}: kept {kept} B, replay peak above live {peak_above} B (outputs \
             {output_bytes} B; arena {plan_bytes} B, planned values' peak {planned_peak} B)"
        );
        if s == 1 {
            // The first replay allocates the arena, which stays: the planned bytes (and
            // the arena's own handle).
            assert!(
                kept >= plan_bytes as isize && kept <= plan_bytes as isize + 256,
                "kept {kept} for an arena of {plan_bytes}"
            );
            address = Some(at);
        } else {
            assert_eq!(Some(at), address, "step {s}: the same arena");
            assert!(kept.abs() <= 256, "step {s} kept {kept} bytes");
            // No planned value is allocated: what a replay allocates is its copied-out
            // outputs and kernel scratch, below the planned values' own peak.
            assert!(
                peak_above < planned_peak,
                "step {s}: {peak_above} bytes allocated at the peak, planned values need \
                 {planned_peak}"
            );
        }
    }
    assert_eq!(
        arenas_allocated(),
        arenas_before + 1,
        "one arena for all replays"
    );
    // The host has no device graphs: every replay ran launch by launch, and nothing is said.
    let counts = c.replay_counts();
    assert_eq!((counts.graph, counts.launches), (0, 5), "{counts:?}");
    assert!(!c.replays_as_graph());
    assert_eq!(c.graph_built_in(), None, "no device graph was built");
    assert_eq!(compiled.take_notes(), Vec::<String>::new());
}
