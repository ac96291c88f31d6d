//! Named mesh axes: a layout resolved from requested sizes and the world size puts every rank
//! in exactly one stage, in mesh order (the last axis varying fastest), finds each role's axis
//! by name, gives the trainer's messages for sizes that do not fit the world, and takes an
//! extra axis (`ep`) as one more entry; malformed layouts are refused naming the axes.

use oxiflow_placement::{
    AxisKind, AxisRole, DeviceType, MeshAxis, MeshLayout, NamedMesh, Placement, PlacementError, CP,
    DP, EP, PP, TP,
};
use proptest::prelude::*;

fn job(pp: usize, dp: Option<usize>, cp: usize, tp: usize, world: usize) -> String {
    let requested = [(PP, Some(pp)), (DP, dp), (CP, Some(cp)), (TP, Some(tp))];
    MeshLayout::resolve(&requested, world)
        .unwrap_err()
        .to_string()
}

#[test]
fn sizes_that_do_not_fit_the_world_name_the_flags() {
    assert_eq!(
        job(1, None, 1, 3, 1),
        "--tp 3 does not divide the world size 1"
    );
    assert_eq!(
        job(1, None, 3, 1, 2),
        "--cp 3 x --tp 1 does not divide the world size 2"
    );
    assert_eq!(
        job(2, None, 1, 1, 3),
        "--pp 2 x --tp 1 does not divide the world size 3"
    );
    assert_eq!(
        job(1, Some(2), 1, 1, 1),
        "--dp 2 x --tp 1 must equal the world size 1"
    );
    assert_eq!(
        job(2, Some(2), 2, 1, 4),
        "--pp 2 x --dp 2 x --cp 2 x --tp 1 must equal the world size 4"
    );
    assert_eq!(
        job(usize::MAX, None, 1, 2, 4),
        format!(
            "--pp {} x --tp 2 does not divide the world size 4",
            usize::MAX
        )
    );
    assert_eq!(
        job(usize::MAX, Some(2), 1, 2, 4),
        format!(
            "--pp {} x --dp 2 x --tp 2 must equal the world size 4",
            usize::MAX
        )
    );
}

#[test]
fn malformed_layouts_are_refused_naming_the_axes() {
    let err = |axes: Vec<MeshAxis>| MeshLayout::new(axes).unwrap_err();
    assert_eq!(
        err(vec![MeshAxis::new(DP, 2), MeshAxis::new(DP, 1)]),
        PlacementError::DuplicateAxis {
            name: "dp".into(),
            axes: "--dp 2 x --dp 1".into()
        }
    );
    assert_eq!(
        err(vec![MeshAxis::new(TP, 0)]).to_string(),
        "mesh axis --tp has size 0 (at least 1)"
    );
    assert_eq!(
        err(vec![MeshAxis::new(DP, 2), MeshAxis::new(PP, 2)]).to_string(),
        "the pipeline axis pp must be the first mesh axis of --dp 2 x --pp 2"
    );
    const SHARD: AxisKind = AxisKind {
        name: "shard",
        roles: &[AxisRole::Params],
        kept_at_one: false,
    };
    assert_eq!(
        err(vec![MeshAxis::new(DP, 2), MeshAxis::new(SHARD, 2)]).to_string(),
        "mesh axes dp and shard both split the parameters (ZeRO): a role is on one axis"
    );
    assert_eq!(
        MeshLayout::resolve(&[(DP, None), (TP, None)], 4)
            .unwrap_err()
            .to_string(),
        "mesh axes dp and tp both left to infer from the world size: give one"
    );
    assert_eq!(
        MeshLayout::resolve(&[(DP, None), (TP, Some(0))], 4)
            .unwrap_err()
            .to_string(),
        "mesh axis --tp has size 0 (at least 1)"
    );
    let p = Placement::range(DeviceType::Cpu, 4).unwrap();
    assert_eq!(
        NamedMesh::new(p, vec![MeshAxis::new(DP, 2), MeshAxis::new(TP, 2)])
            .unwrap_err()
            .to_string(),
        "mesh axes --dp 2 x --tp 2 do not match the shape of placement cpu:[0, 1, 2, 3]"
    );
}

