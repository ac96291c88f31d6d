//! Placement construction and parsing on hostile input: typed errors, no panic, bounded memory.

use oxiflow_placement::{DeviceType, Placement, PlacementError, MAX_NESTING};
use proptest::prelude::*;

#[test]
fn rank_ids_near_usize_max_build_a_placement() {
    let p = Placement::new_1d(DeviceType::Cpu, [usize::MAX, 0, usize::MAX - 1]).unwrap();
    assert_eq!(p.index_of(usize::MAX), Some(0));
    assert_eq!(p.index_of(usize::MAX - 1), Some(2));
    assert_eq!(p.index_of(usize::MAX - 2), None);
    assert_eq!(p.index_of(0), Some(1));
    let text = format!("cpu:[{}, 0]", usize::MAX);
    let parsed: Placement = text.parse().unwrap();
    assert_eq!(parsed.ranks(), &[usize::MAX, 0]);
    assert_eq!(parsed.to_string(), text);
}

#[test]
fn duplicate_huge_rank_is_a_typed_error() {
    let e = Placement::new_1d(DeviceType::Cpu, [usize::MAX, 3, usize::MAX]).unwrap_err();
    assert!(
        matches!(e, PlacementError::DuplicateRank { rank, .. } if rank == usize::MAX),
        "{e}"
    );
}

#[test]
fn mesh_shape_whose_size_overflows_is_refused() {
    let e = Placement::new(DeviceType::Cuda, [usize::MAX, 2], [0, 1]).unwrap_err();
    assert!(matches!(e, PlacementError::MeshTooLarge { .. }), "{e}");
    let e = Placement::new(DeviceType::Cuda, [1 << 33, 1 << 33], [0]).unwrap_err();
    assert!(matches!(e, PlacementError::MeshTooLarge { .. }), "{e}");
}

#[test]
fn rank_that_does_not_fit_in_usize_is_a_parse_error() {
    let e = "cpu:[99999999999999999999999999]"
        .parse::<Placement>()
        .unwrap_err();
    assert!(matches!(e, PlacementError::Parse { .. }), "{e}");
}

#[test]
fn deep_nesting_is_refused_without_recursing_further() {
    for depth in [MAX_NESTING + 1, 100_000, 1_000_000] {
        let text = format!("cpu:{}0{}", "[".repeat(depth), "]".repeat(depth));
        let e = text.parse::<Placement>().unwrap_err();
        assert!(
            matches!(e, PlacementError::TooDeep { limit, .. } if limit == MAX_NESTING),
            "depth {depth}: {e}"
        );
    }
    let unclosed = format!("cpu:{}", "[".repeat(1_000_000));
    assert!(matches!(
        unclosed.parse::<Placement>().unwrap_err(),
        PlacementError::TooDeep { .. }
    ));
}

#[test]
fn nesting_at_the_limit_parses() {
    let text = format!(
        "cpu:{}7{}",
        "[".repeat(MAX_NESTING),
        "]".repeat(MAX_NESTING)
    );
    let p: Placement = text.parse().unwrap();
    assert_eq!(p.ndim(), MAX_NESTING);
    assert_eq!(p.ranks(), &[7]);
}

/// Text built from the placement grammar's own tokens, so the generator reaches deep into the
/// parser instead of failing at the first byte.
fn placement_like_text() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just(" ".to_string()),
        Just(":".to_string()),
        Just(usize::MAX.to_string()),
        Just("18446744073709551616".to_string()),
        (0usize..8).prop_map(|r| r.to_string()),
        any::<usize>().prop_map(|r| r.to_string()),
        "[a-z\\-]{0,3}".prop_map(|s| s),
    ];
    (
        prop_oneof![
            Just("cpu:"),
            Just("cuda:"),
            Just("gpu:"),
            Just("x:"),
            Just("")
        ],
        prop::collection::vec(token, 0..64),
    )
        .prop_map(|(dev, tokens)| format!("{dev}{}", tokens.concat()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn parsing_any_text_returns_without_panicking(text in placement_like_text()) {
        if let Ok(p) = text.parse::<Placement>() {
            let again: Placement = p.to_string().parse().unwrap();
            prop_assert_eq!(again, p);
        }
    }

    #[test]
    fn parsing_arbitrary_unicode_returns(text in "\\PC{0,80}") {
        let _ = text.parse::<Placement>();
    }

    #[test]
    fn any_rank_list_builds_or_fails_with_a_typed_error(
        ranks in prop::collection::vec(
            prop_oneof![0usize..16, (usize::MAX - 16)..=usize::MAX, any::<usize>()],
            0..48,
        ),
        shape in prop::collection::vec(
            prop_oneof![0usize..5, Just(usize::MAX), any::<usize>()],
            0..5,
        ),
    ) {
        let mut distinct = ranks.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let product = shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
        match Placement::new(DeviceType::Cpu, shape.clone(), ranks.clone()) {
            Ok(p) => {
                prop_assert_eq!(distinct.len(), ranks.len());
                prop_assert_eq!(Some(ranks.len()), product);
                for (i, &r) in ranks.iter().enumerate() {
                    prop_assert_eq!(p.index_of(r), Some(i));
                    prop_assert_eq!(p.rank_at(&p.coord_of(r).unwrap()).unwrap(), r);
                }
                let text = p.to_string();
                prop_assert_eq!(text.parse::<Placement>().unwrap(), p);
            }
            Err(PlacementError::EmptyMesh { .. }) => {
                prop_assert!(shape.is_empty() || shape.contains(&0));
            }
            Err(PlacementError::MeshTooLarge { .. }) => prop_assert_eq!(product, None),
            Err(PlacementError::ShapeMismatch { expected, got, .. }) => {
                prop_assert_eq!(Some(expected), product);
                prop_assert_ne!(expected, got);
            }
            Err(PlacementError::DuplicateRank { rank, .. }) => {
                prop_assert!(distinct.len() < ranks.len());
                prop_assert!(ranks.iter().filter(|&&r| r == rank).count() > 1);
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }
}
