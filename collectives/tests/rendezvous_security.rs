//! Rendezvous store under hostile or broken input: wrong and missing tokens, oversized
//! messages and values, a full store, garbage bytes on the port, idle connections, the
//! connection cap, and binding only the address asked for. After each, a good client works.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use oxiflow_collectives::rendezvous::proto::store_client::StoreClient as RawClient;
use oxiflow_collectives::rendezvous::proto::SetRequest;
use oxiflow_collectives::rendezvous::{
    constant_time_eq, generate_token, ClientOptions, StoreClient, StoreConfig, StoreServer,
    TOKEN_METADATA_KEY,
};
use oxiflow_collectives::CommError;

const T: Duration = Duration::from_secs(10);

fn start_with(config: StoreConfig) -> (StoreServer, String) {
    let token = generate_token().unwrap();
    let server =
        StoreServer::bind_with("127.0.0.1:0".parse().unwrap(), token.clone(), config).unwrap();
    (server, token)
}

fn start() -> (StoreServer, String) {
    start_with(StoreConfig::default())
}

/// A store that holds 4 connections at the most.
fn start_capped() -> (StoreServer, String) {
    start_with(StoreConfig {
        max_connections: 4,
        ..StoreConfig::default()
    })
}

/// Reads from `s` until the server closes it: end-of-file or a reset within `within`. A read
/// that times out means the server kept the connection open, and fails the test.
fn assert_closed_by_server(s: &mut TcpStream, within: Duration, what: &str) {
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        let left = within.saturating_sub(t0.elapsed());
        assert!(
            !left.is_zero(),
            "{what}: the server kept the connection open"
        );
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return,
            // Whatever the server says before closing (its settings, a GOAWAY) is read past.
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                ) =>
            {
                return
            }
            Err(e) => panic!("{what}: the server kept the connection open ({e})"),
        }
    }
}

/// A connection the server has taken in: it sent the HTTP/2 preface and read the server's
/// first frame (its settings).
fn admitted_connection(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mut frame_header = [0u8; 9];
    s.read_exact(&mut frame_header).unwrap();
    assert_eq!(frame_header[3], 0x4, "the server's first frame is SETTINGS");
    s
}

/// A good client still gets answers.
fn assert_alive(server: &StoreServer, token: &str) {
    let c = StoreClient::connect(&server.local_addr().to_string(), token, T).unwrap();
    c.set("alive", b"yes").unwrap();
    assert_eq!(c.get("alive").unwrap(), Some(b"yes".to_vec()));
}

#[test]
fn tokens_are_64_hex_digits_and_distinct() {
    let a = generate_token().unwrap();
    let b = generate_token().unwrap();
    assert_eq!(a.len(), 64);
    assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b);
    assert!(constant_time_eq(a.as_bytes(), a.clone().as_bytes()));
    assert!(!constant_time_eq(a.as_bytes(), b.as_bytes()));
    assert!(!constant_time_eq(b"abc", b"abcd"));
}

#[test]
fn wrong_token_is_refused_with_a_clear_error() {
    let (server, token) = start();
    let addr = server.local_addr().to_string();
    let t0 = Instant::now();
    let err = StoreClient::connect(&addr, "not-the-job-token", T).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "a wrong token must fail at once, not retry"
    );
    assert!(matches!(err, CommError::Unauthenticated(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("wrong or missing token") && msg.contains(&addr),
        "{msg}"
    );
    assert!(
        !msg.contains(&token),
        "the error must not leak the real token: {msg}"
    );
    // A token that differs only in its last character is refused too.
    let mut near = token.clone();
    near.pop();
    near.push(if token.ends_with('0') { '1' } else { '0' });
    assert!(matches!(
        StoreClient::connect(&addr, &near, T),
        Err(CommError::Unauthenticated(_))
    ));
    assert_alive(&server, &token);
}

#[test]
fn requests_without_or_with_a_wrong_token_are_refused_per_rpc() {
    let (server, token) = start();
    let url = format!("http://{}", server.local_addr());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut raw = RawClient::connect(url).await.unwrap();
        let req = || SetRequest {
            key: "k".into(),
            value: b"v".to_vec(),
        };
        let status = raw.set(req()).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert!(
            status.message().contains("wrong or missing token"),
            "{}",
            status.message()
        );
        let mut bad = tonic::Request::new(req());
        bad.metadata_mut()
            .insert(TOKEN_METADATA_KEY, "0".repeat(64).parse().unwrap());
        assert_eq!(
            raw.set(bad).await.unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        let mut good = tonic::Request::new(req());
        good.metadata_mut()
            .insert(TOKEN_METADATA_KEY, token.parse().unwrap());
        raw.set(good).await.unwrap();
    });
    // The refused requests stored nothing; the accepted one did.
    let c = StoreClient::connect(&server.local_addr().to_string(), &token, T).unwrap();
    assert_eq!(c.get("k").unwrap(), Some(b"v".to_vec()));
}

