//! oflaunch entry point: parse the command line, join the rendezvous, then start, supervise and
//! (up to --max-restarts times) restart the local workers; exit with the first failure's code.

mod cli;
mod error;
mod hang_watch;
mod merge;
mod node;
mod output;
mod procfs;
mod progress;
mod rendezvous_join;
mod resolve;
mod signals;
mod spawn;
mod stall;
mod summary;
mod supervise;
mod token;

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use clap::Parser;
use nix::sys::signal::{killpg, Signal};
use oxiflow_collectives::env::unfit_folder;
use oxiflow_collectives::rendezvous::publish_world_size;

use cli::{BackendArg, Cli};
use error::LaunchError;
use hang_watch::{HangWatch, WatchConfig};
use output::{LogErrors, OutputConfig};
use rendezvous_join::{JoinSpec, Rendezvous, SETTLE_PATIENCE, SETTLE_PATIENCE_FROZEN};
use signals::SignalPipe;
use spawn::{spawn_worker, JobEnv, Worker};
use summary::{ExitKind, Failure};
use supervise::{supervise, Outcome, Supervision};

/// Exit code for oflaunch's own errors (bad options, rendezvous refused).
const LAUNCH_ERROR_CODE: i32 = 2;

/// The variable that sets oflaunch's own log level (a `tracing` filter; default `info`).
const LOG_VARIABLE: &str = "OFLAUNCH_LOG";

/// An `OFLAUNCH_LOG` that is set but not a log filter, refused like a bad flag.
fn log_filter_refusal() -> Result<(), LaunchError> {
    match std::env::var(LOG_VARIABLE) {
        Err(std::env::VarError::NotPresent) => Ok(()),
        Err(std::env::VarError::NotUnicode(v)) => Err(LaunchError::Usage(format!(
            "{LOG_VARIABLE}={v:?} is not a log filter (it is not UTF-8)"
        ))),
        Ok(v) => tracing_subscriber::EnvFilter::try_new(&v)
            .map(drop)
            .map_err(|e| {
                LaunchError::Usage(format!(
                    "{LOG_VARIABLE}={v:?} is not a log filter (info, debug, warn, ...): {e}"
                ))
            }),
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(LOG_VARIABLE)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    if let Err(e) = log_filter_refusal() {
        eprintln!("oflaunch: error: {e}");
        std::process::exit(LAUNCH_ERROR_CODE);
    }
    let log_errors = LogErrors::default();
    let code = match run(cli, &log_errors) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("oflaunch: error: {e}");
            LAUNCH_ERROR_CODE
        }
    };
    std::process::exit(with_log_errors(code, &log_errors));
}

/// Reports the log files that could not be written; a job that succeeded then exits with 1.
fn with_log_errors(code: i32, log_errors: &LogErrors) -> i32 {
    let errors = log_errors.lock().map(|e| e.clone()).unwrap_or_default();
    if errors.is_empty() {
        return code;
    }
    eprintln!(
        "oflaunch: {} log file(s) could not be written (output lost):",
        errors.len()
    );
    for e in &errors {
        eprintln!("  {e}");
    }
    if code == 0 {
        1
    } else {
        code
    }
}

