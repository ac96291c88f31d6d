//! `train`: the trainer library (`oxiflow::trainer`) as a program. A byte-level or GPT-2 BPE
//! GPT on text or token shards (`--model gpt`, the default) or an MLP classifier on a
//! deterministic synthetic dataset (`--model mlp`), on a mesh `[pp, dp, tp]` of the launched
//! ranks; every flag can also be a key of a TOML job file (`--config job.toml`). `train
//! prepare` tokenizes text files into token shards.
//!
//! ```text
//! ./target/release/oflaunch --nproc-per-node 4 train                 # GPT, DP=4
//! ./target/release/oflaunch --nproc-per-node 4 train --dp 2 --tp 2   # DP=2 x TP=2
//! ./target/release/oflaunch --nproc-per-node 4 train --pp 2 --dp 2 --micro-batches 4  # PP=2 x DP=2
//! ./target/release/oflaunch --nproc-per-node 4 train --model mlp     # the MLP classifier
//! ./target/release/oflaunch --nproc-per-node 4 train --config job.toml --steps 100
//! ./target/release/examples/train prepare --out data/shard texts/*.txt   # token shards
//! ./target/release/examples/train                                    # 1 rank, no launcher
//! mpirun -np 4 ./target/release/examples/train                       # under MPI (TCP data)
//! ```
//! Rank 0 prints the resolved configuration, `step N loss L lr R grad-norm G ...` every
//! `--log-every` steps and `final loss L steps/s S ...` (L: the mean loss of the last 10 steps);
//! GPT runs add the held-out loss, the unigram entropy of the data and a generated sample.

use std::io::Write;

use clap::Parser;

/// Counts host bytes, so `train` can print the peak of a step; a refused allocation ends the
/// rank with a line naming its size and the limits, never an abort.
#[global_allocator]
static ALLOC: oxiflow::trainer::GuardedAllocator = oxiflow::trainer::GuardedAllocator;

fn main() {
    // Warnings (e.g. a checkpoint load falling back to `<path>.old`) reach stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .with_target(false)
        .with_ansi(false)
        .init();
    let cli = match oxiflow::trainer::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // One write, so a launcher that stops this rank while another's error ends the
            // job still gets the whole message (clap writes it in pieces).
            let text = e.render().to_string();
            let written = if e.use_stderr() {
                std::io::stderr().write_all(text.as_bytes())
            } else {
                std::io::stdout().write_all(text.as_bytes())
            };
            drop(written);
            std::process::exit(e.exit_code());
        }
    };
    let result = oxiflow::trainer::main_with(cli, oxiflow::trainer::JobHooks::default());
    // With OXIFLOW_TRACE_DIR set (oflaunch --trace), this rank's timeline; else nothing. A
    // trace that was asked for and not written fails the run.
    let trace = oxiflow::collectives::trace::write_rank_trace();
    if let Err(e) = result {
        say_error(&e);
        std::process::exit(e.exit_code());
    }
    if let Err(e) = trace {
        say_error(&e);
        std::process::exit(1);
    }
}

/// Writes `train: <error>` to stderr in one write, so a launcher that stops this rank while
/// another's error ends the job never shows the line cut short (`eprintln!` writes each piece of
/// the format separately).
fn say_error(e: &dyn std::fmt::Display) {
    let _ = std::io::stderr().write_all(format!("train: {e}\n").as_bytes());
}
