//! Two "nodes" on one machine: two network namespaces joined by a veth pair, one `oflaunch` in
//! each with `--nnodes 2` and 2 workers, running `train` on the CPU backend with the data plane
//! forced onto TCP across the veth link. Rank 0's loss curve must equal the single-node
//! 4-worker run. Prints SKIP (and passes) only where namespaces cannot be created (not root).

mod common;
#[path = "../launcher/tests/netns/mod.rs"]
mod netns;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{argv, binaries, curve, launch, max_rel, ok};
use netns::NetPair;

const ADDR_A: &str = "10.78.0.1";
const TOKEN: &str = "two-node-train-test-token-0123456789abcdef";

fn node(ns: &str, node_rank: &str, train_args: &[&str]) -> std::process::Child {
    let (oflaunch, train) = binaries();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns])
        .arg(oflaunch)
        .args([
            "--nnodes",
            "2",
            "--node-rank",
            node_rank,
            "--nproc-per-node",
            "2",
        ])
        .args([
            "--master-addr",
            ADDR_A,
            "--master-port",
            "29611",
            "--backend",
            "cpu",
        ])
        .args(["--timeout", "60"])
        .env("OXIFLOW_TOKEN", TOKEN)
        .arg(train)
        .args(train_args)
        // Same machine, so shared memory would work across the namespaces; force the data
        // plane onto TCP so it really crosses the veth link like two hosts.
        .env("OXIFLOW_SHM", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().expect("spawn oflaunch in a namespace")
}

/// Waits for a child with a deadline, killing it past the deadline.
fn finish(mut child: std::process::Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("wait for oflaunch: {e}"),
        }
    }
    child.wait_with_output().expect("collect oflaunch output")
}

#[test]
fn two_nodes_in_namespaces_train_like_one_node() {
    let Some(ns) = NetPair::create_or_skip(
        "oxt",
        "10.78.0",
        "two_nodes_in_namespaces_train_like_one_node",
    ) else {
        return;
    };
    let args = argv("--model mlp --dp 2 --tp 2 --steps 50 --log-every 1 --seed 3");
    let single = curve(&ok(launch(4, &args)));
    assert_eq!(single.len(), 50);

    let n0 = node(&ns.a, "0", &args);
    let n1 = node(&ns.b, "1", &args);
    let limit = Duration::from_secs(240);
    let out1 = finish(n1, limit);
    let out0 = finish(n0, limit);
    assert!(
        out1.status.success(),
        "node 1 failed: {}\n{}",
        out1.status,
        String::from_utf8_lossy(&out1.stderr)
    );
    let text0 = ok(out0);
    let two = curve(&text0);
    let diff = max_rel(&single, &two);
    eprintln!(
        "two nodes x 2 workers (DP=2 x TP=2 over veth): loss {:.6} -> {:.6}, max relative difference to one node {diff:.3e}",
        two[0].1, two[49].1
    );
    assert!(diff < 1e-4, "two-node curve differs by {diff:e}");
}
