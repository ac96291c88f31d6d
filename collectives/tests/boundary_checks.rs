//! Argument checks happen once, at the `Communicator` boundary: a bad argument gets the same
//! typed error (variant, op, detail) from every backend, at once, before any communication
//! (the other members never call, so a backend that communicated would time out instead).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use oxiflow_collectives::rendezvous::{generate_token, StoreClient, StoreServer};
use oxiflow_collectives::{
    Buf, BufMut, CommError, DType, DevicePtr, InProcessWorld, ReduceOp, SharedComm, StridedBlock,
    TcpComm,
};
use proptest::prelude::*;

const N: usize = 3;
const ME: usize = 1;
const T: Duration = Duration::from_secs(3);

/// Member 1 of a 3-member world of each host backend (the other members stay idle).
fn backends() -> &'static Vec<SharedComm> {
    static BACKENDS: OnceLock<Vec<SharedComm>> = OnceLock::new();
    BACKENDS.get_or_init(|| {
        let inproc = InProcessWorld::new(N, T).swap_remove(ME);
        let token = generate_token().unwrap();
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), token.clone()).unwrap();
        let addr = server.local_addr().to_string();
        let handles: Vec<_> = (0..N)
            .map(|r| {
                let (addr, token) = (addr.clone(), token.clone());
                std::thread::spawn(move || {
                    let store = StoreClient::connect(&addr, &token, T).unwrap();
                    TcpComm::connect(&store, r, N, "127.0.0.1", T).unwrap()
                })
            })
            .collect();
        let mut tcp: Vec<SharedComm> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // The idle members and the store live as long as the test process.
        let tcp_me = tcp.swap_remove(ME);
        std::mem::forget(tcp);
        std::mem::forget(server);
        vec![inproc, tcp_me]
    })
}

/// What is wrong with a call.
#[derive(Clone, Copy, Debug)]
enum Bad {
    /// A buffer one byte longer than whole elements.
    NotWhole,
    /// A buffer one element longer than the counts say.
    WrongLen,
    /// One count more than members.
    CountsLen,
    /// Counts whose sum overflows.
    CountsOverflow,
    /// A root or peer that is not a member.
    NotMember,
    /// Device memory on a host backend.
    Device,
    /// What a member sends itself differs from what it expects.
    Own,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    BufferSize,
    InvalidArgument,
    Unsupported,
    Mismatch,
}

fn variant(e: &CommError) -> Option<Variant> {
    match e {
        CommError::BufferSize { .. } => Some(Variant::BufferSize),
        CommError::InvalidArgument { .. } => Some(Variant::InvalidArgument),
        CommError::Unsupported { .. } => Some(Variant::Unsupported),
        CommError::Mismatch { .. } => Some(Variant::Mismatch),
        _ => None,
    }
}

const OPS: [&str; 14] = [
    "all_reduce",
    "all_reduce_into",
    "all_gather_v",
    "reduce_scatter_v",
    "all_to_all_v",
    "all_to_all_v_others",
    "all_to_all_v_strided",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "all_gather",
    "reduce_scatter",
    "sub_group",
];

/// The error a bad call must get, or None when `bad` does not apply to `op`.
fn expected(op: &str, bad: Bad) -> Option<Variant> {
    use Variant::*;
    let counted = matches!(
        op,
        "all_gather_v" | "reduce_scatter_v" | "all_to_all_v" | "all_to_all_v_others"
    );
    let rooted = matches!(op, "broadcast" | "reduce" | "send" | "recv");
    let a2a = op.starts_with("all_to_all");
    match bad {
        Bad::NotWhole if op != "sub_group" => Some(BufferSize),
        Bad::WrongLen if counted || matches!(op, "all_reduce_into" | "all_to_all_v_strided") => {
            Some(BufferSize)
        }
        Bad::WrongLen if matches!(op, "all_gather" | "reduce_scatter") => Some(BufferSize),
        Bad::CountsLen | Bad::CountsOverflow if counted || op == "sub_group" => {
            Some(InvalidArgument)
        }
        Bad::NotMember if rooted || op == "sub_group" => Some(InvalidArgument),
        Bad::Device if op != "sub_group" => Some(Unsupported),
        Bad::Own if a2a => Some(Mismatch),
        _ => None,
    }
}