#[test]
fn an_expert_axis_is_one_more_entry() {
    let requested = [
        (PP, Some(2)),
        (DP, None),
        (EP, Some(2)),
        (CP, Some(1)),
        (TP, Some(2)),
    ];
    let layout = MeshLayout::resolve(&requested, 16).unwrap();
    assert_eq!(layout.to_string(), "[pp 2, dp 2, ep 2, cp 1, tp 2]");
    assert_eq!(layout.size(AxisRole::Experts), 2);
    let stages = layout.stages(DeviceType::Cpu).unwrap();
    assert_eq!(stages.len(), 2);
    let s1 = &stages[1];
    assert_eq!(s1.placement().shape(), &[2, 2, 2]);
    assert_eq!(s1.placement().ranks(), (8..16).collect::<Vec<_>>());
    assert_eq!(s1.axis(AxisRole::Batch), Some(0));
    assert_eq!(s1.axis(AxisRole::Params), Some(0));
    assert_eq!(s1.axis(AxisRole::Experts), Some(1));
    assert_eq!(s1.axis(AxisRole::Heads), Some(2));
    assert_eq!(s1.axis(AxisRole::Sequence), None);
    assert_eq!(s1.size(AxisRole::Sequence), 1);
    // Rank 13 = stage 1, then (dp 1, ep 0, tp 1) in row-major order.
    assert_eq!(s1.coord(13, AxisRole::Batch), Some(1));
    assert_eq!(s1.coord(13, AxisRole::Experts), Some(0));
    assert_eq!(s1.coord(13, AxisRole::Heads), Some(1));
    assert_eq!(s1.coord(13, AxisRole::Sequence), Some(0));
    assert_eq!(s1.coord(3, AxisRole::Heads), None);
    assert_eq!(layout.world(DeviceType::Cpu).unwrap().num_ranks(), 16);
}

proptest! {
    #[test]
    fn stages_partition_the_world_in_mesh_order(
        pp in 1usize..=3, dp in 1usize..=3, cp in 1usize..=3, tp in 1usize..=3, infer in any::<bool>(),
    ) {
        let world = pp * dp * cp * tp;
        let requested = [(PP, Some(pp)), (DP, (!infer).then_some(dp)), (CP, Some(cp)), (TP, Some(tp))];
        let layout = MeshLayout::resolve(&requested, world).unwrap();
        prop_assert_eq!(
            layout.axes().iter().map(|a| a.size).collect::<Vec<_>>(),
            vec![pp, dp, cp, tp]
        );
        let stages = layout.stages(DeviceType::Cpu).unwrap();
        prop_assert_eq!(stages.len(), pp);
        for (s, stage) in stages.iter().enumerate() {
            // dp and tp always, cp only above 1.
            let names: Vec<&str> = stage.axes().iter().map(MeshAxis::name).collect();
            let want: Vec<&str> = if cp > 1 { vec!["dp", "cp", "tp"] } else { vec!["dp", "tp"] };
            prop_assert_eq!(names, want);
            for &rank in stage.placement().ranks() {
                let at = |role| stage.coord(rank, role).unwrap();
                let (d, c, t) = (at(AxisRole::Batch), at(AxisRole::Sequence), at(AxisRole::Heads));
                prop_assert_eq!(rank, ((s * dp + d) * cp + c) * tp + t);
            }
            prop_assert_eq!(stage.size(AxisRole::Heads), tp);
            prop_assert_eq!(stage.size(AxisRole::Sequence), cp);
            prop_assert_eq!(stage.size(AxisRole::Experts), 1);
        }
        prop_assert_eq!(layout.size(AxisRole::Stages), pp);
        prop_assert_eq!(layout.axis(AxisRole::Batch).map(|a| a.size), Some(dp));
    }
}
