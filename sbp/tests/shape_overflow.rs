//! Overflow-checked shape arithmetic: `checked_numel` and `checked_bytes` agree with exact
//! (u128) arithmetic, and refuse exactly the shapes whose counts do not fit.

use oxiflow_sbp::Shape;
use proptest::prelude::*;

fn exact(dims: &[usize]) -> Option<u128> {
    dims.iter()
        .filter(|&&d| d != 0)
        .try_fold(1u128, |a, &d| a.checked_mul(d as u128))
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..5,
        1usize..100_000,
        Just(usize::MAX),
        Just(usize::MAX / 2 + 1)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn checked_numel_matches_exact_arithmetic(dims in prop::collection::vec(dim(), 0..6), elem in 1usize..9) {
        let s = Shape::new(dims.clone());
        let nonzero = exact(&dims).filter(|&p| p <= usize::MAX as u128);
        let numel = nonzero.map(|p| if dims.contains(&0) { 0 } else { p as usize });
        prop_assert_eq!(s.checked_numel(), numel);
        let bytes = numel
            .map(|n| n as u128 * elem as u128)
            .filter(|&b| b <= isize::MAX as u128)
            .map(|b| b as usize);
        prop_assert_eq!(s.checked_bytes(elem), bytes);
    }
}

#[test]
fn the_shapes_of_the_issue_are_refused() {
    assert_eq!(Shape::new([usize::MAX, 2]).checked_numel(), None);
    assert_eq!(Shape::new([0, usize::MAX, 2]).checked_numel(), None);
    assert_eq!(Shape::new([1usize << 62]).checked_bytes(4), None);
    assert_eq!(Shape::new([3, 4]).checked_bytes(8), Some(96));
    assert_eq!(Shape::scalar().checked_numel(), Some(1));
}