fn run(cli: Cli, log_errors: &LogErrors) -> Result<i32, LaunchError> {
    cli.validate()?;
    oxiflow_collectives::env::check_variable_names(
        std::env::vars_os().map(|(k, _)| k.to_string_lossy().into_owned()),
    )
    .map_err(LaunchError::Environment)?;
    let token = token::job_token(
        cli.token_file.as_deref(),
        std::env::var("OXIFLOW_TOKEN").ok(),
    )?;
    if cli.nnodes > 1 && cli.node_rank > 0 && token.is_none() {
        return Err(LaunchError::Usage(
            "nodes other than node 0 need the job token: pass --token-file PATH or set \
             OXIFLOW_TOKEN (the same one node 0 uses)"
                .into(),
        ));
    }
    let gpus = node::count_gpus();
    let cpus = node::count_cpus();
    let nproc = cli::nproc_per_node(&cli.nproc_per_node, gpus, cpus)?;
    let (max_workers, limited_by) = node::max_workers();
    cli::check_nproc(nproc, max_workers, &limited_by)?;
    let world_size = cli.nnodes.checked_mul(nproc).ok_or_else(|| {
        LaunchError::Usage(format!(
            "--nnodes {} x --nproc-per-node {nproc} overflows",
            cli.nnodes
        ))
    })?;
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.to_path_buf()));
    let program =
        resolve::resolve_program(&cli.program, exe_dir.as_deref(), std::env::var_os("PATH"))?;
    let backend = match cli.backend {
        BackendArg::Nccl => "nccl",
        BackendArg::Cpu => "cpu",
        BackendArg::Auto if gpus > 0 => "nccl",
        BackendArg::Auto => "cpu",
    };
    let mut output = OutputConfig {
        log_dir: cli.log_dir.clone(),
        log_errors: log_errors.clone(),
        console: cli.log_dir.is_none() || cli.tee,
        ranks_filter: cli
            .ranks_filter
            .as_deref()
            .map(|spec| cli::parse_ranks_filter(spec, world_size))
            .transpose()?,
        bar: ((cli.log_dir.is_none() || cli.tee) && std::io::stdout().is_terminal())
            .then(progress::ConsoleBar::default),
        merger: None,
    };
    let first = cli.node_rank * nproc;
    let shown = (first..first + nproc)
        .filter(|&r| output.console_for(r))
        .count();
    if shown > 1 {
        output.merger = Some(
            merge::LineMerger::start(output.bar.clone())
                .map_err(|e| LaunchError::io("starting the output merger", e))?,
        );
    }
    for (flag, dir) in [("--trace", &cli.trace), ("--log-dir", &cli.log_dir)] {
        if let Some(why) = dir.as_deref().and_then(unfit_folder) {
            return Err(LaunchError::Usage(format!(
                "{flag} {}: {why}",
                dir.as_deref()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            )));
        }
    }
    if let Some(dir) = &cli.trace {
        std::fs::create_dir_all(dir)
            .map_err(|e| LaunchError::io(format!("creating --trace {}", dir.display()), e))?;
    }
    if let Some(dir) = &cli.log_dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| LaunchError::io(format!("creating --log-dir {}", dir.display()), e))?;
    }
    let host = summary::hostname();
    let flight = FlightDir::choose(cli.log_dir.as_deref())?;
    let job_env = |generation: u32, master_port: u16, token: String| JobEnv {
        master_addr: cli.master_addr.clone(),
        master_port,
        world_size,
        nproc_per_node: nproc,
        node_rank: cli.node_rank,
        nnodes: cli.nnodes,
        token,
        backend: backend.into(),
        timeout_secs: cli.timeout,
        generation,
        gpus,
        cpus,
        flight_dir: flight.path.clone(),
        trace_dir: cli.trace.clone(),
        progress: output.bar.is_some(),
    };
    // What the workers will read, with a stand-in for the store's port and token, which the
    // rendezvous decides.
    let stand_in = job_env(0, cli.master_port.unwrap_or(0).max(1), "stand-in".into());
    spawn::check_inherited(&stand_in).map_err(LaunchError::Environment)?;
    let signals = SignalPipe::install()?;

    let rdzv = Rendezvous::start(JoinSpec {
        master_addr: cli.master_addr.clone(),
        master_port: cli.master_port.unwrap_or(0),
        nnodes: cli.nnodes,
        node_rank: cli.node_rank,
        nproc_per_node: nproc,
        token,
        timeout: cli.timeout(),
        stall_timeout: cli.stall_timeout(),
        host: host.clone(),
    })?;
    rdzv.join()?;

    tracing::info!(
        "node {}/{}: starting {nproc} worker(s) of {world_size}: {} (backend {backend})",
        cli.node_rank,
        cli.nnodes,
        program.display()
    );
    let mut generation: u32 = 0;
    loop {
        let job = job_env(generation, rdzv.port, rdzv.token.clone());
        let started = std::time::SystemTime::now();
        let job_store = rdzv.job_store(generation);
        if let Some(store) = &job_store {
            let who = format!("oflaunch on node {}", cli.node_rank);
            publish_world_size(store, world_size, &who)?;
        }
        let workers = spawn_all(&program, &cli.args, &job, &output, cli.grace_period())?;
        let hangs = job_store.and_then(|store| {
            let cfg = WatchConfig {
                world: world_size,
                local: workers.iter().map(|w| (w.rank, w.pid.as_raw())).collect(),
                stall_timeout: cli.stall_timeout(),
            };
            HangWatch::start(store, cfg)
                .map_err(|e| tracing::warn!("cannot start the hang watcher: {e}"))
                .ok()
        });
        let diagnosis = |ended_alone: &[usize]| {
            let mut s = hangs
                .as_ref()
                .map(|h| h.report(ended_alone))
                .unwrap_or_default();
            s.push_str(&hang_watch::collect_dumps(&flight.path, started));
            if !s.is_empty() {
                eprint!("oflaunch: state of the ranks when the job ended:\n{s}");
                if flight.ours {
                    eprintln!(
                        "  (the flight dumps are removed when oflaunch exits; pass --log-dir \
                         to keep them)"
                    );
                }
            }
        };
        let watch = rdzv.watch_failures(generation)?;
        let remote = || watch.event();
        let stalled = || hangs.as_ref().and_then(HangWatch::stall);
        let supervised = supervise(
            workers,
            &Supervision {
                signals: &signals,
                grace: cli.grace_period(),
                node_rank: cli.node_rank,
                nproc_per_node: nproc,
                host: host.clone(),
                remote: &remote,
                stalled: &stalled,
            },
        );
        // The workers' last lines come before anything oflaunch says about their end.
        if let Some(m) = &output.merger {
            m.flush();
        }
        let outcome = supervised.outcome;
        let ended_alone = supervised.on_their_own;
        drop(watch);
        if let Some(stall) = hangs.as_ref().and_then(HangWatch::stall) {
            eprintln!(
                "oflaunch: the workers were stopped {:.1} s after rank {} last showed progress \
                 (--stall-timeout {} s)",
                stall.last_progress.elapsed().as_secs_f64(),
                stall.rank,
                cli.stall_timeout
            );
        }
        if let Some(dir) = &cli.trace {
            merge_trace(dir);
        }
        // Workers that all succeeded unlinked their own names; with the store gone nobody can
        // say which names were the job's.
        if !matches!(outcome, Outcome::Success | Outcome::StoreLost(..)) {
            remove_leftover_segments(&rdzv, generation, &job);
        }
        let failure = match outcome {
            Outcome::Success => match rdzv.finish(generation)? {
                None => {
                    tracing::info!("all workers finished successfully");
                    return Ok(0);
                }
                Some(f) => {
                    eprint!("{}", f.summary(true, false));
                    diagnosis(&ended_alone);
                    return Ok(f.exit.shell_code());
                }
            },
            Outcome::Interrupted(sig) => {
                let f = Failure {
                    rank: cli.node_rank * nproc,
                    node_rank: cli.node_rank,
                    host: host.clone(),
                    pid: std::process::id() as i32,
                    exit: ExitKind::Signal(sig as i32),
                    cause: None,
                    tail: vec![format!("oflaunch on node {} received {sig}", cli.node_rank)],
                    alike: Vec::new(),
                };
                rdzv.report_failure(generation, &f);
                rdzv.settle_failure(generation, SETTLE_PATIENCE);
                eprintln!("oflaunch: interrupted by {sig}; workers stopped");
                return Ok(128 + sig as i32);
            }
            Outcome::Failed(f) => {
                rdzv.report_failure(generation, &f);
                eprint!("{}", f.summary(false, output.console_for(f.rank)));
                diagnosis(&ended_alone);
                f
            }
            Outcome::Remote(f) => {
                eprint!("{}", f.summary(true, false));
                diagnosis(&ended_alone);
                f
            }
            Outcome::StoreLost(msg, last_answer) => {
                eprintln!(
                    "oflaunch: {msg}; workers stopped {:.1} s after the store last answered",
                    last_answer.elapsed().as_secs_f64()
                );
                return Ok(1);
            }
        };
        if generation >= cli.max_restarts {
            let patience = match failure.exit {
                ExitKind::Stalled(_) => SETTLE_PATIENCE_FROZEN,
                _ => SETTLE_PATIENCE,
            };
            rdzv.settle_failure(generation, patience);
            if cli.max_restarts > 0 {
                eprintln!("oflaunch: giving up after {} restart(s)", cli.max_restarts);
            }
            return Ok(failure.exit.shell_code());
        }
        rdzv.restart_barrier(generation)?;
        generation += 1;
        eprintln!(
            "oflaunch: restarting the workers ({generation}/{})",
            cli.max_restarts
        );
    }
}

