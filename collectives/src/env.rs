//! Launch-environment discovery: rank, world size, local rank, the store's address, token,
//! timeout and backend, from torchrun's names, then Open MPI's, then MPICH/PMI's, then Slurm's;
//! and the process settings beside that contract (`process`: the kernel cache's directory,
//! device graphs). Together with the launcher, this is the only code that reads environment
//! variables.
//!
//! Rules (the launch contract of docs/design.md, made precise):
//! - The first launcher family whose rank *or* size variable is set supplies rank and world
//!   size; a family with only one of the two set is an error naming the missing variable.
//!   Families: torchrun/oflaunch (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`),
//!   Open MPI (`OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`), MPICH/Hydra (`PMI_RANK`,
//!   `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`,
//!   `SLURM_LOCALID`, local size from `SLURM_STEP_TASKS_PER_NODE`/`SLURM_TASKS_PER_NODE` at
//!   `SLURM_NODEID`). No family at all: a single process (rank 0 of 1).
//! - Local rank and local size come from the same family; when it gives neither, the job is
//!   taken to run on one node (local = global). Giving only one of them is an error.
//! - Node rank: `NODE_RANK` (oflaunch) or `GROUP_RANK` (torchrun), which must agree; for
//!   Slurm also `SLURM_NODEID`. Absent: `None`.
//! - Contradictions: torchrun names set by hand (no `NODE_RANK`, `GROUP_RANK` or
//!   `TORCHELASTIC_RUN_ID`, i.e. no per-node launcher) must agree with any MPI/PMI/Slurm family
//!   describing a job of the same size; a stale exported `RANK` under `srun` is caught this way.
//!   When the sizes differ, the outer launcher started one launcher per node (torchrun under
//!   srun) and the torchrun names win. MPI launched inside a Slurm allocation is not checked
//!   against Slurm (the batch step's `SLURM_PROCID` says nothing about MPI ranks).
//! - `MASTER_ADDR`: required unless every rank is on this node (world size equal to local
//!   size), where it defaults to 127.0.0.1. `MASTER_PORT`: required (non-zero) when the world
//!   size exceeds 1; 0 (pick a free port) for a single process. Under an MPI launcher (Open MPI
//!   or PMI variables present) both may be absent (`master_addr` empty, `master_port` 0): the
//!   world then bootstraps the rendezvous through MPI itself (`mpi` feature).
//! - `OXIFLOW_TOKEN` (optional here; the store needs it for more than one rank),
//!   `OXIFLOW_TIMEOUT` in seconds (default 300), `OXIFLOW_BACKEND` = auto | nccl | cpu | mpi
//!   (mpi: the CPU backend with MPI as its data plane, `cpu_plane`),
//!   `OXIFLOW_FLIGHT_DIR` (where the flight recorder dumps on a failure),
//!   `OXIFLOW_TRACE_DIR` (where this rank writes its timeline trace), `OXIFLOW_PROGRESS`
//!   (1: oflaunch draws the progress bar from the job's progress lines), `OXIFLOW_NCCL_MEMORY`
//!   (1: device blocks of an NCCL world from NCCL's allocator).
//!
//! - `OXIFLOW_RESTART_COUNT` (which start of the job this is), `OXIFLOW_NNODES` (the job's
//!   node count), `OXIFLOW_STORE_PREFIX` (no blanks), `OXIFLOW_CUDA_GRAPH` (0 or 1)
//!   are checked like the rest; a folder variable set but empty is refused, and `check_folders`
//!   checks that the folders can hold files and that `OXIFLOW_CUDA_LIB_DIRS` names folders.
//!   A misspelt `OXIFLOW_*` name (two edits from a known one) is refused by `from_env`.
//!
//! Errors (`CommError::Env`) name the variable and its value (never the token's value).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::rendezvous::validate_token;
use crate::CommError;
use families::{env_err, read_family, Reading, Vars, FAMILIES, OPEN_MPI, PMI, TORCHRUN};

mod families;
mod folders;
mod one_host;
mod process;

pub use folders::unfit_folder;
pub use one_host::one_host_launch_vars;
pub use process::{device_graphs_allowed, kernel_cache_dir};

