//! `oflaunch --trace DIR`: a 4-rank DP2xTP2 `train` run writes one Chrome trace per rank and
//! oflaunch merges them into DIR/trace.json, one timeline with the ops, boxing steps and
//! collectives (with their bytes) of every rank; on a GPU, the kernels on the compute stream
//! land on their own lane, on the host's clock.

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::binaries;
use serde_json::Value;

#[test]
fn a_dp2_tp2_train_step_is_traced_on_one_timeline() {
    let dir = std::env::temp_dir().join(format!("oxiflow_trace_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (oflaunch, train) = binaries();
    let out = Command::new(oflaunch)
        .args(["--nproc-per-node", "4", "--backend", "cpu", "--trace"])
        .arg(&dir)
        .arg(train)
        .args(["--steps", "2", "--dp", "2", "--tp", "2"])
        .output()
        .expect("run oflaunch");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("merged the traces of ranks [0, 1, 2, 3]"),
        "{stderr}"
    );
    for r in 0..4 {
        assert!(dir.join(format!("rank-{r}.json")).is_file(), "rank {r}");
    }

    let merged: Value =
        serde_json::from_slice(&std::fs::read(dir.join("trace.json")).unwrap()).unwrap();
    let events = merged["traceEvents"].as_array().expect("traceEvents");
    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let pids = |cat: &str| -> BTreeSet<u64> {
        complete
            .iter()
            .filter(|e| e["cat"] == cat)
            .filter_map(|e| e["pid"].as_u64())
            .collect()
    };
    let all: BTreeSet<u64> = (0..4).collect();
    assert_eq!(pids("ops"), all);
    assert_eq!(pids("boxing"), all);
    assert_eq!(pids("collectives"), all);
    let boxing_bytes = complete
        .iter()
        .filter(|e| e["cat"] == "boxing")
        .filter_map(|e| e["args"]["bytes_max"].as_u64())
        .max();
    assert!(boxing_bytes.is_some_and(|b| b > 0), "no boxing bytes");
    assert!(complete
        .iter()
        .filter(|e| e["cat"] == "collectives")
        .all(|e| e["args"]["bytes"].is_u64() && e["args"]["group"].is_array()));
    // One timeline: every event has a time and a duration, and they are in time order.
    let times: Vec<u64> = complete.iter().map(|e| e["ts"].as_u64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]));
    assert!(complete.iter().all(|e| e["dur"].is_u64()));
    let names: BTreeSet<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "boxing",
            "collectives",
            "ops",
            "cuda compute stream",
            "cuda nccl stream"
        ]),
        "lane names"
    );
    // A CPU run has nothing on the device lanes.
    assert!(complete.iter().all(|e| e["tid"].as_u64() <= Some(3)));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cuda_train_step_puts_its_kernels_on_the_device_lane() {
    if let Some(why) = oxiflow::cuda::cuda_unavailable() {
        eprintln!("trace_timeline cuda: skipped: {why}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("oxiflow_trace_cuda_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (oflaunch, train) = binaries();
    let out = Command::new(oflaunch)
        .args(["--nproc-per-node", "1", "--trace"])
        .arg(&dir)
        .arg(train)
        .args(["--steps", "3", "--device", "cuda"])
        .env("NCCL_NVLS_ENABLE", "0")
        .output()
        .expect("run oflaunch");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let merged: Value =
        serde_json::from_slice(&std::fs::read(dir.join("trace.json")).unwrap()).unwrap();
    let events = merged["traceEvents"].as_array().expect("traceEvents");
    let lane = |cat: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == cat)
            .collect()
    };
    let (host, device) = (lane("ops"), lane("cuda compute stream"));
    assert!(!device.is_empty(), "no device spans");
    assert!(device.iter().all(|e| e["tid"] == 4 && e["pid"] == 0));
    // Every kernel span is named after an op the host dispatched, and lies within the run
    // (host and device share the wall clock through the anchor).
    let host_names: BTreeSet<&str> = host.iter().filter_map(|e| e["name"].as_str()).collect();
    assert!(device
        .iter()
        .all(|e| host_names.contains(e["name"].as_str().unwrap())));
    let first = host.iter().filter_map(|e| e["ts"].as_u64()).min().unwrap();
    let last = host
        .iter()
        .filter_map(|e| Some(e["ts"].as_u64()? + e["dur"].as_u64()?))
        .max()
        .unwrap();
    for e in &device {
        let ts = e["ts"].as_u64().unwrap();
        assert!(
            ts + 1000 >= first && ts <= last + 1_000_000,
            "device span at {ts} outside the host's [{first}, {last}]"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
