//! Pipeline schedules as pure action lists: every stage runs each (micro-batch, chunk)
//! forward and backward exactly once, backward after forward; 1F1B keeps at most `pp - s`
//! micro-batches in flight on stage `s`; every (pp, m, v) the checks accept runs to the end
//! with buffered sends; replayed with uniform costs, GPipe and 1F1B have the theoretical
//! bubble and interleaving lowers it; invalid combinations are typed errors; the stage split
//! is as even as possible. Every stage's host program receives each message once, in its
//! sender's order, before the action that needs it; replayed on device streams (a send blocks
//! its stream until the receive is posted), every accepted combination finishes on one-way
//! channels, while one stream per pair of stages deadlocks 1F1B and interleaving.

use oxiflow_models::nn::gpt::{GptLayout, StageSplit};
use oxiflow_models::pipeline::{Action, HostOp, Message, PipelineSpec, Schedule, Transport};
use oxiflow_placement::{DeviceType, NamedMesh, Placement, DP, TP};

fn spec(schedule: Schedule, pp: usize, m: usize, v: usize) -> PipelineSpec {
    PipelineSpec {
        schedule,
        stages: pp,
        micro_batches: m,
        virtual_stages: v,
    }
}

/// Every action once, each backward after its forward.
fn check_list(s: &PipelineSpec, stage: usize) {
    let list = s.actions(stage);
    assert_eq!(list.len(), 2 * s.micro_batches * s.virtual_stages, "{s:?}");
    for mb in 0..s.micro_batches {
        for chunk in 0..s.virtual_stages {
            let f = list
                .iter()
                .position(|a| *a == Action::Forward { mb, chunk })
                .unwrap_or_else(|| panic!("{s:?} stage {stage}: no forward {mb} {chunk}"));
            let b = list
                .iter()
                .position(|a| *a == Action::Backward { mb, chunk })
                .unwrap_or_else(|| panic!("{s:?} stage {stage}: no backward {mb} {chunk}"));
            assert!(f < b, "{s:?} stage {stage}: backward before forward");
        }
    }
}

/// Most forwards without their backward at any point of the list.
fn in_flight(list: &[Action]) -> usize {
    let mut open: usize = 0;
    let mut most = 0;
    for a in list {
        match a {
            Action::Forward { .. } => open += 1,
            Action::Backward { .. } => open -= 1,
        }
        most = most.max(open);
    }
    most
}

#[test]
fn every_accepted_combination_runs_to_the_end() {
    let mut accepted = 0;
    for schedule in [Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved] {
        for pp in 1..=6 {
            for m in 1..=12 {
                for v in 1..=4 {
                    let s = spec(schedule, pp, m, v);
                    let layers = pp * v * 2;
                    if s.validate(layers).is_err() {
                        continue;
                    }
                    accepted += 1;
                    for stage in 0..pp {
                        check_list(&s, stage);
                    }
                    // Every message sent to another stage is one some action there needs.
                    for from in 0..pp {
                        for (to, msg) in s.outbox(from) {
                            assert_ne!(to, from);
                            let needed = match msg {
                                Message::Tied => to == pp - 1,
                                Message::TiedGradient => to == 0,
                                _ => s.actions(to).iter().any(|&a| s.needs(to, a) == Some(msg)),
                            };
                            assert!(needed, "{s:?}: {msg:?} to stage {to} is never used");
                        }
                    }
                }
            }
        }
    }
    // GPipe and 1F1B: 6 x 12 each with v = 1; interleaved: every m that pp divides, any v.
    let interleaved: usize = (1..=6).map(|pp| 12 / pp).sum::<usize>() * 4;
    assert_eq!(accepted, 2 * 6 * 12 + interleaved);
}

#[test]
fn one_f_one_b_bounds_the_micro_batches_in_flight() {
    for pp in 1..=5 {
        for m in 1..=10 {
            let f = spec(Schedule::OneFOneB, pp, m, 1);
            let g = spec(Schedule::GPipe, pp, m, 1);
            for stage in 0..pp {
                assert_eq!(in_flight(&f.actions(stage)), (pp - stage).min(m));
                assert_eq!(in_flight(&g.actions(stage)), m);
            }
        }
    }
    // The last stage alternates from the start.
    assert_eq!(
        spec(Schedule::OneFOneB, 4, 3, 1).actions(3)[..2],
        [
            Action::Forward { mb: 0, chunk: 0 },
            Action::Backward { mb: 0, chunk: 0 }
        ]
    );
}

