//! Starting one worker: its environment (the launch contract), its own process group, and a
//! parent-death signal so it never outlives oflaunch.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use nix::unistd::Pid;
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_collectives::CommError;

use crate::error::LaunchError;
use crate::output::{OutputConfig, Pipes};
use crate::procfs::OomWatch;

/// Job-wide values every worker's environment is built from.
#[derive(Debug, Clone)]
pub struct JobEnv {
    pub master_addr: String,
    pub master_port: u16,
    pub world_size: usize,
    pub nproc_per_node: usize,
    pub node_rank: usize,
    pub nnodes: usize,
    pub token: String,
    /// `nccl` or `cpu`.
    pub backend: String,
    pub timeout_secs: f64,
    /// Restart generation (0 for the first start).
    pub generation: u32,
    /// GPUs on this node (0: no OXIFLOW_DEVICE binding).
    pub gpus: usize,
    pub cpus: usize,
    /// Where workers dump their flight recorders on a failure.
    pub flight_dir: std::path::PathBuf,
    /// Where workers write their timeline traces (`--trace`).
    pub trace_dir: Option<std::path::PathBuf>,
    /// oflaunch draws rank 0's progress bar (`OXIFLOW_PROGRESS=1`).
    pub progress: bool,
}

impl JobEnv {
    /// The variables for one local rank (what `collectives::env` reads).
    pub fn vars(&self, local_rank: usize) -> Vec<(String, String)> {
        let rank = self.node_rank * self.nproc_per_node + local_rank;
        let mut v: Vec<(String, String)> = vec![
            ("MASTER_ADDR".into(), self.master_addr.clone()),
            ("MASTER_PORT".into(), self.master_port.to_string()),
            ("WORLD_SIZE".into(), self.world_size.to_string()),
            ("RANK".into(), rank.to_string()),
            ("LOCAL_RANK".into(), local_rank.to_string()),
            ("LOCAL_WORLD_SIZE".into(), self.nproc_per_node.to_string()),
            ("NODE_RANK".into(), self.node_rank.to_string()),
            ("GROUP_RANK".into(), self.node_rank.to_string()),
            ("OXIFLOW_NNODES".into(), self.nnodes.to_string()),
            ("OXIFLOW_TOKEN".into(), self.token.clone()),
            ("OXIFLOW_BACKEND".into(), self.backend.clone()),
            ("OXIFLOW_TIMEOUT".into(), format!("{}", self.timeout_secs)),
            ("OXIFLOW_RESTART_COUNT".into(), self.generation.to_string()),
            (
                "OXIFLOW_STORE_PREFIX".into(),
                format!("job/g{}/", self.generation),
            ),
            (
                "OXIFLOW_FLIGHT_DIR".into(),
                self.flight_dir.to_string_lossy().into_owned(),
            ),
        ];
        if self.progress {
            v.push(("OXIFLOW_PROGRESS".into(), "1".into()));
        }
        if let Some(dir) = &self.trace_dir {
            v.push((
                "OXIFLOW_TRACE_DIR".into(),
                dir.to_string_lossy().into_owned(),
            ));
        }
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            let threads = (self.cpus / self.nproc_per_node.max(1)).max(1);
            v.push(("OMP_NUM_THREADS".into(), threads.to_string()));
        }
        if self.gpus > 0 && self.backend != "cpu" {
            // Bind by LOCAL_RANK without hiding the other GPUs (NCCL wants to see its peers).
            v.push((
                "OXIFLOW_DEVICE".into(),
                (local_rank % self.gpus).to_string(),
            ));
        }
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            v.push(("NCCL_NVLS_ENABLE".into(), "0".into()));
        }
        v
    }
}

/// Variables oflaunch sets for its workers that are checked in its own environment all the same.
const REPLACED_BUT_CHECKED: [&str; 4] = [
    "OXIFLOW_RESTART_COUNT",
    "OXIFLOW_STORE_PREFIX",
    "OXIFLOW_TIMEOUT",
    "OXIFLOW_BACKEND",
];

/// Checks oflaunch's environment as a worker of `job` will read it (oflaunch's own variables
/// over the ones it inherits), so a bad inherited variable (`OXIFLOW_SHM=maybe`, a trace folder
/// under /proc) is refused before anything starts, once, instead of by every rank.
pub fn check_inherited(job: &JobEnv) -> Result<(), CommError> {
    // Set in oflaunch's environment, these are replaced for the workers, but garbage in them is
    // still refused: whoever set them believed they act.
    LaunchEnv::from_vars(|name| {
        REPLACED_BUT_CHECKED
            .contains(&name)
            .then(|| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
            .flatten()
    })?;
    let ours = job.vars(0);
    let env = LaunchEnv::from_vars(|name| match ours.iter().find(|(k, _)| k == name) {
        Some((_, v)) => Some(v.clone()),
        None => std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()),
    })?;
    env.check_folders()
}

/// A running worker.
pub struct Worker {
    pub rank: usize,
    pub pid: Pid,
    pub child: Child,
    pub pipes: Option<Pipes>,
    /// Readable once the worker exits (None where the kernel has no pidfd_open): the
    /// supervisor wakes on it instead of noticing the exit at its next tick.
    pub pidfd: Option<OwnedFd>,
    /// Its cgroup's OOM-kill count at the start, to tell an OOM kill from another SIGKILL.
    pub oom: OomWatch,
}

/// A pidfd for `pid`, which must be our unreaped child (so the pid cannot be reused).
fn pidfd_of(pid: Pid) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Starts one worker in its own process group, with `PR_SET_PDEATHSIG = SIGKILL`.
///
/// Must be called from the thread that lives as long as oflaunch (the main thread): the
/// parent-death signal fires when the spawning *thread* exits.
pub fn spawn_worker(
    program: &Path,
    args: &[String],
    job: &JobEnv,
    local_rank: usize,
    output: &OutputConfig,
) -> Result<Worker, LaunchError> {
    let rank = job.node_rank * job.nproc_per_node + local_rank;
    let parent = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(job.vars(local_rank))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe
    // functions (signal, setpgid, prctl, getppid, _exit).
    unsafe {
        cmd.pre_exec(move || {
            // oflaunch ignores SIGXFSZ; an ignored disposition would survive the exec.
            libc::signal(libc::SIGXFSZ, libc::SIG_DFL);
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // oflaunch may have died before prctl took effect: then nobody would kill us.
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| LaunchError::io(format!("starting rank {rank} ({})", program.display()), e))?;
    let pid = Pid::from_raw(child.id() as libc::pid_t);
    // Also from the parent, so a signal sent right away reaches the group (EACCES after the
    // child's exec is fine: the child did it itself).
    let _ = nix::unistd::setpgid(pid, pid);
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let pipes = match (stdout, stderr) {
        (Some(o), Some(e)) => match Pipes::start(output, rank, o, e, job.generation > 0) {
            Ok(p) => Some(p),
            Err(err) => {
                // Do not leave it running unsupervised. SIGKILL is prompt; wait() is bounded.
                let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
                let _ = child.wait();
                return Err(err);
            }
        },
        _ => None,
    };
    tracing::debug!(rank, local_rank, pid = pid.as_raw(), "started worker");
    Ok(Worker {
        rank,
        pid,
        child,
        pipes,
        pidfd: pidfd_of(pid),
        oom: OomWatch::start(pid.as_raw()),
    })
}
