//! Rendezvous store semantics: set/get/wait/add/delete/compare-set/barrier, from one and from
//! many threads, wait and barrier timeouts naming what is missing, and server shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxiflow_collectives::rendezvous::{generate_token, StoreClient, StoreConfig, StoreServer};
use oxiflow_collectives::CommError;

const T: Duration = Duration::from_secs(10);

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn start() -> (StoreServer, String) {
    let token = generate_token().unwrap();
    let server = StoreServer::bind(loopback(), token.clone()).unwrap();
    (server, token)
}

fn client(server: &StoreServer, token: &str) -> StoreClient {
    StoreClient::connect(&server.local_addr().to_string(), token, T).unwrap()
}

/// Returns once `n` wait or barrier calls are blocked in the server (panics after `T`).
fn until_blocked_calls(server: &StoreServer, n: usize) {
    let t0 = Instant::now();
    while server.blocked_calls() < n {
        assert!(
            t0.elapsed() < T,
            "only {} of {n} calls reached the server",
            server.blocked_calls()
        );
        std::thread::yield_now();
    }
}

#[test]
fn set_get_delete_add_compare_set() {
    let (server, token) = start();
    let c = client(&server, &token);
    assert_eq!(c.get("a").unwrap(), None);
    c.set("a", b"hello").unwrap();
    assert_eq!(c.get("a").unwrap(), Some(b"hello".to_vec()));
    c.set("a", b"").unwrap();
    assert_eq!(
        c.get("a").unwrap(),
        Some(Vec::new()),
        "an empty value is a value"
    );
    assert!(c.delete("a").unwrap());
    assert!(!c.delete("a").unwrap());
    assert_eq!(c.get("a").unwrap(), None);

    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(c.add("n", -7).unwrap(), -2);
    assert_eq!(c.get("n").unwrap(), Some(b"-2".to_vec()));
    c.set("text", b"abc").unwrap();
    let err = c.add("text", 1).unwrap_err();
    assert!(err.to_string().contains("not a decimal integer"), "{err}");
    c.set("big", i64::MAX.to_string().as_bytes()).unwrap();
    let err = c.add("big", 1).unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");

    assert_eq!(
        c.compare_set("leader", None, b"r0").unwrap(),
        (true, Some(b"r0".to_vec()))
    );
    assert_eq!(
        c.compare_set("leader", None, b"r1").unwrap(),
        (false, Some(b"r0".to_vec()))
    );
    assert_eq!(
        c.compare_set("leader", Some(b"r0"), b"r2").unwrap(),
        (true, Some(b"r2".to_vec()))
    );
    assert_eq!(
        c.compare_set("nobody", Some(b"x"), b"y").unwrap(),
        (false, None)
    );
}

#[test]
fn empty_and_oversized_keys_are_refused() {
    let (server, token) = start();
    let c = client(&server, &token);
    let err = c.set("", b"x").unwrap_err();
    assert!(err.to_string().contains("empty key"), "{err}");
    let long = "k".repeat(5000);
    let err = c.get(&long).unwrap_err();
    assert!(
        err.to_string().contains("exceeds the limit of 4096"),
        "{err}"
    );
    assert!(matches!(err, CommError::InvalidArgument { .. }), "{err:?}");
}

#[test]
fn wait_returns_values_in_order_once_set_from_other_threads() {
    let (server, token) = start();
    let c = client(&server, &token);
    let waiter = c.clone();
    let h = std::thread::spawn(move || waiter.wait(&["k1", "k2"], T));
    until_blocked_calls(&server, 1);
    c.set("k2", b"two").unwrap();
    // One key is still missing: the wait stays blocked in the server.
    assert_eq!(c.get("k2").unwrap(), Some(b"two".to_vec()));
    assert_eq!(server.blocked_calls(), 1);
    assert!(!h.is_finished());
    c.set("k1", b"one").unwrap();
    let values = h.join().unwrap().unwrap();
    assert_eq!(values, vec![b"one".to_vec(), b"two".to_vec()]);
    assert!(c.wait(&[], Duration::ZERO).unwrap().is_empty());
}