/// Rendezvous and collective timeout when `OXIFLOW_TIMEOUT` is unset.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The backend the user asked for through `OXIFLOW_BACKEND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackendChoice {
    /// NCCL when GPUs are usable, else the CPU backend.
    #[default]
    Auto,
    Nccl,
    Cpu,
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Nccl => "nccl",
            BackendChoice::Cpu => "cpu",
        })
    }
}

impl FromStr for BackendChoice {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(BackendChoice::Auto),
            "nccl" => Ok(BackendChoice::Nccl),
            "cpu" => Ok(BackendChoice::Cpu),
            _ => Err(CommError::Env(format!(
                "backend {s:?} is not one of auto, nccl, cpu"
            ))),
        }
    }
}

/// What carries the data of a CPU world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CpuPlane {
    /// TCP between hosts, shared memory within one (`OXIFLOW_BACKEND=cpu` or `auto`).
    #[default]
    Tcp,
    /// MPI (`OXIFLOW_BACKEND=mpi`; needs the `mpi` feature and an MPI launcher).
    Mpi,
}

/// What the launcher told this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub node_rank: Option<usize>,
    pub master_addr: String,
    pub master_port: u16,
    pub token: Option<String>,
    pub timeout: Duration,
    pub backend: BackendChoice,
    /// Whether ranks of one host may exchange data through shared memory (`OXIFLOW_SHM=0`
    /// turns it off; default on).
    pub shm: bool,
    /// Prefix of every rendezvous key this job uses (`OXIFLOW_STORE_PREFIX`, set by oflaunch
    /// per restart generation); empty when unset.
    pub store_prefix: String,
    /// The GPU this rank is bound to (`OXIFLOW_DEVICE`, set by oflaunch from LOCAL_RANK);
    /// None: use `local_rank`.
    pub device: Option<usize>,
    /// Extra folders to search for the CUDA and NCCL libraries (`OXIFLOW_CUDA_LIB_DIRS`,
    /// colon-separated), searched before the standard ones.
    pub cuda_lib_dirs: Vec<std::path::PathBuf>,
    /// Where the flight recorder dumps its ring when a collective fails
    /// (`OXIFLOW_FLIGHT_DIR`); None: no dump.
    pub flight_dir: Option<std::path::PathBuf>,
    /// Where this rank writes its timeline trace (`OXIFLOW_TRACE_DIR`); None: no trace.
    pub trace_dir: Option<std::path::PathBuf>,
    /// oflaunch draws a progress bar from this job's progress lines (`OXIFLOW_PROGRESS=1`).
    pub progress_lines: bool,
    /// An NCCL world takes its device blocks from NCCL's allocator (registered, zero-copy
    /// collectives) instead of the driver's (`OXIFLOW_NCCL_MEMORY=1`).
    pub nccl_memory: bool,
    /// Which start of the job this is (`OXIFLOW_RESTART_COUNT`, set by oflaunch: 0 for the
    /// first, 1 after the first restart, ...); 0 when unset.
    pub restart_count: u32,
    /// The data plane of a CPU world (`backend` reads `Cpu` when this is `Mpi`).
    pub cpu_plane: CpuPlane,
    /// Whether an MPI launcher started this process (Open MPI or PMI variables are set), so
    /// the rendezvous can be bootstrapped through MPI when MASTER_ADDR/MASTER_PORT are absent.
    pub mpi_launched: bool,
}

/// Variables whose presence shows that a per-node launcher (oflaunch, torchrun) set the torchrun
/// names, so an outer launcher's variables may legitimately differ.
const PER_NODE_LAUNCHER_MARKERS: [&str; 3] = ["NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID"];

impl LaunchEnv {
    /// Reads the process environment; an `OXIFLOW_*` variable that OxiFlow does not read but
    /// whose name is close to one it does (a typo) is refused, naming the one meant.
    pub fn from_env() -> Result<LaunchEnv, CommError> {
        check_variable_names(std::env::vars_os().map(|(k, _)| k.to_string_lossy().into_owned()))?;
        LaunchEnv::from_vars(|name| {
            std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
        })
    }