#[test]
fn unusable_tokens_are_refused_locally() {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    for bad in ["", "has space", "tab\there", &"x".repeat(2000)] {
        assert!(StoreServer::bind(addr, bad.to_string()).is_err(), "{bad:?}");
        assert!(
            StoreClient::connect("127.0.0.1:1", bad, T).is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn oversized_message_is_refused_and_the_server_survives() {
    let (server, token) = start();
    // A client whose own cap allows 32 MiB sends a 20 MiB value to a 16 MiB server.
    let big_client = StoreClient::connect_with(
        &server.local_addr().to_string(),
        &token,
        T,
        ClientOptions {
            max_message_bytes: 32 << 20,
            ..ClientOptions::default()
        },
    )
    .unwrap();
    let err = big_client.set("huge", &vec![7u8; 20 << 20]).unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("too large"), "{err}");
    // The default client refuses before sending.
    let c = StoreClient::connect(&server.local_addr().to_string(), &token, T).unwrap();
    let err = c.set("huge", &vec![7u8; 17 << 20]).unwrap_err();
    assert!(
        err.to_string().contains("does not fit the message cap"),
        "{err}"
    );
    assert_eq!(c.get("huge").unwrap(), None);
    // Just under the value cap is fine.
    c.set("large", &vec![1u8; 8 << 20]).unwrap();
    assert_eq!(c.get("large").unwrap().map(|v| v.len()), Some(8 << 20));
    assert_alive(&server, &token);
}

#[test]
fn value_key_and_store_limits_are_enforced() {
    let (server, token) = start_with(StoreConfig {
        max_value_bytes: 1024,
        max_total_bytes: 8 * 1024,
        max_keys_per_wait: 4,
        ..StoreConfig::default()
    });
    let c = StoreClient::connect(&server.local_addr().to_string(), &token, T).unwrap();
    let err = c.set("v", &[0u8; 1025]).unwrap_err();
    assert!(
        err.to_string().contains("exceeds the limit of 1024 bytes"),
        "{err}"
    );
    for i in 0..8 {
        c.set(&format!("fill{i}"), &[0u8; 1000]).unwrap();
    }
    let err = c.set("one-too-many", &[0u8; 1000]).unwrap_err();
    assert!(
        err.to_string().contains("would exceed the store's limit"),
        "{err}"
    );
    // Replacing a value reuses its room; deleting frees it.
    c.set("fill0", &[1u8; 1000]).unwrap();
    assert!(c.delete("fill1").unwrap());
    c.set("one-too-many", &[0u8; 1000]).unwrap();
    let err = c.wait(&["a", "b", "c", "d", "e"], T).unwrap_err();
    assert!(
        err.to_string().contains("5 keys exceed the limit of 4"),
        "{err}"
    );
    assert_alive(&server, &token);
}

#[test]
fn garbage_bytes_and_idle_connections_do_not_take_the_server_down() {
    let (server, token) = start();
    let addr = server.local_addr();
    // Random bytes.
    let mut s = TcpStream::connect(addr).unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let noise: Vec<u8> = (0..65536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let _ = s.write_all(&noise);
    assert_closed_by_server(&mut s, T, "random bytes");
    // Plain HTTP/1.1.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_closed_by_server(&mut s, T, "an HTTP/1.1 request");
    // A valid HTTP/2 preface, then a frame header announcing a 16 MiB frame, then junk.
    let mut s = TcpStream::connect(addr).unwrap();
    let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    let _ = s.write_all(&[0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01]);
    let _ = s.write_all(&noise[..4096]);
    assert_closed_by_server(&mut s, T, "an oversized HTTP/2 frame");
    // Connections that say nothing and stay open.
    let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Half a request: the preface and then silence.
    let mut half = TcpStream::connect(addr).unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").unwrap();
    assert_alive(&server, &token);
    drop(idle);
    drop(half);
    assert_alive(&server, &token);
}

#[test]
fn connections_beyond_the_cap_are_closed() {
    let (server, token) = start_capped();
    let addr = server.local_addr();
    // Four clients that presented the token hold every slot.
    let holders: Vec<StoreClient> = (0..4)
        .map(|_| StoreClient::connect(&addr.to_string(), &token, T).unwrap())
        .collect();
    // The fifth connection is accepted by the kernel and closed by the server at once.
    let mut fifth = TcpStream::connect(addr).unwrap();
    assert_closed_by_server(
        &mut fifth,
        Duration::from_secs(2),
        "a connection over the cap",
    );
    let err =
        StoreClient::connect(&addr.to_string(), &token, Duration::from_millis(600)).unwrap_err();
    assert!(
        err.to_string().contains("no rendezvous store answered"),
        "{err}"
    );
    for h in &holders {
        h.set("still", b"served").unwrap();
    }
    // Closing the holders frees their slots (the client retries until one is free).
    drop(holders);
    assert_alive(&server, &token);
}

#[test]
fn at_the_cap_connections_without_the_token_make_room() {
    let (server, token) = start_capped();
    let addr = server.local_addr();
    let mut squatters: Vec<TcpStream> = (0..4).map(|_| admitted_connection(addr)).collect();
    // A client with the token gets in: the oldest squatter is closed for it.
    assert_alive(&server, &token);
    assert_closed_by_server(
        &mut squatters[0],
        T,
        "the oldest connection without the token",
    );
}

#[test]
fn a_peer_holds_a_bounded_number_of_connections_without_the_token() {
    let (server, token) = start_with(StoreConfig {
        max_pending_per_peer: 3,
        ..StoreConfig::default()
    });
    let addr = server.local_addr();
    let mut partial: Vec<TcpStream> = (0..5)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"P").unwrap();
            s
        })
        .collect();
    // The two oldest were closed to keep the peer at three.
    assert_closed_by_server(&mut partial[0], T, "the oldest partial preface");
    assert_closed_by_server(&mut partial[1], T, "the second oldest partial preface");
    assert_alive(&server, &token);
}