#[test]
fn wait_timeout_names_the_missing_keys() {
    let (server, token) = start();
    let c = client(&server, &token);
    c.set("present", b"1").unwrap();
    let t0 = Instant::now();
    let err = c
        .wait(
            &["present", "absent/3", "absent/5"],
            Duration::from_millis(300),
        )
        .unwrap_err();
    let elapsed = t0.elapsed();
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    match &err {
        CommError::StoreTimeout { missing_keys, .. } => {
            assert_eq!(
                missing_keys,
                &vec!["absent/3".to_string(), "absent/5".to_string()]
            );
        }
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("absent/3") && msg.contains("absent/5") && !msg.contains("\"present\""),
        "{msg}"
    );
}

#[test]
fn long_waits_are_reissued_past_the_server_cap() {
    // The server caps each wait at 200 ms; a client wait still succeeds when the key comes
    // only after several capped calls.
    let token = generate_token().unwrap();
    let cap = Duration::from_millis(200);
    let config = StoreConfig {
        max_wait: cap,
        ..StoreConfig::default()
    };
    let server = StoreServer::bind_with(loopback(), token.clone(), config).unwrap();
    let c = client(&server, &token);
    let waiter = c.clone();
    let t0 = Instant::now();
    let h = std::thread::spawn(move || waiter.wait(&["late"], Duration::from_secs(10)));
    // Three server caps pass with the wait still blocked (re-issued, never failed).
    while t0.elapsed() < cap * 3 {
        until_blocked_calls(&server, 1);
        assert!(!h.is_finished(), "the wait ended before the key was set");
    }
    c.set("late", b"x").unwrap();
    assert_eq!(h.join().unwrap().unwrap(), vec![b"x".to_vec()]);
    // And a barrier spanning several capped calls completes exactly once per round.
    let c2 = c.clone();
    let t0 = Instant::now();
    let h = std::thread::spawn(move || c2.barrier("slow", 2, Duration::from_secs(10)));
    while t0.elapsed() < cap * 3 {
        until_blocked_calls(&server, 1);
        assert!(
            !h.is_finished(),
            "a barrier of 2 completed with one arrival"
        );
    }
    c.barrier("slow", 2, Duration::from_secs(10)).unwrap();
    h.join().unwrap().unwrap();
    // The next round needs both members again.
    let err = c
        .barrier("slow", 2, Duration::from_millis(300))
        .unwrap_err();
    assert!(err.to_string().contains("1 of 2 arrived"), "{err}");
}

#[test]
fn atomic_add_from_many_threads() {
    let (server, token) = start();
    let c = Arc::new(client(&server, &token));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let c = Arc::clone(&c);
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                for _ in 0..25 {
                    seen.push(c.add("counter", 1).unwrap());
                }
                seen
            })
        })
        .collect();
    let mut all: Vec<i64> = threads
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (1..=200).collect::<Vec<i64>>(),
        "every add saw a distinct value"
    );
}

