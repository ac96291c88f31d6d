//! The flight recorder: every call through the `Communicator` boundary lands in the
//! process-wide ring in order with its state; a failed (timed-out) call is marked Failed and
//! the ring is dumped as JSON; the ring keeps the last N calls; recording is cheap. The tests
//! share the process-wide recorder, so they take turns.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::{
    flight_recorder, BufMut, CommError, DType, FlightDump, FlightEntry, FlightRecorder,
    FlightState, InProcessWorld, ReduceOp, SharedComm,
};

fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    let g = TURN.lock().unwrap_or_else(|e| e.into_inner());
    flight_recorder().set_capacity(256);
    flight_recorder().set_dump_dir(None);
    g
}

fn scratch_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-flight-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn f32s(v: &mut [f32]) -> BufMut<'_> {
    BufMut::Host(bytemuck::cast_slice_mut(v))
}

/// What each rank runs: five calls on the world, then one on a sub-group.
fn program(c: SharedComm) -> Result<Vec<f32>, CommError> {
    let me = c.rank() as f32;
    let mut a = vec![me + 1.0; 6];
    c.all_reduce(DType::F32, f32s(&mut a), ReduceOp::Sum)?;
    let mut b = vec![me; 2];
    c.broadcast(DType::F32, f32s(&mut b), 1)?;
    let send = [me; 3];
    let mut all = vec![0f32; 6];
    c.all_gather(
        DType::F32,
        bytemuck::cast_slice(&send[..]).into(),
        f32s(&mut all),
    )?;
    c.barrier()?;
    // A bad call: recorded as Failed, and nothing is sent.
    let bad = c.broadcast(DType::F32, f32s(&mut b), 7);
    assert!(matches!(bad, Err(CommError::InvalidArgument { .. })));
    let solo = c.sub_group(&[c.rank()])?;
    solo.all_reduce(DType::F32, f32s(&mut b), ReduceOp::Max)?;
    a.extend(b);
    a.extend(all);
    Ok(a)
}

fn on_group(entries: &[FlightEntry], group: &[usize]) -> Vec<FlightEntry> {
    entries
        .iter()
        .filter(|e| e.group == group)
        .cloned()
        .collect()
}

#[test]
fn calls_are_recorded_in_order_with_their_states() {
    let _turn = turn();
    let comms = InProcessWorld::new(2, Duration::from_secs(20));
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| std::thread::spawn(move || program(c)))
        .collect();
    let results: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    // Recording does not change results: 1 + 2 summed, rank 1's broadcast, the gather.
    for r in &results {
        assert_eq!(&r[..6], &[3.0; 6]);
        assert_eq!(&r[6..8], &[1.0, 1.0]);
        assert_eq!(&r[8..], &[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    }
    let all = flight_recorder().snapshot();
    let world = on_group(&all, &[0, 1]);
    let ops = [
        "all_reduce",
        "broadcast",
        "all_gather",
        "barrier",
        "broadcast",
        "sub_group",
    ];
    assert_eq!(world.len(), 2 * ops.len(), "{world:#?}");
    for (seq, op) in ops.iter().enumerate() {
        let calls: Vec<&FlightEntry> = world.iter().filter(|e| e.seq == seq as u64).collect();
        assert_eq!(calls.len(), 2, "seq {seq}: {calls:#?}");
        for e in calls {
            assert_eq!(e.op, *op);
            if seq == 4 {
                let FlightState::Failed(why) = &e.state else {
                    panic!("bad broadcast recorded as {:?}", e.state)
                };
                assert!(why.contains("root 7"), "{why}");
                assert_eq!(e.peer, Some(7));
            } else {
                assert_eq!(e.state, FlightState::Finished, "{e:?}");
            }
            let end = e.finished_unix_ms.expect("finished calls have an end time");
            assert!(end >= e.started_unix_ms);
        }
    }
    let first = world.iter().find(|e| e.seq == 0).unwrap();
    assert_eq!((first.dtype.as_str(), first.bytes), ("f32", 24));
    // Each rank's entries appear in its program order (the ring is oldest first).
    for rank in 0..2 {
        let mine = on_group(&all, &[rank]);
        assert_eq!(mine.len(), 1, "{mine:#?}");
        assert_eq!(mine[0].op, "all_reduce");
        assert_eq!(mine[0].state, FlightState::Finished);
    }
    // The ring is in the order calls began. A collective begins on every member before any
    // member begins the next one, so calls 0..=3 (up to the barrier) come in order; the bad
    // broadcast and the sub-group after it are local, so the two ranks' may interleave.
    let seqs: Vec<u64> = world.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs[..8],
        [0, 0, 1, 1, 2, 2, 3, 3],
        "entries out of order: {seqs:?}"
    );
    let mut local = seqs[8..].to_vec();
    local.sort();
    assert_eq!(local, [4, 4, 5, 5], "{seqs:?}");
}

