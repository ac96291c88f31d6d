//! Real processes meeting through the store: this test binary re-runs itself as the workers,
//! which find the store through the launch contract (`LaunchEnv::from_env`). Also a rank that
//! never arrives: every other rank fails within the timeout with an error naming it.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxiflow_collectives::env::{one_host_launch_vars, LaunchEnv};
use oxiflow_collectives::rendezvous::{generate_token, StoreClient, StoreServer};
use oxiflow_collectives::CommError;

const TEST_NAME: &str = "processes_meet_through_the_store";

/// Worker side: publish an address, meet at a barrier, read every peer's address.
fn worker(env: &LaunchEnv) -> i32 {
    let token = env.require_token().unwrap();
    let c = StoreClient::connect(&env.store_addr(), token, env.timeout).unwrap();
    let rank = env.rank;
    c.set(&format!("addr/{rank}"), format!("host-{rank}").as_bytes())
        .unwrap();
    c.add("arrived", 1).unwrap();
    match c.barrier_as("start", rank, env.world_size, env.timeout) {
        Ok(()) => {}
        Err(e) => {
            let code = if matches!(e, CommError::Timeout { .. }) {
                3
            } else {
                4
            };
            c.set(&format!("fail/{rank}"), e.to_string().as_bytes())
                .unwrap();
            return code;
        }
    }
    let keys: Vec<String> = (0..env.world_size).map(|r| format!("addr/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = c.wait(&refs, env.timeout).unwrap();
    for (r, v) in values.iter().enumerate() {
        assert_eq!(v, format!("host-{r}").as_bytes());
    }
    c.set(&format!("ok/{rank}"), b"1").unwrap();
    0
}

fn spawn(server: &StoreServer, token: &str, rank: usize, world: usize, timeout_s: &str) -> Child {
    let exe = std::env::current_exe().unwrap();
    Command::new(exe)
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env_clear()
        .envs(one_host_launch_vars(
            rank,
            world,
            server.local_addr(),
            token,
        ))
        .env("OXIFLOW_TIMEOUT", timeout_s)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Waits for a child with a deadline; kills it if it overruns.
fn wait_child(mut child: Child, limit: Duration) -> i32 {
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("worker did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn processes_meet_through_the_store() {
    let env = LaunchEnv::from_env().unwrap();
    if env.token.is_some() && env.world_size > 1 {
        // We are a worker started below.
        std::process::exit(worker(&env));
    }
    let token = generate_token().unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), token.clone()).unwrap();
    let store = StoreClient::connect(
        &server.local_addr().to_string(),
        &token,
        Duration::from_secs(10),
    )
    .unwrap();

    // Four ranks meet.
    let world = 4;
    let children: Vec<Child> = (0..world)
        .map(|r| spawn(&server, &token, r, world, "30"))
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        assert_eq!(wait_child(child, Duration::from_secs(60)), 0, "rank {r}");
    }
    assert_eq!(store.get("arrived").unwrap(), Some(b"4".to_vec()));
    for r in 0..world {
        assert!(store.get(&format!("ok/{r}")).unwrap().is_some());
    }

    // Rank 3 never comes: the others fail within the 3 s timeout naming it.
    let store2_token = generate_token().unwrap();
    let server2 = StoreServer::bind("127.0.0.1:0".parse().unwrap(), store2_token.clone()).unwrap();
    let t0 = Instant::now();
    let children: Vec<Child> = (0..3)
        .map(|r| spawn(&server2, &store2_token, r, 4, "3"))
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        assert_eq!(
            wait_child(child, Duration::from_secs(30)),
            3,
            "rank {r} should time out"
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let c2 = StoreClient::connect(
        &server2.local_addr().to_string(),
        &store2_token,
        Duration::from_secs(10),
    )
    .unwrap();
    for r in 0..3 {
        let msg = String::from_utf8(c2.get(&format!("fail/{r}")).unwrap().unwrap()).unwrap();
        assert!(msg.contains("waiting for rank(s) [3]"), "rank {r}: {msg}");
        assert!(msg.contains("barrier \"start\""), "rank {r}: {msg}");
    }
}