#[test]
fn interleaved_goes_round_the_chunks_in_groups_of_pp() {
    let s = spec(Schedule::Interleaved, 2, 4, 2);
    let forwards: Vec<(usize, usize)> = s
        .actions(0)
        .into_iter()
        .filter_map(|a| match a {
            Action::Forward { mb, chunk } => Some((mb, chunk)),
            Action::Backward { .. } => None,
        })
        .collect();
    assert_eq!(
        forwards,
        [
            (0, 0),
            (1, 0),
            (0, 1),
            (1, 1),
            (2, 0),
            (3, 0),
            (2, 1),
            (3, 1)
        ]
    );
    // Stage 0 warms up with (pp - 1) * 2 + (v - 1) * pp = 4 forwards.
    assert!(matches!(s.actions(0)[4], Action::Forward { .. }));
    assert!(matches!(
        s.actions(0)[5],
        Action::Backward { mb: 0, chunk: 1 }
    ));
    assert!(s.bubble_theory() < spec(Schedule::OneFOneB, 2, 4, 1).bubble_theory());
    assert!((spec(Schedule::OneFOneB, 4, 8, 1).bubble_theory() - 3.0 / 11.0).abs() < 1e-15);
}

#[test]
fn replayed_bubbles_match_the_theory_and_interleaving_shrinks_them() {
    for pp in 1..=6 {
        for m in 1..=12 {
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                let s = spec(schedule, pp, m, 1);
                let got = s.replay(1.0, 2.0).expect("replay");
                assert!(
                    (got - s.bubble_theory()).abs() < 1e-12,
                    "{s:?}: replayed {got} vs theory {}",
                    s.bubble_theory()
                );
            }
            for v in 2..=4 {
                let s = spec(Schedule::Interleaved, pp, m, v);
                if pp == 1 || s.validate(pp * v).is_err() {
                    continue;
                }
                let got = s.replay(1.0, 2.0).expect("replay");
                let plain = spec(Schedule::OneFOneB, pp, m, 1).bubble_theory();
                assert!(got < plain, "{s:?}: {got} not below 1F1B's {plain}");
                assert!(
                    got <= s.bubble_theory() + 1e-12,
                    "{s:?}: {got} above theory"
                );
            }
        }
    }
}

#[test]
fn invalid_combinations_are_typed_errors() {
    let cases = [
        (
            spec(Schedule::Interleaved, 2, 3, 2),
            8,
            "multiple of the pipeline stages",
        ),
        (
            spec(Schedule::Interleaved, 2, 4, 2),
            6,
            "multiple of stages x virtual stages",
        ),
        (
            spec(Schedule::OneFOneB, 2, 4, 2),
            8,
            "need the interleaved schedule",
        ),
        (spec(Schedule::GPipe, 4, 4, 1), 3, "cannot fill"),
        (spec(Schedule::GPipe, 0, 4, 1), 3, "at least 1"),
        (spec(Schedule::OneFOneB, 2, 0, 1), 3, "at least 1"),
    ];
    for (s, layers, want) in cases {
        let e = s.validate(layers).expect_err("accepted").to_string();
        assert!(e.contains(want), "{s:?} with {layers} layers: {e}");
    }
}

fn stage_layouts(pp: usize, per: usize) -> Vec<GptLayout> {
    (0..pp)
        .map(|s| {
            let p = Placement::new_1d(
                DeviceType::Cpu,
                (s * per..(s + 1) * per).collect::<Vec<usize>>(),
            )
            .and_then(|p| p.reshaped([per, 1]))
            .expect("placement");
            GptLayout::Mesh(NamedMesh::of(p, &[DP, TP]).unwrap())
        })
        .collect()
}

#[test]
fn layers_split_as_evenly_as_possible() {
    let s = StageSplit::new(7, stage_layouts(3, 2), 1).expect("split");
    let sizes: Vec<usize> = (0..s.chunks()).map(|g| s.blocks(g).len()).collect();
    assert_eq!(sizes, [3, 2, 2]);
    let s = StageSplit::new(8, stage_layouts(2, 1), 2).expect("split");
    assert_eq!(s.chunks(), 4);
    assert_eq!(s.blocks(2), 4..6);
    assert_eq!(s.stage_of(2), 0);
    assert_eq!(s.block_layout(5), s.layout(0));
    assert_eq!(s.block_layout(7), s.layout(1));
    assert!(StageSplit::new(3, stage_layouts(2, 1), 2).is_err());
    let shared = vec![
        stage_layouts(1, 2)[0].clone(),
        stage_layouts(1, 2)[0].clone(),
    ];
    assert!(StageSplit::new(4, shared, 1)
        .expect_err("shared ranks")
        .to_string()
        .contains("share ranks"));
}

