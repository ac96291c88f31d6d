//! `--metrics`: one JSON object per line: `{"kind": "run", "run_id", "from_step"}` first (the
//! run that writes the file) and again where a resumed run continues it, `{"kind": "train",
//! "step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "seconds", "memory": {...}}` per
//! logged step and `{"kind": "eval", "step", "heldout_loss"}` per held-out evaluation (`mfu` is
//! null where the device's peak is unknown). `run_of` gives the run a file belongs to.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// Bytes of training state and the step's peaks on rank 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryRecord {
    pub parameters: usize,
    pub gradients: usize,
    pub optimizer_state: usize,
    /// Host peak during the step (null when the counting allocator is not installed).
    pub host_peak: Option<usize>,
    pub device_peak: usize,
    /// Bytes in use on the device as its driver counts them after the step (null on the host;
    /// see `oxiflow_tensor::memory::device_in_use`).
    #[serde(default)]
    pub device_in_use: Option<usize>,
}

/// One line of the metrics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// The run writing the records that follow, from this step on.
    Run {
        run_id: String,
        from_step: u64,
    },
    Train {
        step: u64,
        loss: f64,
        lr: f64,
        grad_norm: f64,
        tokens_per_s: f64,
        mfu: Option<f64>,
        /// Seconds since the run (this process) started.
        seconds: f64,
        memory: MemoryRecord,
    },
    Eval {
        step: u64,
        heldout_loss: f64,
    },
}

/// An open metrics file.
pub struct MetricsFile {
    path: PathBuf,
    file: File,
    pub lines: usize,
}

fn out_err(path: &Path, detail: String) -> TrainError {
    TrainError::Output {
        what: "--metrics",
        path: path.to_path_buf(),
        detail,
    }
}

impl MetricsFile {
    /// Creates (or, when `append`, continues) the file, never through a symlink, and writes
    /// the record of run `run_id` from step `from_step`.
    pub fn open(
        path: &Path,
        append: bool,
        run_id: &str,
        from_step: u64,
    ) -> Result<MetricsFile, TrainError> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| out_err(path, e.to_string()))?;
        let mut m = MetricsFile {
            path: path.to_path_buf(),
            file,
            lines: 0,
        };
        m.write(&Record::Run {
            run_id: run_id.to_string(),
            from_step,
        })?;
        Ok(m)
    }

    /// Appends `r` as one line (written through at once).
    pub fn write(&mut self, r: &Record) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(r).map_err(|e| out_err(&self.path, e.to_string()))?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| out_err(&self.path, e.to_string()))?;
        self.lines += 1;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The run whose records the metrics file at `path` holds (its first record), or None when
/// its first line is not a run record (not a metrics file of a run).
pub fn run_of(path: &Path) -> Result<Option<String>, TrainError> {
    let file = File::open(path).map_err(|e| out_err(path, e.to_string()))?;
    let mut first = Vec::new();
    // One line of at most 64 KiB: a run record is short, and the file may hold anything.
    BufReader::new(file.take(1 << 16))
        .read_until(b'\n', &mut first)
        .map_err(|e| out_err(path, e.to_string()))?;
    Ok(match serde_json::from_slice::<Record>(first.trim_ascii()) {
        Ok(Record::Run { run_id, .. }) => Some(run_id),
        _ => None,
    })
}