#[test]
fn barrier_across_threads_is_reusable() {
    let (server, token) = start();
    let addr = server.local_addr().to_string();
    let n = 6;
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let addr = addr.clone();
            let token = token.clone();
            std::thread::spawn(move || {
                let c = StoreClient::connect(&addr, &token, T).unwrap();
                for round in 0..3 {
                    c.set(&format!("r{round}/{rank}"), b"x").unwrap();
                    c.barrier_as("step", rank, n, T).unwrap();
                    // After the barrier every rank's key of this round exists.
                    for other in 0..n {
                        assert!(c.get(&format!("r{round}/{other}")).unwrap().is_some());
                    }
                }
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
}

#[test]
fn barrier_timeout_names_missing_ranks_and_withdraws_arrivals() {
    let (server, token) = start();
    let c = client(&server, &token);
    let c1 = c.clone();
    let h = std::thread::spawn(move || c1.barrier_as("b", 1, 4, Duration::from_secs(1)));
    until_blocked_calls(&server, 1);
    let err = c
        .barrier_as("b", 3, 4, Duration::from_millis(300))
        .unwrap_err();
    let other = h.join().unwrap().unwrap_err();
    for e in [&err, &other] {
        match e {
            CommError::Timeout { missing, .. } => assert_eq!(missing, &vec![0, 2]),
            e => panic!("expected Timeout, got {e:?}"),
        }
        assert!(e.to_string().contains("2 of 4 arrived"), "{e}");
    }
    // Timed-out arrivals were withdrawn: a fresh round needs all four again.
    let err = c.barrier("b", 4, Duration::from_millis(200)).unwrap_err();
    assert!(err.to_string().contains("1 of 4 arrived"), "{err}");
    // Members disagreeing on n are refused.
    let c2 = c.clone();
    let h = std::thread::spawn(move || c2.barrier("nb", 3, Duration::from_secs(2)));
    until_blocked_calls(&server, 1);
    let err = c.barrier("nb", 2, Duration::from_millis(200)).unwrap_err();
    assert!(
        err.to_string()
            .contains("expects 2 members but earlier arrivals expect 3"),
        "{err}"
    );
    assert!(h.join().unwrap().is_err());
    // A rank outside 0..n is refused before anything is sent.
    assert!(c.barrier_as("b", 4, 4, T).is_err());
}

#[test]
fn shutdown_frees_the_port_and_fails_pending_waits() {
    let (server, token) = start();
    let addr = server.local_addr();
    let c = client(&server, &token);
    let waiter = c.clone();
    let h = std::thread::spawn(move || waiter.wait(&["never"], Duration::from_secs(20)));
    until_blocked_calls(&server, 1);
    let t0 = Instant::now();
    server.shutdown();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "shutdown took {:?}",
        t0.elapsed()
    );
    let err = h.join().unwrap().unwrap_err();
    assert!(matches!(err, CommError::Rendezvous(_)), "{err:?}");
    // The port is free again: bind it anew.
    let again = StoreServer::bind(addr, token.clone()).unwrap();
    assert_eq!(again.local_addr(), addr);
    // A client of the old server reconnects to the new one transparently.
    c.set("x", b"1").unwrap();
}

#[test]
fn connect_retries_until_the_server_is_up_and_times_out_otherwise() {
    let token = generate_token().unwrap();
    // Something that is not a store holds the port first: it accepts and hangs up.
    let impostor = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = impostor.local_addr().unwrap();
    let t2 = token.clone();
    let h = std::thread::spawn(move || StoreClient::connect(&addr.to_string(), &t2, T));
    // The client tried once and found no store; only now does the store come up.
    let (first_try, _) = impostor.accept().unwrap();
    drop(first_try);
    drop(impostor);
    let server = StoreServer::bind(addr, token.clone()).unwrap();
    let c = h.join().unwrap().unwrap();
    c.set("up", b"1").unwrap();
    drop(server);

    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let t0 = Instant::now();
    let err =
        StoreClient::connect(&dead.to_string(), &token, Duration::from_millis(300)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(
        err.to_string().contains("no rendezvous store answered"),
        "{err}"
    );
}

#[test]
fn client_works_from_inside_a_tokio_runtime() {
    let (server, token) = start();
    let addr = server.local_addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let c = StoreClient::connect(&addr, &token, T).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(c.get("k").unwrap(), Some(b"v".to_vec()));
        drop(c);
    });
}

#[test]
fn prefixed_handles_are_separate_key_spaces() {
    let (server, token) = start();
    let plain = client(&server, &token);
    let g0 = plain.with_prefix("job/g0/");
    let g1 = plain.with_prefix("job/g1/");
    g0.set("addr/0", b"old").unwrap();
    assert_eq!(
        g1.get("addr/0").unwrap(),
        None,
        "a restart must not see the last generation"
    );
    assert_eq!(plain.get("job/g0/addr/0").unwrap(), Some(b"old".to_vec()));
    g1.set("addr/0", b"new").unwrap();
    assert_eq!(g1.wait(&["addr/0"], T).unwrap(), vec![b"new".to_vec()]);
    assert_eq!(g0.add("n", 2).unwrap(), 2);
    assert_eq!(g1.add("n", 5).unwrap(), 5);
    assert_eq!(g1.with_prefix("sub/").prefix(), "job/g1/sub/");
    let e = g1
        .wait(&["missing"], Duration::from_millis(200))
        .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
}
