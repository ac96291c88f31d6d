//! The rendezvous store under a connection flood while a real job runs: 10,000 connections
//! (silent, one-byte and partial HTTP/2 prefaces, garbage), over 4,096 of them held open, hit
//! the store before the workers rendezvous and go on while they train. The job must finish with
//! the same loss as without the flood, and oflaunch must not log a line per refusal.

mod common;

use std::collections::VecDeque;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{argv, binaries, launch, ok, spawn_piped};

const TRAIN_ARGS: &[&str] = &["--model", "mlp", "--steps", "400", "--log-every", "100"];
/// Connections held open by each of the `FLOODERS` threads: together more than the store's
/// 4,096-connection cap, fewer than this process's descriptor limit.
const HELD: usize = 600;
/// Threads opening connections at once (a full accept backlog delays each connect by a SYN
/// retransmission; several threads overlap those delays).
const FLOODERS: usize = 8;
/// Connections opened before the workers rendezvous.
const BEFORE: usize = 10_000;

/// Tries up to `count` connections to `addr` until `stop`, each sending one of the hostile
/// openings, holding the newest `HELD` open. Returns how many it tried.
fn flood(
    addr: SocketAddr,
    count: usize,
    stop: &AtomicBool,
    held: &mut VecDeque<TcpStream>,
) -> usize {
    let openings: [&[u8]; 5] = [
        b"",
        b"P",
        b"PRI * HTTP/2.0\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage",
    ];
    let mut opened = 0;
    for i in 0..count {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        opened += 1;
        if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            let _ = s.write_all(openings[i % openings.len()]);
            held.push_back(s);
            if held.len() > HELD {
                held.pop_front();
            }
        }
    }
    opened
}

fn final_line(text: &str) -> String {
    let line = text
        .lines()
        .find(|l| l.contains("final loss"))
        .unwrap_or_else(|| panic!("no final loss in:\n{text}"));
    // The loss, without the throughput that follows it.
    line.split(" steps/s").next().unwrap_or(line).to_string()
}

#[test]
fn a_job_finishes_with_the_right_loss_under_a_connection_flood() {
    let (oflaunch, train) = binaries();
    let reference = final_line(&ok(launch(4, TRAIN_ARGS)));

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let dir = std::env::temp_dir().join(format!("oxiflow_store_flood_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let go = dir.join("go");
    // Each worker waits for the go file, so the flood is in place before any rank rendezvous.
    let gate = r#"go=$1; shift; while [ ! -e "$go" ]; do sleep 0.01; done; exec "$@""#;
    let mut job = spawn_piped(
        Command::new(oflaunch)
            .args(argv("--nproc-per-node 4 --backend cpu --timeout 60"))
            .args(["--master-port", &port.to_string()])
            .args(["/bin/sh", "-c", gate, "gate"])
            .arg(&go)
            .arg(train)
            .args(TRAIN_ARGS),
    )
    .unwrap();
    let t0 = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the store never listened"
        );
        std::thread::yield_now();
    }

    let stop = Arc::new(AtomicBool::new(false));
    let t_flood = Instant::now();
    let flooders: Vec<_> = (0..FLOODERS)
        .map(|_| {
            std::thread::spawn(move || {
                let mut held = VecDeque::new();
                let quiet = AtomicBool::new(false);
                let opened = flood(addr, BEFORE / FLOODERS, &quiet, &mut held);
                (opened, held)
            })
        })
        .collect();
    let mut held_all = Vec::new();
    let mut before = 0;
    for f in flooders {
        let (opened, held) = f.join().unwrap();
        before += opened;
        held_all.push(held);
    }
    assert_eq!(before, BEFORE, "the flood stopped early");
    eprintln!(
        "{before} connections before the rendezvous in {:?}, {} held open",
        t_flood.elapsed(),
        held_all.iter().map(VecDeque::len).sum::<usize>()
    );
    std::fs::write(&go, b"").unwrap();
    let during: Vec<_> = held_all
        .into_iter()
        .map(|mut held| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || flood(addr, usize::MAX, &stop, &mut held))
        })
        .collect();
    let t_job = Instant::now();
    let out = loop {
        if job.try_wait().unwrap().is_some() {
            break job.wait_with_output().unwrap();
        }
        if t_job.elapsed() > Duration::from_secs(120) {
            let _ = job.kill();
            panic!("the job did not finish within 120 s under the flood");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let job_time = t_job.elapsed();
    stop.store(true, Ordering::SeqCst);
    let while_running: usize = during.into_iter().map(|h| h.join().unwrap()).sum();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "job finished in {job_time:?} with {while_running} more connections during it; \
         {} stderr line(s)",
        stderr.lines().count()
    );
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    assert_eq!(final_line(&stdout), reference, "{stdout}");
    let warnings = stderr.lines().filter(|l| l.contains("WARN")).count();
    assert!(warnings <= 10, "{warnings} warning lines:\n{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
