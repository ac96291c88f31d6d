//! A tiny worker for oflaunch's integration tests: records its env and pid, fails on demand,
//! and exchanges values through the rendezvous store.
//!
//! `oflaunch_testworker MODE OUTDIR [ARGS]`, modes:
//! - `env`: write OUTDIR/rank_R.env (KEY=VALUE lines of the launch contract, plus PID), exit 0.
//! - `fail RANK CODE`: record the pid; rank RANK writes two stderr lines and exits CODE after
//!   0.5 s; the others sleep 60 s. CODE `kill9` makes rank RANK SIGKILL itself instead.
//! - `sleep [ignore-term]`: record the pid and sleep 60 s (optionally ignoring SIGTERM).
//! - `print N`: print N numbered lines to stdout and one to stderr, exit 0.
//! - `store`: connect to the store, publish RANK, wait for every rank's value, check them,
//!   check that a wrong token is refused, and write OUTDIR/rank_R.store ("ok ...") besides
//!   the `env` mode's file.
//! - `shm-leak`: join the world (CPU backend), put this rank's shared-memory segment name back
//!   in /dev/shm (as a rank killed during the data plane's setup leaves it), write the path to
//!   OUTDIR/rank_R.shm, and SIGKILL itself.
//! - `allreduce CALLS [SLOW_RANK BEFORE_CALL SECS]`: join the world (CPU backend), run CALLS
//!   all-reduces of one f32 (checking the sum) and exit 0; rank SLOW_RANK sleeps SECS seconds
//!   before its call number BEFORE_CALL (from 0), as a rank busy in a long compute would.
//! - `pace DIR MS`: record the pid, join the world (CPU backend) and all-reduce one f32 every
//!   MS milliseconds for up to 10 minutes (light on the CPU: a job to freeze or stop).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use oxiflow_collectives::rendezvous::StoreClient;

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

fn rank() -> usize {
    var("RANK").parse().unwrap_or(usize::MAX)
}

fn write_pid(dir: &Path) {
    // Written aside and renamed, so a reader never sees an empty or partial file.
    let path = dir.join(format!("pid_{}", rank()));
    let tmp = dir.join(format!(".pid_{}.tmp", rank()));
    std::fs::write(&tmp, std::process::id().to_string()).expect("write pid file");
    std::fs::rename(&tmp, path).expect("publish pid file");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    let dir = PathBuf::from(args.get(1).cloned().unwrap_or_else(|| ".".into()));
    let code = match mode {
        "env" => env_mode(&dir),
        "fail" => fail_mode(&dir, &args[2..]),
        "sleep" => {
            if args.get(2).map(String::as_str) == Some("ignore-term") {
                // SAFETY: setting a signal disposition to SIG_IGN.
                unsafe {
                    libc::signal(libc::SIGTERM, libc::SIG_IGN);
                }
            }
            write_pid(&dir);
            std::thread::sleep(Duration::from_secs(60));
            0
        }
        "print" => {
            let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
            let mut out = std::io::stdout().lock();
            for i in 0..n {
                writeln!(out, "line {i} from rank {}", rank()).expect("stdout");
            }
            eprintln!("err from rank {}", rank());
            0
        }
        "store" => store_mode(&dir),
        "shm-leak" => shm_leak_mode(&dir),
        "allreduce" => allreduce_mode(&args[1..]),
        "pace" => pace_mode(&dir, &args[2..]),
        other => {
            eprintln!("oflaunch_testworker: unknown mode {other:?}");
            64
        }
    };
    std::process::exit(code);
}

fn env_mode(dir: &Path) -> i32 {
    let mut s = String::new();
    for key in [
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "OXIFLOW_TOKEN",
        "OXIFLOW_BACKEND",
        "OXIFLOW_TIMEOUT",
        "OMP_NUM_THREADS",
        "NCCL_NVLS_ENABLE",
        "OXIFLOW_RESTART_COUNT",
    ] {
        s.push_str(&format!("{key}={}\n", var(key)));
    }
    s.push_str(&format!("PID={}\n", std::process::id()));
    // The launcher's command line, as any user on the host could read it.
    let parent = std::os::unix::process::parent_id();
    let cmdline = std::fs::read(format!("/proc/{parent}/cmdline")).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    s.push_str(&format!("PARENT_CMDLINE={cmdline}\n"));
    std::fs::write(dir.join(format!("rank_{}.env", rank())), s).expect("write env file");
    0
}

fn fail_mode(dir: &Path, args: &[String]) -> i32 {
    write_pid(dir);
    let target: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(0);
    let code = args.get(1).cloned().unwrap_or_else(|| "1".into());
    if rank() != target {
        std::thread::sleep(Duration::from_secs(60));
        return 0;
    }
    std::thread::sleep(Duration::from_millis(500));
    eprintln!("rank {} about to fail", rank());
    eprintln!("the failure reason is {code}");
    // Lets the test measure how fast oflaunch reacts.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    std::fs::write(dir.join("failed_at_ms"), now.to_string()).expect("write time");
    if code == "kill9" {
        // SAFETY: sending a signal to ourselves.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_secs(10));
    }
    code.parse().unwrap_or(1)
}

