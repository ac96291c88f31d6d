//! Real processes for the multi-process tests: the test binary re-runs itself as the ranks of a
//! local world (one `#[test]` selected by name and a role variable), with the launch contract's
//! variables set and the rendezvous store served by the test process.
#![allow(dead_code)] // each test crate uses the part it needs

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use oxiflow_collectives::env::one_host_launch_vars;
use oxiflow_collectives::rendezvous::{generate_token, StoreServer};

/// The variable `name`, empty when unset.
pub fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

/// In a process started with `role=worker`: runs `worker` and exits with status 1 naming its
/// error when it fails. Returns whether this process is a worker.
pub fn run_worker(role: &str, worker: impl FnOnce() -> Result<(), String>) -> bool {
    if var(role) != "worker" {
        return false;
    }
    if let Err(e) = worker() {
        eprintln!("WORKER FAILED: {e}");
        std::process::exit(1);
    }
    true
}

/// A world of `size` ranks on loopback: the rendezvous store they reach, served until the
/// world is waited for.
pub struct World {
    server: StoreServer,
    token: String,
    size: usize,
    exe: PathBuf,
}

impl World {
    pub fn new(size: usize) -> World {
        let token = generate_token().unwrap();
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), token.clone()).unwrap();
        World {
            server,
            token,
            size,
            exe: std::env::current_exe().unwrap(),
        }
    }

    /// This binary running only the test `entry` as rank `rank` of the CPU backend, with
    /// `OXIFLOW_TIMEOUT` `timeout_s`; stdout discarded, stderr kept.
    pub fn rank(&self, entry: &str, rank: usize, timeout_s: &str) -> Command {
        let store = self.server.local_addr();
        let mut c = Command::new(&self.exe);
        c.args([entry, "--exact", "--nocapture", "--test-threads=1"])
            .envs(one_host_launch_vars(rank, self.size, store, &self.token))
            .env("OXIFLOW_TIMEOUT", timeout_s)
            .env("OXIFLOW_BACKEND", "cpu")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }

    /// Waits for every (rank, child), then stops serving the store.
    pub fn wait(self, children: Vec<(usize, Child)>) -> Vec<(usize, Output)> {
        children
            .into_iter()
            .map(|(r, c)| (r, c.wait_with_output().unwrap()))
            .collect()
    }
}

/// Fails naming `what` and the first rank that did not exit successfully, with its stderr;
/// every rank's stderr is printed first.
pub fn assert_all_ok(outs: &[(usize, Output)], what: &str) {
    if outs.iter().any(|(_, o)| !o.status.success()) {
        for (r, o) in outs {
            eprintln!("{what}: rank {r}: {}", String::from_utf8_lossy(&o.stderr));
        }
    }
    for (r, o) in outs {
        assert!(
            o.status.success(),
            "{what}: rank {r} failed ({:?}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