#[test]
fn a_flood_of_partial_prefaces_does_not_lock_out_the_job() {
    // More one-byte connections than the connection cap, all held open.
    let (server, token) = start();
    let addr = server.local_addr();
    let t0 = Instant::now();
    let flood: Vec<TcpStream> = (0..4200)
        .filter_map(|_| {
            let mut s = TcpStream::connect(addr).ok()?;
            s.write_all(b"P").ok()?;
            Some(s)
        })
        .collect();
    eprintln!(
        "{} one-byte connections opened in {:?}",
        flood.len(),
        t0.elapsed()
    );
    assert!(
        flood.len() > 4096,
        "only {} connections opened",
        flood.len()
    );
    let t0 = Instant::now();
    assert_alive(&server, &token);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the job's client waited {:?}",
        t0.elapsed()
    );
    eprintln!("a client with the token got in after {:?}", t0.elapsed());
}

/// An address of this host that is not loopback, if it has one (no packet is sent).
fn non_loopback_ip() -> Option<IpAddr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("10.255.255.254:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn binding_127_0_0_1_listens_on_that_address_only() {
    let (server, token) = start();
    let addr = server.local_addr();
    assert_eq!(addr.ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert_ne!(addr.port(), 0);
    // 127.0.0.2 is also this host's loopback, but not the address bound.
    let other = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)), addr.port());
    assert!(TcpStream::connect_timeout(&other, Duration::from_secs(1)).is_err());
    if let Some(ip) = non_loopback_ip() {
        let other = SocketAddr::new(ip, addr.port());
        assert!(
            TcpStream::connect_timeout(&other, Duration::from_secs(1)).is_err(),
            "the store answered on {other}"
        );
    }
    assert_alive(&server, &token);
    // Binding a busy port is an error naming the address.
    let err = StoreServer::bind(addr, token.clone()).unwrap_err();
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

#[test]
fn silent_connections_are_closed_and_free_their_slots() {
    let (server, token) = start_with(StoreConfig {
        max_connections: 4,
        handshake_timeout: Duration::from_millis(300),
        ..StoreConfig::default()
    });
    let addr = server.local_addr();
    let mut silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // The server closes them: reads see end-of-file, long before the 10 s bound.
    let t0 = Instant::now();
    for s in &mut silent {
        assert_closed_by_server(s, T, "a silent connection");
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "closed before the timeout: {:?}",
        t0.elapsed()
    );
    // Their slots are free although the sockets are still open on this side.
    assert_alive(&server, &token);
}
