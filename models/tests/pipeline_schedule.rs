//! Pipeline schedules as pure action lists: every stage runs each (micro-batch, chunk)
//! forward and backward exactly once, backward after forward; 1F1B keeps at most `pp - s`
//! micro-batches in flight on stage `s`; every (pp, m, v) the checks accept runs to the end
//! with buffered sends; replayed with uniform costs, GPipe and 1F1B have the theoretical
//! bubble and interleaving lowers it; invalid combinations are typed errors; the stage split
//! is as even as possible.

use oxiflow_models::nn::gpt::{GptLayout, StageSplit};
use oxiflow_models::pipeline::{Action, Message, PipelineSpec, Schedule};
use oxiflow_placement::{DeviceType, Placement};

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
            GptLayout::Mesh(p)
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
