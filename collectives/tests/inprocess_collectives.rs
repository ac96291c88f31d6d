//! In-process backend: random collective sequences on random sub-groups match a sequential
//! reference; timeouts name the missing ranks; bad buffers fail before anything blocks.

mod multiprocess_common;

use std::time::{Duration, Instant};

use multiprocess_common::{assert_member_2_missing, dtype_of, run_rank, run_threads, Case, DTYPES};
use oxiflow_collectives::{Buf, BufMut, CommError, DType, DevicePtr, InProcessWorld, ReduceOp};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_collectives_match_reference(seed in any::<u64>(), world in 1usize..=8, dt in 0usize..DTYPES) {
        let case = Case::generate(seed, world, dtype_of(dt), 8, 40);
        let comms = InProcessWorld::new(world, Duration::from_secs(20));
        let c2 = case.clone();
        let results = run_threads(comms, move |c| run_rank(&c, &c2));
        for r in results {
            prop_assert!(r.is_ok(), "{:?} in case {:?}", r, case);
        }
    }
}

#[test]
fn large_all_reduce_uses_every_member() {
    let n = 4;
    let count = 1 << 18;
    let comms = InProcessWorld::new(n, Duration::from_secs(20));
    let out = run_threads(comms, move |c| {
        let mut v: Vec<f64> = (0..count)
            .map(|i| (i % 97) as f64 + c.rank() as f64)
            .collect();
        c.all_reduce(
            DType::F64,
            bytemuck::cast_slice_mut::<f64, u8>(&mut v).into(),
            ReduceOp::Sum,
        )
        .unwrap();
        v
    });
    for v in out {
        for (i, x) in v.iter().enumerate().step_by(1013) {
            assert_eq!(*x, 4.0 * (i % 97) as f64 + 6.0);
        }
    }
}

#[test]
fn missing_rank_is_named_within_timeout() {
    assert_member_2_missing(|c| {
        let mut b = [0u8; 64];
        c.all_reduce(DType::F32, (&mut b[..]).into(), ReduceOp::Sum)
    });
}

#[test]
fn recv_from_silent_peer_times_out_naming_it() {
    let comms = InProcessWorld::new(2, Duration::from_millis(200));
    let mut b = [0u8; 8];
    match comms[0].recv(DType::F64, (&mut b[..]).into(), 1) {
        Err(CommError::Timeout { missing, .. }) => assert_eq!(missing, vec![1]),
        other => panic!("expected timeout, got {other:?}"),
    }
}

#[test]
fn mismatched_calls_fail_on_every_member() {
    let comms = InProcessWorld::new(2, Duration::from_secs(5));
    let out = run_threads(comms, |c| {
        let mut b = vec![0u8; if c.rank() == 0 { 16 } else { 32 }];
        c.all_reduce(DType::F32, (&mut b[..]).into(), ReduceOp::Sum)
    });
    for r in out {
        assert!(matches!(r, Err(CommError::Mismatch { .. })), "{r:?}");
    }
}