#[test]
fn a_timed_out_call_is_marked_failed_and_dumped() {
    let _turn = turn();
    let dir = scratch_dir("timeout");
    let rec = flight_recorder();
    rec.set_rank(3);
    rec.set_dump_dir(Some(dir.clone()));
    let comms = InProcessWorld::new(2, Duration::from_millis(200));
    // Member 1 never arrives.
    let mut v = vec![1f32; 4];
    let err = comms[0]
        .all_reduce(DType::F32, f32s(&mut v), ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(err, CommError::Timeout { .. }), "{err}");
    let last = rec.last().unwrap();
    assert_eq!(last.op, "all_reduce");
    assert_eq!(last.state, FlightState::Failed(err.to_string()));
    let text = std::fs::read_to_string(dir.join("flight-rank3.json")).unwrap();
    let dump: FlightDump = serde_json::from_str(&text).unwrap();
    assert_eq!(dump.rank, 3);
    assert_eq!(dump.entries.last(), Some(&last));
    assert_eq!(text, rec.to_json());
    rec.set_dump_dir(None);
    rec.set_rank(0);
    std::fs::remove_dir_all(&dir).unwrap();
    drop(comms);
}

#[test]
fn the_ring_keeps_the_last_calls_oldest_first() {
    let rec = FlightRecorder::new(4);
    assert!(rec.last().is_none());
    let fail = CommError::Mismatch {
        op: "step".into(),
        detail: "x".into(),
    };
    for k in 0..10u64 {
        let t = rec.begin_boxing(format!("step {k}"), &[0, 1], "f64", k * 8);
        if k == 7 {
            rec.finish(t, Err(&fail));
        } else if k != 9 {
            rec.finish(t, Ok(()));
        }
    }
    let s = rec.snapshot();
    let seqs: Vec<u64> = s.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![6, 7, 8, 9]);
    assert_eq!(s[0].op, "step 6");
    assert_eq!(s[1].state, FlightState::Failed(fail.to_string()));
    assert_eq!(s[3].state, FlightState::Started);
    assert_eq!(s[3].finished_unix_ms, None);
    assert_eq!(rec.last().as_ref(), s.last());
    let back: FlightDump = serde_json::from_str(&rec.to_json()).unwrap();
    assert_eq!(back.entries, s);
}

#[test]
fn the_dump_directory_comes_from_the_environment() {
    let env = LaunchEnv::from_vars(|k| match k {
        "OXIFLOW_FLIGHT_DIR" => Some("/tmp/flights".into()),
        _ => None,
    })
    .unwrap();
    assert_eq!(env.flight_dir, Some(PathBuf::from("/tmp/flights")));
    let none = LaunchEnv::from_vars(|_| None).unwrap();
    assert_eq!(none.flight_dir, None);
}

#[test]
fn recording_costs_well_under_a_microsecond() {
    let _turn = turn();
    // A one-member world returns right after the boundary, so this times the checks and the
    // recording (three short critical sections and two clock reads).
    let c: Arc<_> = InProcessWorld::new(1, Duration::from_secs(5)).remove(0);
    let mut v = [0u8; 16];
    let calls = 200_000;
    let t = Instant::now();
    for _ in 0..calls {
        c.all_reduce(DType::F32, BufMut::Host(&mut v), ReduceOp::Sum)
            .unwrap();
    }
    let per = t.elapsed() / calls;
    println!("boundary + flight record: {per:?} per call");
    assert!(per < Duration::from_micros(5), "{per:?} per call");
    assert_eq!(flight_recorder().snapshot().len(), 256);
}