fn store_mode(dir: &Path) -> i32 {
    env_mode(dir);
    let addr = format!("{}:{}", var("MASTER_ADDR"), var("MASTER_PORT"));
    let token = var("OXIFLOW_TOKEN");
    let world: usize = var("WORLD_SIZE").parse().unwrap_or(0);
    let me = rank();
    let timeout = Duration::from_secs(20);
    // A wrong token must be refused.
    let wrong = format!("{token}x");
    let refused = match StoreClient::connect(&addr, &wrong, timeout) {
        Err(oxiflow_collectives::CommError::Unauthenticated(_)) => true,
        Err(e) => {
            eprintln!("wrong token gave an unexpected error: {e}");
            false
        }
        Ok(_) => false,
    };
    let client = match StoreClient::connect(&addr, &token, timeout) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rank {me}: cannot connect to the store at {addr}: {e}");
            return 10;
        }
    };
    let prefix = var("OXIFLOW_STORE_PREFIX");
    let key = |r: usize| format!("{prefix}testworker/{r}");
    if let Err(e) = client.set(&key(me), format!("value-{}", me * 10).as_bytes()) {
        eprintln!("rank {me}: set failed: {e}");
        return 11;
    }
    let keys: Vec<String> = (0..world).map(key).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = match client.wait(&refs, timeout) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("rank {me}: wait failed: {e}");
            return 12;
        }
    };
    let expected: Vec<Vec<u8>> = (0..world)
        .map(|r| format!("value-{}", r * 10).into_bytes())
        .collect();
    let all_ok = values == expected;
    if let Err(e) = client.barrier(&format!("{prefix}testworker/done"), world, timeout) {
        eprintln!("rank {me}: barrier failed: {e}");
        return 13;
    }
    let verdict = format!(
        "{} values={} wrong_token_refused={refused}\n",
        if all_ok && refused { "ok" } else { "bad" },
        values.len()
    );
    std::fs::write(dir.join(format!("rank_{me}.store")), verdict).expect("write store file");
    if all_ok && refused {
        0
    } else {
        14
    }
}

/// The launch environment and the CPU world it describes; on an error, says so as `mode`
/// and gives the exit code 3.
fn join_world(
    mode: &str,
) -> Result<
    (
        oxiflow_collectives::env::LaunchEnv,
        oxiflow_collectives::SharedComm,
    ),
    i32,
> {
    let env = oxiflow_collectives::env::LaunchEnv::from_env().map_err(|e| {
        eprintln!("{mode}: {e}");
        3
    })?;
    let world = oxiflow_collectives::init_world(&env).map_err(|e| {
        eprintln!("{mode}: init_world: {e}");
        3
    })?;
    Ok((env, world))
}

fn shm_leak_mode(dir: &Path) -> i32 {
    let (env, world) = match join_world("shm-leak") {
        Ok(joined) => joined,
        Err(code) => return code,
    };
    let paths = env
        .connect_store()
        .and_then(|store| oxiflow_collectives::job_segment_paths(&store, [env.rank]));
    let path = match paths.as_deref() {
        Ok([path]) => path.to_string(),
        other => {
            eprintln!("shm-leak: no segment name: {other:?}");
            return 3;
        }
    };
    std::fs::write(&path, b"left behind").expect("recreate the segment name");
    std::fs::write(dir.join(format!("rank_{}.shm", rank())), &path).expect("write shm file");
    drop(world);
    // SAFETY: signalling this process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    0
}

/// One all-reduce (sum) of `rank + 1`, checked against the sum over the world; on an error
/// says so as `mode` and gives the exit code (4: the call failed, 5: a wrong sum).
fn reduce_once(
    mode: &str,
    env: &oxiflow_collectives::env::LaunchEnv,
    world: &oxiflow_collectives::SharedComm,
    call: u64,
) -> Result<(), i32> {
    let expected = (env.world_size * (env.world_size + 1) / 2) as f32;
    let mut value = ((env.rank + 1) as f32).to_le_bytes();
    let reduced = world.all_reduce(
        oxiflow_collectives::DType::F32,
        oxiflow_collectives::BufMut::Host(&mut value),
        oxiflow_collectives::ReduceOp::Sum,
    );
    if let Err(e) = reduced {
        eprintln!("{mode}: call {call}: {e}");
        return Err(4);
    }
    if f32::from_le_bytes(value) != expected {
        eprintln!("{mode}: call {call}: got {}", f32::from_le_bytes(value));
        return Err(5);
    }
    Ok(())
}

fn allreduce_mode(args: &[String]) -> i32 {
    let num = |i: usize| args.get(i).and_then(|s| s.parse::<u64>().ok());
    let calls = num(0).unwrap_or(1);
    let slow = (num(1), num(2), num(3));
    let (env, world) = match join_world("allreduce") {
        Ok(joined) => joined,
        Err(code) => return code,
    };
    for call in 0..calls {
        if let (Some(r), Some(before), Some(secs)) = slow {
            if r == env.rank as u64 && before == call {
                std::thread::sleep(Duration::from_secs(secs));
            }
        }
        if let Err(code) = reduce_once("allreduce", &env, &world, call) {
            return code;
        }
    }
    println!("rank {} did {calls} all-reduce(s)", env.rank);
    0
}

fn pace_mode(dir: &Path, args: &[String]) -> i32 {
    write_pid(dir);
    let pause = Duration::from_millis(args.first().and_then(|s| s.parse().ok()).unwrap_or(10));
    let (env, world) = match join_world("pace") {
        Ok(joined) => joined,
        Err(code) => return code,
    };
    let end = std::time::Instant::now() + Duration::from_secs(600);
    let mut call = 0u64;
    while std::time::Instant::now() < end {
        if let Err(code) = reduce_once("pace", &env, &world, call) {
            return code;
        }
        if call == 20 {
            eprintln!("rank {} is pacing", env.rank);
        }
        call += 1;
        std::thread::sleep(pause);
    }
    0
}