/// Removes the shared-memory names this node's workers of `generation` left in /dev/shm (a
/// worker killed while setting up its data plane cannot unlink its own).
fn remove_leftover_segments(rdzv: &Rendezvous, generation: u32, job: &JobEnv) {
    let Some(store) = rdzv.job_store(generation) else {
        return;
    };
    let first = job.node_rank * job.nproc_per_node;
    let paths =
        match oxiflow_collectives::job_segment_paths(&store, first..first + job.nproc_per_node) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("cannot look up the job's shared-memory names: {e}");
                return;
            }
        };
    let removed = paths
        .iter()
        .filter(|p| std::fs::remove_file(p).is_ok())
        .count();
    if removed > 0 {
        tracing::info!("removed {removed} shared-memory file(s) left by stopped workers");
    }
}

/// Starts every local worker; if one cannot start, kills the ones already running.
fn spawn_all(
    program: &std::path::Path,
    args: &[String],
    job: &JobEnv,
    output: &OutputConfig,
    grace: Duration,
) -> Result<Vec<Worker>, LaunchError> {
    let mut workers = Vec::with_capacity(job.nproc_per_node);
    let ranks = (0..job.nproc_per_node).map(|l| job.node_rank * job.nproc_per_node + l);
    // Every shown rank's stderr counts as open before the first worker starts: a line of the
    // first one waits for its twins from the others, however long their starts take.
    if let Some(m) = output.merger.as_deref() {
        ranks
            .clone()
            .filter(|&r| output.console_for(r))
            .for_each(|r| m.open(r));
    }
    for local_rank in 0..job.nproc_per_node {
        match spawn_worker(program, args, job, local_rank, output) {
            Ok(w) => workers.push(w),
            Err(e) => {
                if let Some(m) = output.merger.as_deref() {
                    ranks.clone().skip(local_rank).for_each(|r| m.close(r));
                }
                for w in &workers {
                    let _ = killpg(w.pid, Signal::SIGKILL);
                }
                let deadline = Instant::now() + grace.max(Duration::from_secs(5));
                for w in &mut workers {
                    while matches!(w.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(workers)
}

/// Where the workers dump their flight recorders on a failure (`OXIFLOW_FLIGHT_DIR`): the
/// caller's own `OXIFLOW_FLIGHT_DIR`, else `<--log-dir>/flight`, else a directory of this
/// oflaunch under the system's temporary directory, removed when oflaunch exits (the summary
/// has shown what the dumps hold), as are those of earlier oflaunch processes that died.
struct FlightDir {
    path: std::path::PathBuf,
    ours: bool,
}

/// The prefix of the flight directories oflaunch makes in the temporary directory.
const FLIGHT_PREFIX: &str = "oflaunch-flight-";

/// Removes the flight directories of oflaunch processes that no longer run (killed before
/// they could remove their own).
fn remove_dead_flight_dirs(tmp: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(FLIGHT_PREFIX))
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        let dead = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            == Err(nix::errno::Errno::ESRCH);
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        let ours = e
            .metadata()
            .is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == uid);
        if dead && ours && e.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

impl FlightDir {
    fn choose(log_dir: Option<&std::path::Path>) -> Result<FlightDir, LaunchError> {
        let (path, ours) = match (std::env::var_os("OXIFLOW_FLIGHT_DIR"), log_dir) {
            (Some(dir), _) => {
                let dir = std::path::PathBuf::from(dir);
                if let Some(why) = unfit_folder(&dir) {
                    return Err(LaunchError::Usage(format!(
                        "OXIFLOW_FLIGHT_DIR={:?} cannot hold the flight dumps: {why}",
                        dir.display().to_string()
                    )));
                }
                (dir, false)
            }
            (None, Some(logs)) => (logs.join("flight"), false),
            (None, None) => {
                let tmp = std::env::temp_dir();
                remove_dead_flight_dirs(&tmp);
                (
                    tmp.join(format!("{FLIGHT_PREFIX}{}", std::process::id())),
                    true,
                )
            }
        };
        std::fs::create_dir_all(&path).map_err(|e| {
            LaunchError::io(
                format!("creating the flight dump directory {}", path.display()),
                e,
            )
        })?;
        Ok(FlightDir { path, ours })
    }
}

impl Drop for FlightDir {
    /// However the job ended, a directory of ours goes with its dumps.
    fn drop(&mut self) {
        if self.ours {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Merges the ranks' trace files in `dir` into one timeline and says where it is.
fn merge_trace(dir: &std::path::Path) {
    match oxiflow_collectives::trace::merge_traces(dir) {
        Ok((path, ranks)) => eprintln!(
            "oflaunch: merged the traces of ranks {ranks:?} into {}",
            path.display()
        ),
        Err(e) => eprintln!("oflaunch: --trace: {e}"),
    }
}
