//! The loop as a person watches it: step lines and the progress bar, held-out evaluations,
//! checkpoints (a line each, the configuration written beside them), metrics records, the
//! plot, and the closing lines.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use oxiflow_models::checkpoint::{Metadata, SaveOptions};

use super::history::History;
use super::outputs::OutputPlan;
use super::{config_path, SaveTarget};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::metrics::{MemoryRecord, MetricsFile, Record};
use crate::model::TrainModel;
use crate::plot::{self, Curves};
use crate::progress::Progress;
use crate::trainer::{StepStats, Trainer};

fn clock(secs: f64) -> String {
    format!("{:.1}s", secs.max(0.0))
}

/// What the loop reports at the end.
pub(super) struct Summary {
    final_loss: f64,
    heldout: f64,
    steps_per_s: f64,
    tokens_per_s: f64,
    seconds: f64,
    last: StepStats,
    bubbles: Vec<f64>,
}

/// Bytes of the files of a checkpoint directory.
fn dir_bytes(path: &Path) -> u64 {
    std::fs::read_dir(path)
        .map(|d| {
            d.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

pub(super) struct Saver<'a> {
    pub cfg: &'a TrainConfig,
    pub meta: Metadata,
    pub opts: SaveOptions,
    pub lead: bool,
}

impl Saver<'_> {
    /// Saves (every rank), then rank 0 writes the configuration beside the checkpoint and
    /// prints a line.
    fn save<M: TrainModel>(
        &self,
        t: &Trainer<M>,
        path: &Path,
        history: &History,
        progress: &Progress,
    ) -> Result<(), TrainError> {
        let start = Instant::now();
        let mut meta = self.meta.clone();
        meta.extend(history.to_metadata());
        t.save(path, &meta, &self.opts)?;
        if !self.lead {
            return Ok(());
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let conf = config_path(path);
        let mut tmp = conf.as_os_str().to_owned();
        tmp.push(".partial");
        let text = self.cfg.to_toml()?;
        std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&tmp)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .and_then(|()| std::fs::rename(&tmp, &conf))
            .map_err(|e| TrainError::Output {
                what: "configuration",
                path: conf.clone(),
                detail: e.to_string(),
            })?;
        progress.say(format!(
            "checkpoint step {} saved to {} ({} bytes, {ms:.0} ms; configuration in {})",
            t.step,
            path.display(),
            dir_bytes(path),
            conf.display()
        ));
        Ok(())
    }
}

/// The training loop with everything a person watches: step lines and the bar, held-out
/// evaluations, checkpoints, metrics and the plot.
pub(super) fn drive<M: TrainModel>(
    t: &mut Trainer<M>,
    cfg: &TrainConfig,
    saver: &Saver<'_>,
    outputs: &OutputPlan,
    devices: usize,
    launcher_bar: bool,
) -> Result<Summary, TrainError> {
    let r = &cfg.run;
    let lead = saver.lead;
    let steps = r.steps;
    let progress = Progress::new(lead, steps, t.step, launcher_bar);
    let target = r.save.as_deref().map(SaveTarget::of);
    let mut metrics = match (&r.metrics, lead) {
        (Some(p), true) => Some(MetricsFile::open(
            p,
            outputs.append_metrics,
            &outputs.run_id,
            t.step,
        )?),
        _ => None,
    };
    let tokens_per_step = (t.data.batch_size() * t.data.tokens_per_row()) as f64;
    let peak = r.peak_tflops.map(|p| p * 1e12 * devices as f64);
    let flops = t.model.flops_per_token();
    let digits = if cfg.model.dtype == oxiflow_dtype::DType::F64 {
        14
    } else {
        8
    };
    let mut history = outputs.history.clone();
    let start = Instant::now();
    let first = t.step;
    let mut last = StepStats::default();
    let mut bubbles = Vec::new();
    while t.step < steps {
        let s = t.train_step()?;
        if let Some(line) = &s.compiled {
            progress.say(line.clone());
        }
        let n = s.step;
        let secs = start.elapsed().as_secs_f64();
        let done = (n - first) as f64;
        let tps = done * tokens_per_step / secs.max(1e-9);
        if s.skipped {
            // Not a point of the curve, the final loss or the metrics (whose numbers are finite).
            progress.say(format!(
                "step {n} skipped: loss {} grad-norm {}; the first non-finite tensor: {} (--on-nonfinite skip: the update is dropped)",
                s.loss,
                s.grad_norm,
                s.non_finite.as_deref().unwrap_or("none")
            ));
        } else {
            history.loss(s.step, s.loss);
        }
        bubbles.extend(s.bubble);
        if !s.skipped && (n % r.log_every == 0 || n == steps) {
            let eta = secs / done.max(1.0) * (steps - n) as f64;
            progress.say(format!(
                "step {n} loss {:.digits$} lr {:.4e} grad-norm {:.digits$} tokens/s {tps:.0} elapsed {} eta {}",
                s.loss,
                s.lr,
                s.grad_norm,
                clock(secs),
                clock(eta)
            ));
            if let Some(m) = &mut metrics {
                m.write(&Record::Train {
                    step: n,
                    loss: s.loss,
                    lr: s.lr,
                    grad_norm: s.grad_norm,
                    tokens_per_s: tps,
                    mfu: peak.zip(flops).map(|(p, f)| f * tps / p),
                    seconds: secs,
                    memory: MemoryRecord {
                        parameters: s.footprint.parameters,
                        gradients: s.footprint.gradients,
                        optimizer_state: s.footprint.optimizer_state,
                        host_peak: s.peak.0,
                        device_peak: s.peak.1,
                        device_in_use: oxiflow_tensor::memory::device_in_use(),
                    },
                })?;
            }
        }
        progress.at(n, s.loss);
        if r.eval_every.is_some_and(|e| n % e == 0) && n < steps {
            let h = t.heldout_loss()?;
            progress.say(format!("step {n} held-out loss {h:.6}"));
            history.heldout(n, h);
            if let Some(m) = &mut metrics {
                m.write(&Record::Eval {
                    step: n,
                    heldout_loss: h,
                })?;
            }
        }
        if let (Some(target), Some(every)) = (&target, r.save_every) {
            if n % every == 0 && n < steps {
                saver.save(t, &target.at(n), &history, &progress)?;
            }
        }
        last = s;
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(target) = &target {
        saver.save(t, &target.at(t.step), &history, &progress)?;
    }
    progress.finish();
    let heldout = t.heldout_loss()?;
    history.heldout(t.step, heldout);
    if let Some(m) = &mut metrics {
        m.write(&Record::Eval {
            step: t.step,
            heldout_loss: heldout,
        })?;
        println!(
            "metrics: {} ({} records written)",
            m.path().display(),
            m.lines
        );
    }
    if let (Some(p), true) = (&r.plot, lead) {
        let title = format!("{:?} loss", cfg.model.model).to_lowercase();
        plot::render(
            p,
            &Curves {
                title: &title,
                train: &history.train,
                heldout: &history.heldout,
            },
            &outputs.run_id,
        )?;
        println!(
            "plot: {} ({} training and {} held-out points)",
            p.display(),
            history.train.len(),
            history.heldout.len()
        );
    }
    let done = (t.step - first) as f64;
    Ok(Summary {
        final_loss: history.final_loss(),
        heldout,
        steps_per_s: done / seconds.max(1e-9),
        tokens_per_s: done * tokens_per_step / seconds.max(1e-9),
        seconds,
        last,
        bubbles,
    })
}

/// The closing lines (rank 0).
pub(super) fn report(
    cfg: &TrainConfig,
    s: &Summary,
    entropy: Option<f64>,
    bubble_theory: Option<(f64, String)>,
) {
    let unigram = entropy.map_or(String::new(), |u| format!(" (unigram entropy {u:.4})"));
    println!("held-out loss {:.6}{unigram}", s.heldout);
    let f = s.last.footprint;
    let host = s
        .last
        .peak
        .0
        .map_or_else(|| "not counted".to_string(), |b| format!("{b} B"));
    // What the device's driver counts in use (the allocator's caches, workspaces and context
    // beside the blocks counted above), where it says.
    let in_use = oxiflow_tensor::memory::device_in_use().map_or_else(String::new, |b| {
        format!("; device in use {b} B (the driver's count)")
    });
    println!(
        "memory rank 0 (zero {} recompute {:?}): parameters {} B gradients {} B optimizer-state {} B; step peak host {host} device {} B{in_use}",
        cfg.parallel.zero, cfg.parallel.recompute, f.parameters, f.gradients, f.optimizer_state, s.last.peak.1
    );
    if let (Some((theory, what)), false) = (bubble_theory, s.bubbles.is_empty()) {
        // The first step also builds caches and plans: left out when there are others.
        let b = &s.bubbles[usize::from(s.bubbles.len() > 1)..];
        let measured = b.iter().sum::<f64>() / b.len() as f64;
        println!(
            "bubble: measured {:.1}% theory {:.1}% ({what}; mean over ranks and {} steps of the time not computing)",
            100.0 * measured,
            100.0 * theory,
            b.len()
        );
    }
    let unigram = entropy.map_or(String::new(), |u| format!(" unigram-entropy {u:.4}"));
    println!(
        "final loss {:.8} steps/s {:.2} tokens/s {:.0} held-out {:.6}{unigram} seconds {:.1}",
        s.final_loss, s.steps_per_s, s.tokens_per_s, s.heldout, s.seconds
    );
}