    /// Reads through `get` (a variable's value, or `None` when unset): tests pass a map.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, CommError> {
        let vars = Vars { get };
        let mut readings = Vec::new();
        for fam in FAMILIES {
            // Only the chosen (first) family must be complete; later ones are read for the
            // contradiction check, where an incomplete or malformed one is ignored.
            match read_family(&vars, fam) {
                Ok(Some(r)) => readings.push(r),
                Ok(None) => {}
                Err(e) if readings.is_empty() => return Err(e),
                Err(_) => {}
            }
        }
        let chosen = readings.first();
        let (rank, world_size, local, family_node_rank, names) = match chosen {
            Some(r) => (
                r.rank,
                r.size,
                r.local,
                r.node_rank,
                Some((r.family, r.local_size_var.clone())),
            ),
            None => (0, 1, None, None, None),
        };
        let (rank_var, size_var) = names
            .as_ref()
            .map_or(("RANK", "WORLD_SIZE"), |(f, _)| (f.rank, f.size));
        if world_size == 0 {
            return Err(env_err(format!(
                "{size_var}=0: a job needs at least one rank"
            )));
        }
        if rank >= world_size {
            return Err(env_err(format!(
                "{rank_var}={rank} is not below {size_var}={world_size}"
            )));
        }
        let (local_rank, local_world_size) = match local {
            Some((lr, ls)) => {
                let (lr_var, ls_var) = names
                    .as_ref()
                    .map_or(("LOCAL_RANK", "LOCAL_WORLD_SIZE".to_string()), |(f, v)| {
                        (f.local_rank, v.clone())
                    });
                if ls == 0 || ls > world_size {
                    return Err(env_err(format!(
                        "{ls_var}={ls} must be in 1..={world_size} ({size_var}={world_size})"
                    )));
                }
                if lr >= ls {
                    return Err(env_err(format!("{lr_var}={lr} is not below {ls_var}={ls}")));
                }
                (lr, ls)
            }
            None => (rank, world_size),
        };
        if let Some(r) = chosen {
            check_contradictions(&vars, r, &readings[1..])?;
        }
        let node_rank = node_rank(&vars, family_node_rank, world_size)?;