/// Every accepted (schedule, pp, m, v) with pp <= 6, m <= 12, v <= 4.
fn accepted() -> Vec<PipelineSpec> {
    let mut out = Vec::new();
    for schedule in [Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved] {
        for pp in 1..=6 {
            for m in 1..=12 {
                for v in 1..=4 {
                    let s = spec(schedule, pp, m, v);
                    if s.validate(pp * v * 2).is_ok() {
                        out.push(s);
                    }
                }
            }
        }
    }
    out
}

#[test]
fn programs_receive_each_message_once_in_send_order_before_its_use() {
    for s in accepted() {
        for tied in [false, true] {
            let programs: Vec<Vec<HostOp>> = (0..s.stages).map(|st| s.program(st, tied)).collect();
            for (stage, program) in programs.iter().enumerate() {
                let mut have = std::collections::HashSet::new();
                let mut ran = 0;
                for op in program {
                    match *op {
                        HostOp::Recv { from, msg } => {
                            assert_eq!(s.sender_of(msg), from, "{s:?}");
                            assert!(have.insert(msg), "{s:?} stage {stage}: {msg:?} twice");
                        }
                        HostOp::Run(a) => {
                            ran += 1;
                            if let Some(msg) = s.needs(stage, a) {
                                if s.sender_of(msg) != stage {
                                    assert!(
                                        have.contains(&msg),
                                        "{s:?} stage {stage}: {a:?} before {msg:?}"
                                    );
                                }
                            }
                        }
                        HostOp::Send { to, msg } => {
                            assert_ne!(to, stage, "{s:?}: {msg:?} sent to itself");
                        }
                    }
                }
                assert_eq!(ran, 2 * s.micro_batches * s.virtual_stages);
                // Per sender: received in the order it sent, all of them.
                for from in (0..s.stages).filter(|&f| f != stage) {
                    let sent: Vec<Message> = programs[from]
                        .iter()
                        .filter_map(|op| match *op {
                            HostOp::Send { to, msg } if to == stage => Some(msg),
                            _ => None,
                        })
                        .collect();
                    let got: Vec<Message> = program
                        .iter()
                        .filter_map(|op| match *op {
                            HostOp::Recv { from: f, msg } if f == from => Some(msg),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(sent, got, "{s:?}: stage {from} to {stage}");
                }
                let tied_msgs = program.iter().any(|op| {
                    matches!(
                        op,
                        HostOp::Send {
                            msg: Message::Tied | Message::TiedGradient,
                            ..
                        } | HostOp::Recv {
                            msg: Message::Tied | Message::TiedGradient,
                            ..
                        }
                    )
                });
                let ends = stage == 0 || stage + 1 == s.stages;
                assert_eq!(
                    tied_msgs,
                    tied && s.stages > 1 && ends,
                    "{s:?} stage {stage}"
                );
            }
        }
    }
}

#[test]
fn every_accepted_combination_finishes_on_one_way_channels_on_devices() {
    let all = accepted();
    let interleaved: usize = (1..=6).map(|pp| 12 / pp).sum::<usize>() * 4;
    assert_eq!(all.len(), 2 * 6 * 12 + interleaved);
    for s in &all {
        let r = s
            .replay_on(Transport::OneWayChannels)
            .unwrap_or_else(|e| panic!("{e}"));
        // Two channels per pair of neighbouring stages (one each way), the wrap-around and the
        // tied table's between the last and first stage.
        if s.stages == 2 {
            assert_eq!(r.channels, 2, "{s:?}");
        }
        assert!(r.device_ops > 0);
    }
}

#[test]
fn one_stream_per_pair_of_stages_deadlocks_1f1b_and_interleaving_not_gpipe() {
    for s in accepted() {
        let r = s.replay_on(Transport::SharedPairs);
        let pp_m = s.stages >= 2 && s.micro_batches >= 2;
        match s.schedule {
            // All forwards, then all backwards: each pair's traffic is one-way at a time.
            Schedule::GPipe => assert!(r.is_ok(), "{s:?}: {r:?}"),
            _ if pp_m => {
                let e = r.expect_err("finished on shared pairs").to_string();
                assert!(e.contains("the devices deadlock"), "{e}");
                assert!(e.contains("started, its peer's half not"), "{e}");
            }
            _ => {}
        }
    }
    // The concrete cycle: stage 0's second activation queues behind ... and stage 1's first
    // gradient waits for stage 0 to post its receive, which is queued behind that send.
    let e = spec(Schedule::OneFOneB, 2, 2, 1)
        .replay_on(Transport::SharedPairs)
        .expect_err("deadlock")
        .to_string();
    assert!(
        e.contains("stage 0: send Activation { mb: 1, to: 1 }")
            && e.contains("stage 1: send Gradient { mb: 0, to: 0 }"),
        "{e}"
    );
}
