//! Several oflaunch "nodes" on one machine: two network namespaces joined by a veth pair (the
//! store bound to the namespace's address), and loopback pairs for the refusal and failure
//! propagation paths.

mod common;
mod netns;

use std::process::Command;
use std::time::Duration;

use common::*;
use netns::NetPair;

const T: Duration = Duration::from_secs(90);
const TOKEN: &str = "multinode-test-token-0123456789abcdef";

const ADDR_A: &str = "10.77.0.1";

/// `ip netns exec NS oflaunch ARGS`.
fn oflaunch_in(ns: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, OFLAUNCH]).args(args);
    cmd
}

fn node_args<'a>(node: &'a str, nproc: &'a str, addr: &'a str, port: &'a str) -> Vec<&'a str> {
    vec![
        "--nnodes",
        "2",
        "--node-rank",
        node,
        "--nproc-per-node",
        nproc,
        "--master-addr",
        addr,
        "--master-port",
        port,
        "--backend",
        "cpu",
    ]
}

/// Starts node `node` of two on loopback with `nproc` workers, the token `token` (from a
/// file), `--timeout timeout` and then `tail`.
fn loopback_node(
    node: &str,
    nproc: &str,
    port: &str,
    (token, timeout): (&str, &str),
    tail: &[&str],
) -> Running {
    let mut args = node_args(node, nproc, "127.0.0.1", port);
    args.extend(["--token-file", token_file(token), "--timeout", timeout]);
    args.extend(tail);
    let mut cmd = Command::new(OFLAUNCH);
    cmd.args(&args);
    start(cmd)
}

