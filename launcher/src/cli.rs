//! Command line of `oflaunch` (clap), with torchrun's underscore spellings as aliases.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::error::LaunchError;

/// Which collective backend the workers should use (exported as `OXIFLOW_BACKEND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// NCCL when this node has GPUs, else the CPU backend.
    Auto,
    /// NCCL on this node's GPUs.
    Nccl,
    /// The CPU backend: shared memory between ranks of one host, TCP between hosts.
    Cpu,
}

/// `oflaunch [OPTIONS] PROGRAM [ARGS...]`: start and supervise the ranks of an OxiFlow job.
///
/// Ranks are numbered `node_rank * nproc_per_node + local_rank`; every node must run the same
/// number of workers.
#[derive(Debug, Parser)]
#[command(name = "oflaunch", version, about, trailing_var_arg = true)]
pub struct Cli {
    /// Workers on this node: a count, `auto` (number of GPUs, else 1), `gpu` (number of GPUs,
    /// error if none) or `cpu` (number of CPUs). At most what this node's limits allow (open
    /// files, processes; 1024 at most).
    #[arg(
        long,
        alias = "nproc_per_node",
        default_value = "1",
        value_name = "N",
        allow_hyphen_values = true
    )]
    pub nproc_per_node: String,

    /// Number of nodes (one oflaunch per node).
    #[arg(
        long,
        default_value_t = 1,
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub nnodes: usize,

    /// This node's rank in 0..nnodes; node 0 serves the rendezvous store.
    #[arg(long, alias = "node_rank", default_value_t = 0, value_name = "N")]
    pub node_rank: usize,

    /// Address of the rendezvous store (node 0 binds exactly this address).
    #[arg(
        long,
        alias = "master_addr",
        default_value = "127.0.0.1",
        value_name = "HOST"
    )]
    pub master_addr: String,

    /// Port of the rendezvous store; 0 or absent on a single node picks a free port.
    #[arg(long, alias = "master_port", value_name = "PORT")]
    pub master_port: Option<u16>,

    /// Collective backend exported to the workers.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,

    /// Write each rank's output to DIR/rank_N.stdout and DIR/rank_N.stderr (console stays quiet
    /// unless --tee). A log that cannot be written (full disk, file-size limit) is reported at
    /// the end and makes the exit code non-zero.
    #[arg(long, alias = "log_dir", value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// Record a timeline: every rank writes a Chrome trace (ops, boxing steps, collectives with
    /// their bytes) to DIR/rank-R.json when it exits, and oflaunch merges them into
    /// DIR/trace.json (open it in chrome://tracing or Perfetto). Ranks of one host share its
    /// wall clock; on several hosts the clocks must be synchronised (NTP).
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,

    /// With --log-dir: also print the (rank-prefixed) output to the console.
    #[arg(long)]
    pub tee: bool,

    /// Only show these global ranks on the console, e.g. `0,2` or `0-3,7` (log files get all);
    /// every rank named must exist.
    #[arg(long, alias = "ranks_filter", value_name = "RANKS")]
    pub ranks_filter: Option<String>,

    /// Seconds any one wait of the job may last: nodes joining the rendezvous, the skew between
    /// nodes at the end of the job, and (exported to the workers as OXIFLOW_TIMEOUT) every
    /// store wait and collective inside a worker. It does not limit how long the job runs.
    #[arg(
        long,
        default_value_t = 300.0,
        value_name = "SECONDS",
        allow_negative_numbers = true
    )]
    pub timeout: f64,

    /// Seconds a rank that other ranks wait for may show no progress before the job is ended
    /// as failed, naming it: its heartbeat unchanged (the process is frozen: stopped, attached
    /// by a debugger, its node frozen) or its main thread stopped or ptrace-stopped. Also how
    /// long the rendezvous store may stay silent before the other nodes end their workers. A
    /// rank that is only slow keeps heartbeating and is not affected. 0: never (e.g. to debug
    /// a rank).
    #[arg(
        long,
        default_value_t = 5.0,
        value_name = "SECONDS",
        allow_negative_numbers = true
    )]
    pub stall_timeout: f64,

    /// Restart the whole local group up to K times after a failure; with a worker that saves
    /// checkpoints (`train --save DIR --resume auto`), each restart resumes from the newest
    /// complete one (the restart number is in OXIFLOW_RESTART_COUNT).
    #[arg(
        long,
        alias = "max_restarts",
        default_value_t = 0,
        value_name = "K",
        allow_negative_numbers = true
    )]
    pub max_restarts: u32,

    /// Seconds between SIGTERM and SIGKILL when tearing the workers down.
    #[arg(
        long,
        alias = "grace_period",
        default_value_t = 10.0,
        value_name = "SECONDS"
    )]
    pub grace_period: f64,

    /// File holding the job token for the rendezvous store (its first line; the file must not
    /// be readable by other users). Multi-node: give every node the same token, here or in
    /// OXIFLOW_TOKEN. Node 0 generates one when neither is given.
    #[arg(long, alias = "token_file", value_name = "PATH")]
    pub token_file: Option<PathBuf>,

    /// Refused: a token on the command line is visible to every user (/proc/PID/cmdline).
    #[arg(long, hide = true, value_name = "TOKEN")]
    pub token: Option<String>,

    /// The worker program: a path, the name of a binary or example built beside oflaunch, or a
    /// name on PATH.
    #[arg(required = true)]
    pub program: String,

    /// Arguments passed to every worker.
    #[arg(allow_hyphen_values = true)]
    pub args: Vec<String>,
}