        let mpi_launched = readings
            .iter()
            .any(|r| std::ptr::eq(r.family, &OPEN_MPI) || std::ptr::eq(r.family, &PMI));
        let master_addr = match vars.raw("MASTER_ADDR") {
            Some(a)
                if a.trim().is_empty()
                    || !a.trim().chars().all(|c| {
                        c.is_ascii_alphanumeric()
                            || matches!(c, '.' | '-' | '_' | ':' | '[' | ']' | '%')
                    }) =>
            {
                return Err(env_err(format!(
                    "MASTER_ADDR={a:?} is not a host name or address"
                )))
            }
            Some(a) if a.matches(':').count() == 1 => {
                return Err(env_err(format!(
                    "MASTER_ADDR={a:?} holds a port: the host goes in MASTER_ADDR, the port in \
                     MASTER_PORT"
                )))
            }
            Some(a) => a.trim().to_string(),
            None if local_world_size == world_size => "127.0.0.1".to_string(),
            None if mpi_launched => String::new(),
            None => {
                return Err(env_err(format!(
                    "MASTER_ADDR is missing: the {world_size} ranks span several nodes \
                     ({local_world_size} on this one), so every rank must be told the store's host"
                )))
            }
        };
        let master_port = match vars.raw("MASTER_PORT") {
            Some(p) => {
                let port = p
                    .trim()
                    .parse::<u16>()
                    .map_err(|_| env_err(format!("MASTER_PORT={p:?} is not a port number (0..=65535)")))?;
                if port == 0 && world_size > 1 {
                    return Err(env_err(format!(
                        "MASTER_PORT=0 with {size_var}={world_size}: every rank must know the store's port"
                    )));
                }
                port
            }
            None if world_size == 1 || mpi_launched => 0,
            None => {
                return Err(env_err(format!(
                    "MASTER_PORT is missing ({size_var}={world_size}: the ranks meet at MASTER_ADDR:MASTER_PORT)"
                )))
            }
        };
        let token = match vars.raw("OXIFLOW_TOKEN") {
            None => None,
            Some(t) => {
                validate_token(&t, "OXIFLOW_TOKEN").map_err(|e| {
                    let detail = match e {
                        CommError::InvalidArgument { detail, .. } => detail,
                        other => other.to_string(),
                    };
                    env_err(format!("OXIFLOW_TOKEN is unusable: {detail}"))
                })?;
                Some(t)
            }
        };
        let timeout = match vars.raw("OXIFLOW_TIMEOUT") {
            None => DEFAULT_TIMEOUT,
            Some(t) => t
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= 1e9)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| {
                    env_err(format!(
                        "OXIFLOW_TIMEOUT={t:?} is not a positive number of seconds"
                    ))
                })?,
        };
        let (backend, cpu_plane) = match vars.raw("OXIFLOW_BACKEND") {
            None => (BackendChoice::Auto, CpuPlane::Tcp),
            Some(b) if b.trim().eq_ignore_ascii_case("mpi") => (BackendChoice::Cpu, CpuPlane::Mpi),
            Some(b) => (
                b.parse().map_err(|_| {
                    env_err(format!(
                        "OXIFLOW_BACKEND={b:?} is not one of auto, nccl, cpu, mpi"
                    ))
                })?,
                CpuPlane::Tcp,
            ),
        };
        let shm = match vars.raw("OXIFLOW_SHM").as_deref().map(str::trim) {
            None | Some("1") | Some("true") | Some("on") | Some("") => true,
            Some("0") | Some("false") | Some("off") => false,
            Some(v) => {
                return Err(env_err(format!(
                    "OXIFLOW_SHM={v:?} is not one of 0, 1, true, false, on, off"
                )))
            }
        };
        let store_prefix = vars.raw("OXIFLOW_STORE_PREFIX").unwrap_or_default();
        if store_prefix.len() > 256
            || store_prefix
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(env_err(format!(
                "OXIFLOW_STORE_PREFIX={store_prefix:?} is not a key prefix (at most 256 \
                 characters, no blanks or control characters)"
            )));
        }
        let restart_count = match vars.raw("OXIFLOW_RESTART_COUNT") {
            None => 0,
            Some(v) => v.trim().parse::<u32>().map_err(|_| {
                env_err(format!(
                    "OXIFLOW_RESTART_COUNT={v:?} is not a restart count (0 for the first start, \
                     1 after the first restart, ...)"
                ))
            })?,
        };
        if let Some(v) = vars.raw("OXIFLOW_NNODES") {
            match v.trim().parse::<usize>() {
                Ok(n) if n >= 1 && n <= world_size => {}
                _ => {
                    return Err(env_err(format!(
                        "OXIFLOW_NNODES={v:?} is not a node count in 1..={world_size} \
                         ({size_var}={world_size})"
                    )))
                }
            }
        }
        if let Some(v) = vars.raw("OXIFLOW_CUDA_GRAPH") {
            if !matches!(v.trim(), "0" | "1") {
                return Err(env_err(format!("OXIFLOW_CUDA_GRAPH={v:?} is not 0 or 1")));
            }
        }
        let device =
            match vars.raw("OXIFLOW_DEVICE").as_deref().map(str::trim) {
                None | Some("") => None,
                Some(v) => Some(v.parse::<usize>().map_err(|_| {
                    env_err(format!("OXIFLOW_DEVICE={v:?} is not a device ordinal"))
                })?),
            };
        let cuda_lib_dirs = vars
            .raw("OXIFLOW_CUDA_LIB_DIRS")
            .map(|v| {
                v.split(':')
                    .filter(|d| !d.trim().is_empty())
                    .map(std::path::PathBuf::from)
                    .collect()
            })
            .unwrap_or_default();
        let folder = |name: &str| match vars.raw(name) {
            Some(d) if d.trim().is_empty() => Err(env_err(format!(
                "{name}={d:?} is set but names no folder (unset it, or name one)"
            ))),
            d => Ok(d.map(std::path::PathBuf::from)),
        };
        let flight_dir = folder("OXIFLOW_FLIGHT_DIR")?;
        let trace_dir = folder("OXIFLOW_TRACE_DIR")?;
        let flag = |name: &str| match vars.raw(name).as_deref().map(str::trim) {
            None | Some("") | Some("0") => Ok(false),
            Some("1") => Ok(true),
            Some(v) => Err(env_err(format!("{name}={v:?} is not 0 or 1"))),
        };
        let progress_lines = flag("OXIFLOW_PROGRESS")?;
        let nccl_memory = flag("OXIFLOW_NCCL_MEMORY")?;
        tracing::debug!(
            family = chosen.map_or("none (single process)", |r| r.family.name),
            rank,
            world_size,
            "launch environment"
        );
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            master_addr,
            master_port,
            token,
            timeout,
            backend,
            shm,
            store_prefix,
            device,
            cuda_lib_dirs,
            flight_dir,
            trace_dir,
            progress_lines,
            nccl_memory,
            restart_count,
            cpu_plane,
            mpi_launched,
        })
    }

    /// Checks the folders this environment names: those for files written later
    /// (`OXIFLOW_TRACE_DIR`, `OXIFLOW_FLIGHT_DIR`, `OXIFLOW_KERNEL_CACHE`) can hold them (see
    /// `unfit_folder`), and those searched for libraries (`OXIFLOW_CUDA_LIB_DIRS`) exist. The
    /// error names the variable and its value.
    pub fn check_folders(&self) -> Result<(), CommError> {
        if let Some(d) = self.cuda_lib_dirs.iter().find(|d| !d.is_dir()) {
            let all: Vec<String> = self
                .cuda_lib_dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect();
            return Err(env_err(format!(
                "OXIFLOW_CUDA_LIB_DIRS={:?}: {} is not a folder",
                all.join(":"),
                d.display()
            )));
        }
        let cache = kernel_cache_dir();
        let folders = [
            ("OXIFLOW_TRACE_DIR", self.trace_dir.as_deref()),
            ("OXIFLOW_FLIGHT_DIR", self.flight_dir.as_deref()),
            ("OXIFLOW_KERNEL_CACHE", cache.as_deref()),
        ];
        for (var, dir) in folders {
            if let Some(why) = dir.and_then(unfit_folder) {
                return Err(env_err(format!(
                    "{var}={:?} cannot hold this rank's files: {why}",
                    dir.map(|d| d.display().to_string()).unwrap_or_default()
                )));
            }
        }
        Ok(())
    }

    /// Whether the rendezvous must be bootstrapped through MPI: several ranks, started by an
    /// MPI launcher that gave no MASTER_ADDR, MASTER_PORT or OXIFLOW_TOKEN.
    pub fn needs_mpi_bootstrap(&self) -> bool {
        self.world_size > 1
            && self.mpi_launched
            && (self.master_addr.is_empty() || self.master_port == 0 || self.token.is_none())
    }

    /// Tells the process-wide flight recorder this rank and where to dump on a failure, and
    /// starts the timeline trace when `OXIFLOW_TRACE_DIR` asks for one.
    pub fn configure_flight_recorder(&self) {
        let recorder = crate::flight_recorder();
        recorder.set_rank(self.rank);
        recorder.set_dump_dir(self.flight_dir.clone());
        if let Some(dir) = &self.trace_dir {
            crate::trace::enable_trace(self.rank, dir.clone());
        }
    }

    /// The GPU ordinal this rank uses: `OXIFLOW_DEVICE` when set, else the local rank.
    pub fn device_ordinal(&self) -> usize {
        self.device.unwrap_or(self.local_rank)
    }

    /// Connects to the job's rendezvous store with the job token and this job's key prefix.
    pub fn connect_store(&self) -> Result<crate::rendezvous::StoreClient, CommError> {
        let token = self.require_token()?;
        let client = crate::rendezvous::StoreClient::connect_with(
            &self.store_addr(),
            token,
            self.timeout,
            self.store_options(),
        )?;
        Ok(client.with_prefix(&self.store_prefix))
    }

    /// Store client settings for this rank: its long waits name it (`rank 1 of 4`) and
    /// `OXIFLOW_TIMEOUT`.
    pub fn store_options(&self) -> crate::rendezvous::ClientOptions {
        crate::rendezvous::ClientOptions {
            caller: format!("rank {} of {}", self.rank, self.world_size),
            limit_name: "OXIFLOW_TIMEOUT",
            ..crate::rendezvous::ClientOptions::default()
        }
    }

    /// The store's address as `host:port` (IPv6 literals in brackets).
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// The token, or an error naming `OXIFLOW_TOKEN` when the launcher gave none.
    pub fn require_token(&self) -> Result<&str, CommError> {
        self.token.as_deref().ok_or_else(|| {
            env_err(format!(
                "OXIFLOW_TOKEN is missing: the rendezvous store of a {}-rank job requires the job's token \
                 (oflaunch sets it; under other launchers export OXIFLOW_TOKEN=<secret> to every rank)",
                self.world_size
            ))
        })
    }
}