#[test]
fn bad_buffers_fail_before_blocking() {
    let comms = InProcessWorld::new(2, Duration::from_secs(30));
    let c = &comms[0];
    let start = Instant::now();
    let send = [0u8; 8];
    let mut recv = [0u8; 12];
    let e = c.all_gather_v(
        DType::F32,
        Buf::Host(&send),
        BufMut::Host(&mut recv),
        &[2, 2],
    );
    assert!(
        matches!(
            e,
            Err(CommError::BufferSize {
                expected: 16,
                got: 12,
                ..
            })
        ),
        "{e:?}"
    );
    let e = c.all_gather_v(DType::F32, Buf::Host(&send), BufMut::Host(&mut recv), &[2]);
    assert!(matches!(e, Err(CommError::InvalidArgument { .. })), "{e:?}");
    let mut odd = [0u8; 6];
    let e = c.all_reduce(DType::F32, BufMut::Host(&mut odd), ReduceOp::Sum);
    assert!(matches!(e, Err(CommError::BufferSize { .. })), "{e:?}");
    // SAFETY: the host backend refuses device buffers without dereferencing them.
    let dev = unsafe { DevicePtr::new(0x1000, 16, 0) };
    let e = c.all_reduce(DType::F32, BufMut::Device(dev), ReduceOp::Sum);
    assert!(matches!(e, Err(CommError::Unsupported { .. })), "{e:?}");
    let e = c.broadcast(DType::F32, BufMut::Host(&mut recv), 5);
    assert!(matches!(e, Err(CommError::InvalidArgument { .. })), "{e:?}");
    let e = c.sub_group(&[1]).err();
    assert!(
        matches!(e, Some(CommError::InvalidArgument { .. })),
        "{e:?}"
    );
    let e = c.sub_group(&[0, 0]).err();
    assert!(
        matches!(e, Some(CommError::InvalidArgument { .. })),
        "{e:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn sub_groups_are_cached_and_tiny_ops_are_fast() {
    let comms = InProcessWorld::new(4, Duration::from_secs(20));
    let a = comms[1].sub_group(&[3, 1]).unwrap();
    let b = comms[1].sub_group(&[3, 1]).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!(
        (a.rank(), a.size(), a.world_ranks()),
        (1, 2, &[3usize, 1][..])
    );
    let iters = 2000;
    let start = Instant::now();
    run_threads(comms, move |c| {
        let mut v = [c.rank() as f32; 4];
        for _ in 0..iters {
            c.all_reduce(
                DType::F32,
                bytemuck::cast_slice_mut::<f32, u8>(&mut v).into(),
                ReduceOp::Max,
            )
            .unwrap();
        }
        assert_eq!(v, [3.0; 4]);
    });
    let per_op = start.elapsed() / iters;
    eprintln!("in-process 4-rank tiny all_reduce: {per_op:?} per op");
    assert!(
        per_op < Duration::from_millis(2),
        "{per_op:?} per tiny all_reduce"
    );
}

#[test]
fn all_reduce_into_leaves_send_unchanged() {
    let comms = InProcessWorld::new(3, Duration::from_secs(20));
    let out = run_threads(comms, |c| {
        let send: Vec<f32> = (0..5).map(|i| (c.rank() * 10 + i) as f32).collect();
        let before = send.clone();
        let mut recv = vec![0f32; 5];
        c.all_reduce_into(
            DType::F32,
            Buf::Host(bytemuck::cast_slice(&send)),
            BufMut::Host(bytemuck::cast_slice_mut(&mut recv)),
            ReduceOp::Sum,
        )
        .unwrap();
        assert_eq!(send, before);
        let mut short = vec![0f32; 4];
        let e = c.all_reduce_into(
            DType::F32,
            Buf::Host(bytemuck::cast_slice(&send)),
            BufMut::Host(bytemuck::cast_slice_mut(&mut short)),
            ReduceOp::Sum,
        );
        assert!(matches!(e, Err(CommError::BufferSize { .. })), "{e:?}");
        recv
    });
    for r in out {
        assert_eq!(r, vec![30.0, 33.0, 36.0, 39.0, 42.0]);
    }
}

#[test]
fn all_to_all_v_others_skips_the_own_part() {
    let comms = InProcessWorld::new(3, Duration::from_secs(20));
    let out = run_threads(comms, |c| {
        let me = c.rank();
        // Member i sends j (i + j + 1) elements of value 10 i + j; its own part stays local.
        let counts_to = |i: usize| -> Vec<usize> { (0..3).map(|j| i + j + 1).collect() };
        let send_counts = counts_to(me);
        let recv_counts: Vec<usize> = (0..3).map(|i| counts_to(i)[me]).collect();
        let send: Vec<i64> = (0..3)
            .filter(|&j| j != me)
            .flat_map(|j| vec![(10 * me + j) as i64; send_counts[j]])
            .collect();
        let mut recv = vec![-1i64; recv_counts.iter().sum()];
        c.all_to_all_v_others(
            DType::I64,
            Buf::Host(bytemuck::cast_slice(&send)),
            &send_counts,
            BufMut::Host(bytemuck::cast_slice_mut(&mut recv)),
            &recv_counts,
        )
        .unwrap();
        let want: Vec<i64> = (0..3)
            .flat_map(|i| {
                let v = if i == me { -1 } else { (10 * i + me) as i64 };
                vec![v; recv_counts[i]]
            })
            .collect();
        assert_eq!(recv, want, "member {me}");
        let e = c.all_to_all_v_others(
            DType::I64,
            Buf::Host(bytemuck::cast_slice(&send[1..])),
            &send_counts,
            BufMut::Host(bytemuck::cast_slice_mut(&mut recv)),
            &recv_counts,
        );
        assert!(matches!(e, Err(CommError::BufferSize { .. })), "{e:?}");
    });
    assert_eq!(out.len(), 3);
}