fn dev<'a>(bytes: usize) -> DevicePtr<'a> {
    // SAFETY: host backends refuse device buffers without touching them.
    unsafe { DevicePtr::new(0x1000, bytes, 0) }
}

/// `len` bytes of `a`, or a device buffer of that length.
fn read_buf(device: bool, a: &[u8], len: usize) -> Buf<'_> {
    if device {
        Buf::Device(dev(len))
    } else {
        Buf::Host(&a[..len])
    }
}

/// Runs `op` with arguments made bad by `bad` (counts of `c` elements per member).
fn call(comm: &SharedComm, op: &str, bad: Bad, dtype: DType, c: usize) -> Result<(), CommError> {
    let esz = dtype.size();
    let extra = match bad {
        Bad::NotWhole => 1,
        Bad::WrongLen => esz,
        _ => 0,
    };
    let mut counts = vec![c; N];
    match bad {
        Bad::CountsLen => counts.push(c),
        Bad::CountsOverflow => counts[0] = usize::MAX,
        _ => {}
    }
    let mut recv_counts = vec![c; N];
    if let Bad::Own = bad {
        recv_counts[ME] += 1;
    }
    let total = c * N;
    let member = if let Bad::NotMember = bad { N + 5 } else { 0 };
    // The buffer the corruption applies to (the send buffer where there are two).
    let mut a = vec![0u8; total * esz + extra];
    let mut b = vec![0u8; (total + N) * esz];
    let device = matches!(bad, Bad::Device);
    let send = |len: usize, a| read_buf(device, a, len + extra);
    let rsum: usize = recv_counts.iter().sum();
    let sum = |v: &[usize]| v.iter().fold(0usize, |x, y| x.saturating_add(*y));
    let op_ = ReduceOp::Sum;
    match op {
        "all_reduce" => {
            let buf = if device {
                BufMut::Device(dev(c * esz + extra))
            } else {
                BufMut::Host(&mut a[..c * esz + extra])
            };
            comm.all_reduce(dtype, buf, op_)
        }
        "all_reduce_into" => {
            comm.all_reduce_into(dtype, send(c * esz, &a), (&mut b[..c * esz]).into(), op_)
        }
        "all_gather_v" => comm.all_gather_v(
            dtype,
            send(c * esz, &a),
            (&mut b[..total * esz]).into(),
            &counts,
        ),
        "reduce_scatter_v" => comm.reduce_scatter_v(
            dtype,
            send(total * esz, &a),
            (&mut b[..c * esz]).into(),
            &counts,
            op_,
        ),
        "all_to_all_v" => comm.all_to_all_v(
            dtype,
            send(sum(&counts).min(total) * esz, &a),
            &counts,
            (&mut b[..rsum * esz]).into(),
            &recv_counts,
        ),
        "all_to_all_v_others" => comm.all_to_all_v_others(
            dtype,
            send((total - c) * esz, &a),
            &counts,
            (&mut b[..rsum * esz]).into(),
            &recv_counts,
        ),
        "all_to_all_v_strided" => {
            let layout: Vec<StridedBlock> =
                (0..N).map(|j| StridedBlock::contiguous(j * c, c)).collect();
            comm.all_to_all_v_strided(
                dtype,
                send(total * esz, &a),
                &layout,
                (&mut b[..rsum * esz + extra]).into(),
                &recv_counts,
            )
        }
        "broadcast" | "reduce" | "recv" => {
            let buf = if device {
                BufMut::Device(dev(c * esz + extra))
            } else {
                BufMut::Host(&mut a[..c * esz + extra])
            };
            match op {
                "broadcast" => comm.broadcast(dtype, buf, member),
                "reduce" => comm.reduce(dtype, buf, member, op_),
                _ => comm.recv(dtype, buf, member),
            }
        }
        "send" => comm.send(dtype, send(c * esz, &a), member),
        "all_gather" => comm.all_gather(
            dtype,
            send(c * esz, &a),
            (&mut b[..total * esz + extra]).into(),
        ),
        "reduce_scatter" => comm.reduce_scatter(
            dtype,
            send(total * esz, &a),
            (&mut b[..c * esz]).into(),
            op_,
        ),
        _ => {
            let members: Vec<usize> = match bad {
                Bad::CountsLen => vec![0, ME, ME],
                Bad::CountsOverflow => vec![0, 2],
                _ => vec![ME, N + 2],
            };
            comm.sub_group(&members).map(|_| ())
        }
    }
}

