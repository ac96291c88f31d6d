//! Fuzzing the decoders of bytes from the network and shared memory (proptest-driven, a fixed
//! number of cases seeded from `fuzz/corpus/`): the TCP frame header and bootstrap hello, the
//! shared-memory slot words, and the rendezvous store's requests, both as protobuf bytes and
//! sent to a live store. Every input must decode to a value or an error, never a panic, and
//! the decoders must accept exactly what the encoders produce.

mod fuzz_input;

use std::time::Duration;

use oxiflow::collectives::rendezvous::proto;
use oxiflow::collectives::rendezvous::{StoreClient, StoreServer};
use oxiflow::collectives::shm_wire::{post_ready, seal_of, sealed_info, INFO_WORDS};
use oxiflow::collectives::tcp::wire::{self, HEADER, HELLO, MAGIC, NONCE};
use proptest::prelude::*;
use prost::Message;

use fuzz_input::input;

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn padded<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    for (d, s) in a.iter_mut().zip(b) {
        *d = *s;
    }
    a
}

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn tcp_frame_headers_decode_to_what_was_encoded(bytes in input("tcp_header", 64)) {
        let h: [u8; HEADER] = padded(&bytes);
        let (magic, p2p, group, seq, len) = wire::decode_frame_header(&h);
        // A header the engine accepts (magic) is exactly the encoding of its fields, so no two
        // byte strings pass as the same message and no bits are ignored.
        if magic == MAGIC && (h[4..8] == [0, 0, 0, 0] || h[4..8] == [1, 0, 0, 0]) {
            if let Ok(len) = usize::try_from(len) {
                prop_assert_eq!(wire::encode_frame_header(p2p, group, seq, len), h);
            }
        }
    }

    #[test]
    fn tcp_hellos_are_accepted_only_from_this_job(bytes in input("hello", 96), world in 1usize..1 << 20) {
        let nonce: [u8; NONCE] = padded(&bytes);
        let h: [u8; HELLO] = padded(bytes.get(NONCE..).unwrap_or(&[]));
        if let Some(rank) = wire::decode_hello(&h, &nonce, world) {
            prop_assert_eq!(wire::encode_hello(&nonce, rank, world), h);
        }
        // Any other nonce refuses it.
        let mut other = nonce;
        other[0] ^= 1;
        prop_assert_eq!(wire::decode_hello(&h, &other, world), None);
    }

    #[test]
    fn shm_slot_words_decode_only_when_sealed(bytes in input("shm_info", 96), group in any::<u64>(), phase in 0u64..256) {
        let w: [u8; 8 * (INFO_WORDS + 1)] = padded(&bytes);
        let word = |i: usize| u64::from_le_bytes(padded(&w[8 * i..8 * i + 8]));
        let info: [u64; INFO_WORDS] = std::array::from_fn(word);
        let seal = word(INFO_WORDS);
        let whole = seal == seal_of(&info);
        prop_assert_eq!(sealed_info(&info, seal, group).is_some(), whole && info[0] == group);
        prop_assert_eq!(sealed_info(&info, seal, info[0]).is_some(), whole);
        // The post word: the tag's high bits must match and its phase must have been reached.
        let (posted, want) = (info[1], info[2]);
        prop_assert_eq!(
            post_ready(posted, want, phase),
            posted >> 8 == want >> 8 && posted & 0xff >= phase
        );
    }

    #[test]
    fn store_requests_decode_or_fail_as_protobuf(bytes in input("store_request", 256)) {
        let (kind, body) = bytes.split_first().map_or((0, &[][..]), |(k, b)| (*k, b));
        // Each request type, whichever the kind byte says: protobuf decoding is total.
        let _ = proto::SetRequest::decode(body);
        let _ = proto::GetRequest::decode(body);
        let _ = proto::WaitRequest::decode(body);
        let _ = proto::AddRequest::decode(body);
        let _ = proto::DeleteRequest::decode(body);
        let _ = proto::BarrierRequest::decode(body);
        let _ = proto::CompareSetRequest::decode(body);
        if kind == 0 {
            if let Ok(r) = proto::SetRequest::decode(body) {
                prop_assert_eq!(proto::SetRequest::decode(r.encode_to_vec().as_slice()).ok(), Some(r));
            }
        }
    }
}

/// A request a hostile or confused peer could send, decoded from fuzz bytes.
fn request_from(bytes: &[u8]) -> Option<(u8, Vec<u8>)> {
    let (kind, body) = bytes.split_first()?;
    Some((*kind % 7, body.to_vec()))
}

fn key_of(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Sends decoded fuzz requests to a live store: each call returns a value or an error, and the
/// store keeps serving (a last set and get round-trip).
#[test]
fn a_live_store_answers_every_fuzzed_request() {
    let token = oxiflow::collectives::rendezvous::generate_token().unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), token.clone()).unwrap();
    let addr = server.local_addr().to_string();
    let client = StoreClient::connect(&addr, &token, Duration::from_secs(10)).unwrap();
    let short = Duration::from_millis(20);
    let mut runner = proptest::test_runner::TestRunner::new(cases(160));
    runner
        .run(&input("store_request", 256), |bytes| {
            let Some((kind, body)) = request_from(&bytes) else {
                return Ok(());
            };
            match kind {
                0 => {
                    if let Ok(r) = proto::SetRequest::decode(body.as_slice()) {
                        let _ = client.set(&r.key, &r.value);
                    }
                }
                1 => {
                    if let Ok(r) = proto::GetRequest::decode(body.as_slice()) {
                        let _ = client.get(&r.key);
                    }
                }
                2 => {
                    if let Ok(r) = proto::WaitRequest::decode(body.as_slice()) {
                        let keys: Vec<&str> = r.keys.iter().map(String::as_str).collect();
                        let _ = client.wait(&keys, short);
                    }
                }
                3 => {
                    if let Ok(r) = proto::AddRequest::decode(body.as_slice()) {
                        let _ = client.add(&r.key, r.delta);
                    }
                }
                4 => {
                    if let Ok(r) = proto::DeleteRequest::decode(body.as_slice()) {
                        let _ = client.delete(&r.key);
                    }
                }
                5 => {
                    if let Ok(r) = proto::BarrierRequest::decode(body.as_slice()) {
                        let _ = client.barrier(&r.name, r.n as usize, short);
                    }
                }
                _ => {
                    if let Ok(r) = proto::CompareSetRequest::decode(body.as_slice()) {
                        let expected = (!r.expected_absent).then_some(r.expected.as_slice());
                        let _ = client.compare_set(&r.key, expected, &r.desired);
                    }
                }
            }
            // Raw keys from the bytes themselves (control characters, huge, empty).
            let _ = client.set(&key_of(&body), &body);
            Ok(())
        })
        .unwrap();
    client.set("after-fuzz", b"still serving").unwrap();
    assert_eq!(
        client.get("after-fuzz").unwrap().as_deref(),
        Some(&b"still serving"[..])
    );
    server.shutdown();
}