#[test]
fn two_nodes_in_network_namespaces_rendezvous_and_exchange() {
    let Some(pair) = NetPair::create_or_skip("ofl", "10.77.0", "two_nodes_in_network_namespaces")
    else {
        return;
    };
    let dir = scratch("netns");
    let d = dir.to_str().unwrap();
    let mut a = node_args("0", "2", ADDR_A, "29500");
    a.extend([
        "--token-file",
        token_file(TOKEN),
        "--timeout",
        "30",
        WORKER,
        "store",
        d,
    ]);
    let mut b = node_args("1", "2", ADDR_A, "29500");
    b.extend(["--timeout", "30", WORKER, "store", d]);
    let node0 = start(oflaunch_in(&pair.a, &a));
    let mut cmd_b = oflaunch_in(&pair.b, &b);
    cmd_b.env("OXIFLOW_TOKEN", TOKEN); // the token from the environment this time
    let node1 = start(cmd_b);
    let r1 = node1.finish(T);
    let r0 = node0.finish(T);
    assert_eq!(r0.code(), 0, "node 0:\n{}", r0.stderr);
    assert_eq!(r1.code(), 0, "node 1:\n{}", r1.stderr);
    for rank in 0..4 {
        let v = std::fs::read_to_string(dir.join(format!("rank_{rank}.store"))).unwrap();
        assert_eq!(v.trim(), "ok values=4 wrong_token_refused=true");
        let kv = read_kv(&dir.join(format!("rank_{rank}.env")));
        assert_eq!(kv["RANK"], rank.to_string());
        assert_eq!(kv["WORLD_SIZE"], "4");
        assert_eq!(kv["LOCAL_RANK"], (rank % 2).to_string());
        assert_eq!(kv["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(kv["NODE_RANK"], (rank / 2).to_string());
        assert_eq!(kv["MASTER_ADDR"], ADDR_A);
        assert_eq!(kv["MASTER_PORT"], "29500");
        assert_eq!(kv["OXIFLOW_TOKEN"], TOKEN);
    }
}

/// Runs node 0 and node 1 (2 workers each) on loopback with the same trailing arguments.
fn two_loopback_nodes(tail: &[&str]) -> (Finished, Finished) {
    let port = free_port().to_string();
    let start_node = |node| loopback_node(node, "2", &port, (TOKEN, "30"), tail);
    let node0 = start_node("0");
    let node1 = start_node("1");
    let r1 = node1.finish(T);
    let r0 = node0.finish(T);
    (r0, r1)
}

fn failure_propagates(failing_rank: usize) {
    let dir = scratch("propagate");
    let d = dir.to_str().unwrap();
    // `failing_rank` exits 7 after 0.5 s; everyone else would sleep 60 s.
    let rank = failing_rank.to_string();
    let (r0, r1) = two_loopback_nodes(&[WORKER, "fail", d, &rank, "7"]);
    let failing_node = failing_rank / 2;
    let want = format!("first failure: rank {failing_rank} (node {failing_node}");
    for (node, r) in [(0, &r0), (1, &r1)] {
        assert_eq!(r.code(), 7, "node {node}:\n{}", r.stderr);
        assert!(r.stderr.contains(&want), "node {node}:\n{}", r.stderr);
        // The failing node showed the rank's lines on its console; the other node's summary
        // carries them.
        let line = if node == failing_node {
            format!("[rank {failing_rank}] the failure reason is 7\n")
        } else {
            "| the failure reason is 7\n".to_string()
        };
        assert!(r.stderr.contains(&line), "node {node}:\n{}", r.stderr);
    }
    let failed_at: u128 = std::fs::read_to_string(dir.join("failed_at_ms"))
        .unwrap()
        .parse()
        .unwrap();
    let other = if failing_node == 0 { &r1 } else { &r0 };
    let took = other.ended_ms.saturating_sub(failed_at);
    assert!(took < 5000, "the other node took {took} ms to stop");
    assert_workers_gone(&dir, 4);
}

#[test]
fn a_failure_on_node_1_stops_node_0() {
    failure_propagates(3);
}

#[test]
fn a_failure_on_node_0_stops_node_1() {
    failure_propagates(0);
}

#[test]
fn both_nodes_restart_together() {
    let dir = scratch("mnrestart");
    let d = dir.to_str().unwrap();
    let script = format!(
        "echo $RANK >> {d}/gen_$OXIFLOW_RESTART_COUNT; \
         if [ \"$OXIFLOW_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 2 ]; then exit 5; fi; \
         if [ \"$OXIFLOW_RESTART_COUNT\" = 0 ]; then sleep 30; fi; exit 0"
    );
    let (r0, r1) = two_loopback_nodes(&["--max-restarts", "1", "sh", "-c", &script]);
    assert_eq!(r0.code(), 0, "node 0:\n{}", r0.stderr);
    assert_eq!(r1.code(), 0, "node 1:\n{}", r1.stderr);
    let gen1 = std::fs::read_to_string(dir.join("gen_1")).unwrap();
    let mut ranks: Vec<&str> = gen1.lines().collect();
    ranks.sort_unstable();
    assert_eq!(ranks, ["0", "1", "2", "3"]);
}

/// A node's `--nproc-per-node` and its (token, timeout).
type NodeArgs<'a> = (&'a str, (&'a str, &'a str));

/// Nodes 0 and 1 on loopback started with `node0` and `node1`, their workers to write their
/// environment into a fresh folder `name`: both must exit 2 and no worker be started anywhere.
/// Their ends (node 0's, node 1's).
fn refused_nodes(name: &str, node0: NodeArgs, node1: NodeArgs) -> (Finished, Finished) {
    let dir = scratch(name);
    let d = dir.to_str().unwrap();
    let port = free_port().to_string();
    let tail = [WORKER, "env", d];
    let n0 = loopback_node("0", node0.0, &port, node0.1, &tail);
    let n1 = loopback_node("1", node1.0, &port, node1.1, &tail);
    let r1 = n1.finish(T);
    let r0 = n0.finish(T);
    assert_eq!(r1.code(), 2, "node 1:\n{}", r1.stderr);
    assert_eq!(r0.code(), 2, "node 0:\n{}", r0.stderr);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    (r0, r1)
}

#[test]
fn a_node_with_the_wrong_nproc_is_refused_on_both_sides() {
    let (r0, r1) = refused_nodes("wrongnproc", ("2", (TOKEN, "20")), ("3", (TOKEN, "20")));
    says(&r1, "refused");
    says(&r1, "--nproc-per-node 3");
    says(&r0, "node 1");
    says(&r0, "--nproc-per-node 3, expected");
}

#[test]
fn a_node_with_the_wrong_token_is_refused() {
    let (r0, r1) = refused_nodes(
        "wrongtoken",
        ("2", (TOKEN, "4")),
        ("2", ("not-the-job-token", "20")),
    );
    says(&r1, "rejected this node's token");
    says(&r0, "waiting for node(s) [1] to join");
}

/// oflaunch's own bound on a frozen node, as it measures it: 10 s and a margin for load.
const FROZEN_BOUND: f64 = 10.5;

/// Two loopback nodes of 2 workers doing all-reduces; once they run, node `frozen` (its
/// oflaunch, hence the store if it is node 0, and its workers) is stopped with SIGSTOP. Returns
/// the other node's end and how long after the freeze it came; the frozen node is killed.
fn freeze_a_node(frozen: usize) -> (Finished, f64) {
    let port = free_port().to_string();
    let tail = [WORKER, "allreduce", "100000000"];
    let start_node = |node| loopback_node(node, "2", &port, (TOKEN, "60"), &tail);
    let mut nodes = [Some(start_node("0")), Some(start_node("1"))];
    let pid_of = |n: &Option<Running>| n.as_ref().unwrap().child.id();
    let t0 = std::time::Instant::now();
    while (0..2).any(|n| children_of(pid_of(&nodes[n])).len() < 2) {
        assert!(t0.elapsed() < T, "workers did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Let the all-reduces and heartbeats run.
    std::thread::sleep(Duration::from_secs(2));
    let frozen_pid = pid_of(&nodes[frozen]);
    let mut frozen_pids = children_of(frozen_pid);
    frozen_pids.push(frozen_pid as i32);
    let frozen_at = std::time::Instant::now();
    signal(&frozen_pids, libc::SIGSTOP);
    let other = nodes[1 - frozen].take().unwrap();
    let other_workers = children_of(other.child.id());
    let r = other.finish(T);
    let took = frozen_at.elapsed().as_secs_f64();
    signal(&frozen_pids, libc::SIGKILL);
    let _ = nodes[frozen].take().unwrap().finish(T);
    for pid in other_workers.iter().chain(&frozen_pids) {
        let t = std::time::Instant::now();
        while alive(*pid) && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!alive(*pid), "process {pid} left running");
    }
    (r, took)
}

/// `freeze_a_node(frozen)`: the other node exits with `code` within the bound after the last
/// sign of life it measured, its stderr holding each of `says`.
fn the_other_node_ends(frozen: usize, code: i32, says: &[&str]) {
    let (r, took) = freeze_a_node(frozen);
    let measured = stopped_after(&r.stderr).expect("a measured end");
    eprintln!("node {frozen} frozen: the other node stopped its workers {measured:.1} s after the last sign of life, exited {took:.1} s after the freeze");
    assert_eq!(r.code(), code, "{}", r.stderr);
    for want in says {
        assert!(r.stderr.contains(want), "{want:?} in:\n{}", r.stderr);
    }
    assert!(measured <= FROZEN_BOUND, "{}", r.stderr);
}

#[test]
fn a_frozen_node_0_and_its_store_end_node_1_within_the_bound() {
    the_other_node_ends(
        0,
        1,
        &[
            "(served by node 0, where ranks 0-1 run) has not answered for",
            "(node 0 is frozen or gone)",
        ],
    );
}

#[test]
fn a_frozen_node_1_ends_node_0_within_the_bound_naming_its_ranks() {
    the_other_node_ends(
        1,
        124,
        &[
            "rank 2 (ranks [3] too) is frozen: its heartbeat stopped changing",
            "first failure: rank 2 (node 1",
        ],
    );
}

/// Two loopback nodes of 2 workers running `script`, `--timeout 60`.
fn two_script_nodes(script: &str) -> (Running, Running) {
    let port = free_port().to_string();
    let start_node = |node| loopback_node(node, "2", &port, (TOKEN, "60"), &["sh", "-c", script]);
    (start_node("0"), start_node("1"))
}

/// Waits until node 0's workers have started and ended (it has no children left after having
/// had them) and node 1's have started.
fn until_node_0_is_done(node0: &Running, node1: &Running) {
    let t0 = std::time::Instant::now();
    while children_of(node1.child.id()).len() < 2 || !children_of(node0.child.id()).is_empty() {
        assert!(t0.elapsed() < T, "the workers did not start and end");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Two nodes whose workers all succeed (node 1's 3 s after node 0's), node 0's oflaunch
/// stopped by SIGSTOP once its workers are done and node 1's run: (node 0, node 1, node 0's
/// oflaunch pid).
fn node_0_stopped_when_done() -> (Running, Running, i32) {
    let (node0, node1) = two_script_nodes("if [ \"$NODE_RANK\" = 1 ]; then sleep 3; fi; exit 0");
    until_node_0_is_done(&node0, &node1);
    let node0_pid = node0.child.id() as i32;
    signal(&[node0_pid], libc::SIGSTOP);
    (node0, node1, node0_pid)
}

/// Node 0's oflaunch (and its store) freezes near the end while every worker of both nodes
/// succeeds: node 1 keeps offering its news, saying so every 10 s, and once node 0 resumes both
/// exit 0, each within a second of the resume.
#[test]
fn nodes_agree_when_node_0_freezes_near_the_end() {
    let (node0, node1, node0_pid) = node_0_stopped_when_done();
    node1.wait_line("waiting for node 0's store at", T);
    signal(&[node0_pid], libc::SIGCONT);
    let resumed = std::time::Instant::now();
    let r1 = node1.finish(T);
    let r0 = node0.finish(T);
    for (node, r) in [(0, &r0), (1, &r1)] {
        let after = r.ended.duration_since(resumed);
        eprintln!("node {node} exited {after:?} after node 0 resumed");
        assert_eq!(r.code(), 0, "node {node}:\n{}", r.stderr);
        assert!(after < Duration::from_secs(3), "node {node}: {after:?}");
    }
    assert!(
        r1.stderr.contains(
            "oflaunch on node 1: this node's workers all finished; waiting for node 0's store at"
        ) && r1.stderr.contains("of at most 60 s (--timeout)"),
        "{}",
        r1.stderr
    );
    // Node 1's news got through: by its retry, or by the request that node 0 took on waking
    // (node 1 then found node 0 ended).
    never_says(&r1, "within --timeout");
}

/// Node 1's workers finish after node 0's store froze and then went away: node 1 still
/// succeeds, saying it could not report, within seconds of node 0's end (not at --timeout).
#[test]
fn a_node_whose_workers_finished_survives_a_store_that_is_gone() {
    let (node0, node1, node0_pid) = node_0_stopped_when_done();
    std::thread::sleep(Duration::from_secs(5));
    signal(&[node0_pid], libc::SIGKILL);
    let killed = std::time::Instant::now();
    let r1 = node1.finish(T);
    let _ = node0.finish(T);
    let took = r1.ended.duration_since(killed);
    eprintln!("node 1 exited {took:?} after node 0 was killed");
    assert_eq!(r1.code(), 0, "{}", r1.stderr);
    assert!(
        r1.stderr
            .contains("is gone (nothing listens there: node 0 has ended) without confirming"),
        "{}",
        r1.stderr
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
}