fn bad_of(i: usize) -> Bad {
    [
        Bad::NotWhole,
        Bad::WrongLen,
        Bad::CountsLen,
        Bad::CountsOverflow,
        Bad::NotMember,
        Bad::Device,
        Bad::Own,
    ][i]
}

fn dtype_of(i: usize) -> DType {
    DType::ALL[i]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn bad_arguments_get_the_same_typed_error_on_every_backend(
        op in 0usize..OPS.len(), bad in 0usize..7, dt in 0usize..DType::ALL.len(), c in 1usize..6,
    ) {
        let (op, bad, dtype) = (OPS[op], bad_of(bad), dtype_of(dt));
        let Some(want) = expected(op, bad) else { return Ok(()) };
        let mut seen: Vec<CommError> = Vec::new();
        for comm in backends() {
            let t = Instant::now();
            let err = call(comm, op, bad, dtype, c)
                .expect_err(&format!("{op} with {bad:?} on {} succeeded", comm.backend()));
            prop_assert!(t.elapsed() < T / 2, "{op} on {} waited: {err}", comm.backend());
            prop_assert_eq!(variant(&err), Some(want), "{} on {}: {}", op, comm.backend(), err);
            seen.push(err);
        }
        // Same op name and detail everywhere (Unsupported names its backend, so compare the
        // rest of the message).
        let texts: Vec<String> = seen
            .iter()
            .zip(backends())
            .map(|(e, c)| e.to_string().replace(&format!("the {} backend", c.backend()), "the backend"))
            .collect();
        prop_assert!(texts.windows(2).all(|w| w[0] == w[1]), "{:?}", texts);
    }
}

#[test]
fn every_public_call_reaches_the_boundary_checks() {
    // Each op has at least one corruption the boundary rejects (no op bypasses the checks).
    for op in OPS {
        let covered = (0..7)
            .filter(|&b| expected(op, bad_of(b)).is_some())
            .count();
        assert!(
            covered >= 2,
            "{op}: only {covered} kinds of bad arguments covered"
        );
        for b in 0..7 {
            if expected(op, bad_of(b)).is_some() {
                for comm in backends() {
                    assert!(call(comm, op, bad_of(b), DType::F32, 2).is_err());
                }
            }
        }
    }
}

#[test]
fn one_way_channels_check_their_pair_alike_on_every_backend() {
    let cases: [(usize, usize, &str); 3] = [
        (ME, ME, "to itself"),
        (0, 2, "opens the channel from 0 to 2"),
        (0, N + 2, "is not a member"),
    ];
    for (from, to, want) in cases {
        let texts: Vec<String> = backends()
            .iter()
            .map(|c| match c.one_way(from, to) {
                Err(e @ CommError::InvalidArgument { .. }) => e.to_string(),
                other => panic!("one_way({from}, {to}): {:?}", other.map(|_| "a channel")),
            })
            .collect();
        assert!(texts[0].contains(want), "{}", texts[0]);
        assert!(texts.windows(2).all(|w| w[0] == w[1]), "{texts:?}");
    }
}

#[test]
fn one_way_channels_carry_each_direction_on_their_own() {
    let world = InProcessWorld::new(2, T);
    let handles: Vec<_> = world
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            std::thread::spawn(move || {
                let comm: SharedComm = comm;
                let there = comm.one_way(0, 1).unwrap();
                let back = comm.one_way(1, 0).unwrap();
                assert_eq!(there.world_ranks(), &[0, 1]);
                assert_eq!(back.world_ranks(), &[1, 0]);
                // Both send first: one-way channels of a host backend buffer their sends.
                let mine = [r as u8 + 1; 8];
                let mut got = [0u8; 8];
                if r == 0 {
                    there.send(DType::F32, Buf::Host(&mine), 1).unwrap();
                    back.recv(DType::F32, BufMut::Host(&mut got), 0).unwrap();
                } else {
                    back.send(DType::F32, Buf::Host(&mine), 1).unwrap();
                    there.recv(DType::F32, BufMut::Host(&mut got), 0).unwrap();
                }
                got
            })
        })
        .collect();
    let got: Vec<[u8; 8]> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(got, [[2u8; 8], [1u8; 8]]);
}
