//! `oflaunch --trace DIR`: a 4-rank DP2xTP2 `train` run writes one Chrome trace per rank and
//! oflaunch merges them into DIR/trace.json, one timeline with the ops, boxing steps and
//! collectives (with their bytes) of every rank.

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
        BTreeSet::from(["boxing", "collectives", "ops"]),
        "lane names"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