/// Every `OXIFLOW_*` variable OxiFlow reads (in any crate, at build or run time).
pub const KNOWN_VARIABLES: [&str; 17] = [
    "OXIFLOW_BACKEND",
    "OXIFLOW_CUDA_GRAPH",
    "OXIFLOW_CUDA_LIB_DIRS",
    "OXIFLOW_DEVICE",
    "OXIFLOW_FLIGHT_DIR",
    "OXIFLOW_KERNEL_CACHE",
    "OXIFLOW_NCCL_MEMORY",
    "OXIFLOW_NNODES",
    "OXIFLOW_NVRTC_LIB",
    "OXIFLOW_PREBUILD_ARCHS",
    "OXIFLOW_PROGRESS",
    "OXIFLOW_RESTART_COUNT",
    "OXIFLOW_SHM",
    "OXIFLOW_STORE_PREFIX",
    "OXIFLOW_TIMEOUT",
    "OXIFLOW_TOKEN",
    "OXIFLOW_TRACE_DIR",
];

/// Refuses an `OXIFLOW_*` name among `names` that is not one OxiFlow reads but is at most two
/// edits from one (a misspelling that would otherwise be ignored). Other unknown names (a
/// test's or a tool's own) pass.
pub fn check_variable_names(names: impl IntoIterator<Item = String>) -> Result<(), CommError> {
    for name in names {
        if !name.starts_with("OXIFLOW_") || KNOWN_VARIABLES.contains(&name.as_str()) {
            continue;
        }
        if let Some(meant) = KNOWN_VARIABLES
            .iter()
            .find(|k| strsim::levenshtein(k, &name) <= 2)
        {
            return Err(env_err(format!(
                "{name} is not a variable OxiFlow reads; did you mean {meant}?"
            )));
        }
    }
    Ok(())
}

