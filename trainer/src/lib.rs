//! OxiFlow's trainer: one loop (`Trainer`) for any model (`TrainModel`; the GPT and the MLP
//! classifier are two) under any mesh, ZeRO stage, recomputation and pipeline schedule, with
//! learning-rate schedules (`schedule`), global-norm clipping, gradient accumulation and
//! per-parameter weight decay; health guards on every step (`health`: a non-finite loss or
//! gradient stops or skips, a loss spike warns); the jobs `train` runs (`job`: every input,
//! output and the memory the layout needs checked before step 1), configured by flags or a TOML
//! job file (`config`: keys the chosen job does not use refused), with metrics (`metrics`),
//! plots (`plot`), a progress bar (`progress`) and a `prepare` mode that tokenizes text into
//! shards (`prepare`).
//!
//! ```text
//! let cli = oxiflow::trainer::Cli::parse();
//! oxiflow::trainer::main_with(cli, JobHooks::default())?;
//! ```

pub mod compiled_step;
pub mod config;
mod error;
pub mod health;
pub mod job;
pub mod metrics;
mod model;
pub mod oom;
mod pipelined;
pub mod plot;
pub mod prepare;
pub mod progress;
pub mod schedule;
pub mod tasks;
mod trainer;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub use config::{Flags, TrainConfig};
pub use error::TrainError;
pub use health::{HealthGuard, NonFinitePolicy};
pub use job::JobHooks;
pub use model::{Batch, BatchSource, TrainModel};
pub use oom::GuardedAllocator;
pub use schedule::{Decay, LrSchedule};
pub use trainer::{PipelineRun, StepHook, StepStats, TrainOptions, Trainer, Verdict};

/// Train a GPT on text or token shards (or an MLP classifier on synthetic Gaussian clusters)
/// with global tensors; or tokenize text into shards (`train prepare`).
///
/// Every setting is checked before the run starts; nonsense (a learning rate of 0, NaN or
/// infinity, a batch of 0, a mesh that does not match the world) is refused with a message.
#[derive(Parser, Debug)]
#[command(
    name = "train",
    allow_negative_numbers = true,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// A job file (TOML): tables [model] [parallel] [data] [optim] [run] [generate] whose keys
    /// are the flags' names (e.g. `seq-len = 64` in [model]); flags given here override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub flags: Flags,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Modes other than training.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Tokenize text files into token shards (llm.c's format, u16 or u32 ids, or raw u16), with
    /// a progress bar.
    Prepare(prepare::PrepareArgs),
}

/// What `train` does with its command line: prepare shards, or resolve the configuration
/// (before any tensor work) and run the job.
pub fn main_with(cli: Cli, hooks: JobHooks) -> Result<(), TrainError> {
    let result = match cli.command {
        Some(Command::Prepare(args)) => prepare::run(&args).map(|_| ()),
        None => {
            config::load(cli.config.as_deref(), &cli.flags).and_then(|cfg| job::run(&cfg, hooks))
        }
    };
    // The process may exit next: the device's start-up builds must not be inside a library
    // then (see `oxiflow_cuda::finish_background_builds`).
    if !oxiflow_cuda::finish_background_builds(BACKGROUND_BUILDS_WAIT) {
        tracing::warn!(
            "the device's start-up kernel builds were still running after {:?}",
            BACKGROUND_BUILDS_WAIT
        );
    }
    result
}

/// How long a finished job waits for the device's start-up builds before it returns.
const BACKGROUND_BUILDS_WAIT: std::time::Duration = std::time::Duration::from_secs(120);