impl Cli {
    /// Checks the option values that do not need the machine (ranges, durations).
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.nnodes == 0 {
            return Err(LaunchError::Usage("--nnodes must be at least 1".into()));
        }
        if self.node_rank >= self.nnodes {
            return Err(LaunchError::Usage(format!(
                "--node-rank {} is out of range for --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        seconds("--timeout", self.timeout)?;
        seconds("--grace-period", self.grace_period)?;
        if self.stall_timeout != 0.0 {
            seconds("--stall-timeout", self.stall_timeout)?;
        }
        if self.nnodes > 1 && self.master_port.unwrap_or(0) == 0 {
            return Err(LaunchError::Usage(
                "--master-port is required (non-zero) with --nnodes > 1: every node must know \
                 where node 0's store listens"
                    .into(),
            ));
        }
        if self.token.is_some() {
            return Err(LaunchError::Usage(
                "--token is refused: every user can read a command line (/proc/PID/cmdline); \
                 put the token in a file only you can read and pass --token-file PATH, or set \
                 OXIFLOW_TOKEN"
                    .into(),
            ));
        }
        Ok(())
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout)
    }

    pub fn grace_period(&self) -> Duration {
        Duration::from_secs_f64(self.grace_period)
    }

    /// The stall timeout; None when 0 (off).
    pub fn stall_timeout(&self) -> Option<Duration> {
        (self.stall_timeout > 0.0).then(|| Duration::from_secs_f64(self.stall_timeout))
    }
}

fn seconds(name: &str, value: f64) -> Result<(), LaunchError> {
    if value.is_finite() && value > 0.0 && value < 1.0e9 {
        Ok(())
    } else {
        Err(LaunchError::Usage(format!(
            "{name} must be a positive number of seconds, got {value}"
        )))
    }
}

/// Resolves `--nproc-per-node` to a count, given this node's GPU and CPU counts.
pub fn nproc_per_node(spec: &str, gpus: usize, cpus: usize) -> Result<usize, LaunchError> {
    let n = match spec {
        "auto" => gpus.max(1),
        "gpu" => {
            if gpus == 0 {
                return Err(LaunchError::Usage(
                    "--nproc-per-node gpu: no GPU found (looked for /dev/nvidia[0-9]* and \
                     `nvidia-smi -L`)"
                        .into(),
                ));
            }
            gpus
        }
        "cpu" => cpus.max(1),
        other => other.parse::<usize>().map_err(|_| {
            LaunchError::Usage(format!(
                "--nproc-per-node {other:?}: expected a positive count, auto, gpu or cpu"
            ))
        })?,
    };
    if n == 0 {
        return Err(LaunchError::Usage(
            "--nproc-per-node must be at least 1".into(),
        ));
    }
    Ok(n)
}

/// Checks a resolved `--nproc-per-node` against the most workers this node can run.
pub fn check_nproc(n: usize, max: usize, why: &str) -> Result<(), LaunchError> {
    if n > max {
        return Err(LaunchError::Usage(format!(
            "--nproc-per-node {n} exceeds the {max} workers this node can run (set by {why})"
        )));
    }
    Ok(())
}

/// Parses `--ranks-filter` (`0,2`, `1-3`, or both mixed) into a sorted list of ranks, each
/// inside a world of `world_size` ranks.
pub fn parse_ranks_filter(spec: &str, world_size: usize) -> Result<Vec<usize>, LaunchError> {
    let bad = |part: &str| {
        LaunchError::Usage(format!(
            "--ranks-filter {spec:?}: cannot read {part:?} (expected ranks like 0,2 or 0-3)"
        ))
    };
    let outside = |rank: usize| {
        LaunchError::Usage(format!(
            "--ranks-filter {spec:?}: rank {rank} does not exist (the job has ranks 0-{})",
            world_size.saturating_sub(1)
        ))
    };
    let mut ranks = Vec::new();
    for part in spec.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(bad(part));
        }
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (
                a.trim().parse::<usize>().map_err(|_| bad(part))?,
                b.trim().parse::<usize>().map_err(|_| bad(part))?,
            ),
            None => {
                let r = part.parse::<usize>().map_err(|_| bad(part))?;
                (r, r)
            }
        };
        if a > b {
            return Err(bad(part));
        }
        if b >= world_size {
            return Err(outside(b));
        }
        ranks.extend(a..=b);
    }
    ranks.sort_unstable();
    ranks.dedup();
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn underscore_and_dash_spellings() {
        let a = Cli::try_parse_from([
            "oflaunch",
            "--nproc_per_node",
            "4",
            "--master_port=0",
            "--grace_period",
            "2",
            "prog",
            "--lr",
            "0.1",
        ])
        .unwrap();
        assert_eq!(a.nproc_per_node, "4");
        assert_eq!(a.master_port, Some(0));
        assert_eq!(a.program, "prog");
        assert_eq!(a.args, vec!["--lr", "0.1"]);
        let b = Cli::try_parse_from(["oflaunch", "--nproc-per-node", "2", "--node-rank", "0", "p"])
            .unwrap();
        assert_eq!(b.nproc_per_node, "2");
        assert_eq!(b.grace_period, 10.0);
    }

    #[test]
    fn nproc_specs() {
        assert_eq!(nproc_per_node("auto", 0, 8).unwrap(), 1);
        assert_eq!(nproc_per_node("auto", 4, 8).unwrap(), 4);
        assert_eq!(nproc_per_node("cpu", 0, 8).unwrap(), 8);
        assert_eq!(nproc_per_node("3", 0, 8).unwrap(), 3);
        assert!(nproc_per_node("gpu", 0, 8).is_err());
        assert!(nproc_per_node("0", 0, 8).is_err());
        assert!(nproc_per_node("x", 0, 8).is_err());
        assert!(nproc_per_node("-1", 0, 8).is_err());
        let e = check_nproc(100_000, 1024, "a limit")
            .unwrap_err()
            .to_string();
        assert!(e.contains("100000") && e.contains("1024"), "{e}");
        assert!(check_nproc(1024, 1024, "a limit").is_ok());
    }

    #[test]
    fn ranks_filter() {
        assert_eq!(parse_ranks_filter("0,2", 4).unwrap(), vec![0, 2]);
        assert_eq!(parse_ranks_filter("3-5, 1", 6).unwrap(), vec![1, 3, 4, 5]);
        for bad in ["a", "5-3", "", "1,,2", "-1", "1-", " , "] {
            assert!(parse_ranks_filter(bad, 8).is_err(), "{bad:?}");
        }
        let e = parse_ranks_filter("0,4", 4).unwrap_err().to_string();
        assert!(
            e.contains("rank 4 does not exist") && e.contains("0-3"),
            "{e}"
        );
        // A huge range is refused before it is expanded.
        let e = parse_ranks_filter("0-18446744073709551615", 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
    }
}