/// Hand-set torchrun names must agree with an MPI/PMI/Slurm family of the same job size.
fn check_contradictions<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    chosen: &Reading,
    others: &[Reading],
) -> Result<(), CommError> {
    if !std::ptr::eq(chosen.family, &TORCHRUN)
        || PER_NODE_LAUNCHER_MARKERS
            .iter()
            .any(|m| vars.raw(m).is_some())
    {
        return Ok(());
    }
    for other in others.iter().filter(|o| o.size == chosen.size) {
        let (c, o) = (chosen.family, other.family);
        if other.rank != chosen.rank {
            return Err(env_err(format!(
                "{}={} contradicts {}={} ({} and {} both describe a job of {} ranks); unset the stale variables",
                c.rank, chosen.rank, o.rank, other.rank, c.name, o.name, chosen.size
            )));
        }
        if let (Some((lr, _)), Some((olr, _))) = (chosen.local, other.local) {
            if lr != olr {
                return Err(env_err(format!(
                    "{}={lr} contradicts {}={olr} ({} and {} both describe a job of {} ranks); unset the stale variables",
                    c.local_rank, o.local_rank, c.name, o.name, chosen.size
                )));
            }
        }
    }
    Ok(())
}

/// `NODE_RANK` / `GROUP_RANK` (must agree), else the family's own (Slurm's `SLURM_NODEID`).
fn node_rank<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    family: Option<usize>,
    world_size: usize,
) -> Result<Option<usize>, CommError> {
    let node = vars.usize("NODE_RANK")?;
    let group = vars.usize("GROUP_RANK")?;
    let value = match (node, group) {
        (Some(n), Some(g)) if n != g => {
            return Err(env_err(format!("NODE_RANK={n} contradicts GROUP_RANK={g}")));
        }
        (Some(n), _) => Some((n, "NODE_RANK")),
        (None, Some(g)) => Some((g, "GROUP_RANK")),
        (None, None) => family.map(|n| (n, "SLURM_NODEID")),
    };
    match value {
        Some((n, var)) if n >= world_size => Err(env_err(format!(
            "{var}={n} is not below the world size {world_size}"
        ))),
        Some((n, _)) => Ok(Some(n)),
        None => Ok(None),
    }
}
