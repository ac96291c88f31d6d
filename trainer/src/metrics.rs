//! `--metrics`: one JSON object per line: `{"kind": "train", "step", "loss", "lr",
//! "grad_norm", "tokens_per_s", "mfu", "seconds", "memory": {...}}` per logged step and
//! `{"kind": "eval", "step", "heldout_loss"}` per held-out evaluation (`mfu` is null where the
//! device's peak is unknown). `read` gives the records of a file back (for the plot).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
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
}

/// One line of the metrics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
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
    /// Creates (or, when `append`, continues) the file.
    pub fn open(path: &Path, append: bool) -> Result<MetricsFile, TrainError> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| out_err(path, e.to_string()))?;
        Ok(MetricsFile {
            path: path.to_path_buf(),
            file,
            lines: 0,
        })
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

/// The records of a metrics file (lines that are not records are an error naming the line).
pub fn read(path: &Path) -> Result<Vec<Record>, TrainError> {
    let file = File::open(path).map_err(|e| out_err(path, e.to_string()))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| out_err(path, e.to_string()))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line)
                .map_err(|e| out_err(path, format!("line {}: {e}", i + 1)))?,
        );
    }
    Ok(out)
}
