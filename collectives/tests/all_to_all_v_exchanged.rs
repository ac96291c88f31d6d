//! `all_to_all_v_exchanged` (counts exchanged first, then the data) on in-process ranks against
//! a single-process reference: random count matrices with zero counts and ranks that send and
//! receive nothing, several dtypes; a member that never arrives is named within the timeout;
//! bad counts fail on every member before anything is sent. (The TCP backend runs it inside
//! the random scenarios of `multiprocess_tcp`.)

mod multiprocess_common;

use std::time::{Duration, Instant};

use multiprocess_common::{assert_member_2_missing, run_threads};
use oxiflow_collectives::{CommError, DType, InProcessWorld};
use proptest::prelude::*;

/// The bytes of the `n` elements member `from` sends member `to`: element k is
/// `from * 10_000 + to * 100 + k`, the element's bytes repeated as the dtype's size needs.
fn piece(dtype: DType, from: usize, to: usize, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|k| {
            let v = (from * 10_000 + to * 100 + k) as u64;
            v.to_le_bytes()
                .into_iter()
                .cycle()
                .take(dtype.size())
                .collect::<Vec<u8>>()
        })
        .collect()
}

const DTYPES: [DType; 4] = [DType::F64, DType::I64, DType::F32, DType::BF16];

/// A count matrix of `n` members, `matrix[i][j]` elements from i to j, where members flagged
/// in `empty` send and receive nothing.
fn matrix(counts: Vec<Vec<usize>>, empty: Vec<bool>) -> Vec<Vec<usize>> {
    let n = counts.len();
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    if empty[i] || empty[j] {
                        0
                    } else {
                        counts[i][j]
                    }
                })
                .collect()
        })
        .collect()
}

fn case() -> impl Strategy<Value = (Vec<Vec<usize>>, usize)> {
    (1usize..=6)
        .prop_flat_map(|n| {
            (
                prop::collection::vec(prop::collection::vec(0usize..5, n), n),
                prop::collection::vec(prop::bool::weighted(0.25), n),
                0..DTYPES.len(),
            )
        })
        .prop_map(|(counts, empty, dt)| (matrix(counts, empty), dt))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn received_pieces_and_counts_match_the_reference((m, dt) in case()) {
        let n = m.len();
        let dtype = DTYPES[dt];
        let comms = InProcessWorld::new(n, Duration::from_secs(20));
        let sent = m.clone();
        let got = run_threads(comms, move |c| {
            let me = c.rank();
            let send: Vec<u8> = (0..n).flat_map(|j| piece(dtype, me, j, sent[me][j])).collect();
            c.all_to_all_v_exchanged(dtype, &send, &sent[me])
        });
        for (j, r) in got.into_iter().enumerate() {
            let (bytes, counts) = r.map_err(|e| TestCaseError::fail(format!("member {j}: {e}")))?;
            let want_counts: Vec<usize> = (0..n).map(|i| m[i][j]).collect();
            let want: Vec<u8> = (0..n).flat_map(|i| piece(dtype, i, j, m[i][j])).collect();
            prop_assert_eq!(&counts, &want_counts, "member {} of {:?}", j, m);
            prop_assert_eq!(bytes, want, "member {} of {:?}", j, m);
        }
    }
}

#[test]
fn counts_exchange_alone_tells_each_member_what_it_receives() {
    let n = 4;
    let comms = InProcessWorld::new(n, Duration::from_secs(20));
    let got = run_threads(comms, move |c| {
        let me = c.rank();
        // Member i sends i + j elements to member j, none to itself.
        let counts: Vec<usize> = (0..n).map(|j| if j == me { 0 } else { me + j }).collect();
        c.exchange_counts(&counts).unwrap()
    });
    for (j, counts) in got.into_iter().enumerate() {
        let want: Vec<usize> = (0..n).map(|i| if i == j { 0 } else { i + j }).collect();
        assert_eq!(counts, want, "member {j}");
    }
}

#[test]
fn a_member_that_never_arrives_is_named_within_the_timeout() {
    assert_member_2_missing(|c| {
        let send = vec![0u8; 3 * 8];
        c.all_to_all_v_exchanged(DType::F64, &send, &[1, 1, 1])
    });
}

#[test]
fn bad_counts_fail_on_every_member_before_anything_is_sent() {
    // Every member passes counts for the wrong group size, or a send buffer that does not
    // hold its counts: each fails at once (a member that sent would wait out the timeout).
    let comms = InProcessWorld::new(3, Duration::from_secs(30));
    let start = Instant::now();
    let out = run_threads(comms, |c| {
        let short = c.all_to_all_v_exchanged(DType::F32, &[0u8; 8], &[1, 1]);
        let long = c.all_to_all_v_exchanged(DType::F32, &[0u8; 8], &[1, 1, 1]);
        let counts = c.exchange_counts(&[1, 2, 3, 4]);
        (short, long, counts)
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    for (short, long, counts) in out {
        match short {
            Err(CommError::InvalidArgument { op, detail }) => {
                assert_eq!(op, "all_to_all_v_exchanged");
                assert!(detail.contains("send_counts has 2 entries"), "{detail}");
            }
            other => panic!("expected the short counts refused, got {other:?}"),
        }
        match long {
            Err(CommError::BufferSize {
                op, expected, got, ..
            }) => {
                assert_eq!(
                    (op.as_str(), expected, got),
                    ("all_to_all_v_exchanged", 12, 8)
                );
            }
            other => panic!("expected the short send buffer refused, got {other:?}"),
        }
        match counts {
            Err(CommError::InvalidArgument { op, .. }) => assert_eq!(op, "exchange_counts"),
            other => panic!("expected the long counts refused, got {other:?}"),
        }
    }
}
