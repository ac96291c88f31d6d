//! The `train --model gpt` job: builds the run from the flags, resumes, trains with `step`
//! lines (tokens/s, elapsed, ETA) and a progress bar, evaluates on held-out text, saves, and
//! prints the closing lines and a generated sample; or only generates from a checkpoint.

use std::path::Path;
use std::time::Instant;

use oxiflow::checkpoint::{self, Metadata, SaveOptions};
use oxiflow::data::Corpus;
use oxiflow::nn::gpt::GptConfig;

use crate::gpt::{GptRun, GptTrainConfig};
use crate::{progress_bar, Args};

/// Defaults of the flags `train --model gpt` shares with the MLP.
pub const STEPS: u64 = 400;
pub const BATCH_SIZE: usize = 16;
pub const LR: f64 = 5e-3;

/// The model flags recorded in checkpoints, which a resumed run must repeat.
fn recorded(cfg: &GptConfig) -> [(&'static str, String, &'static str); 7] {
    [
        ("model", "gpt".into(), "--model"),
        ("seed", cfg.seed.to_string(), "--seed"),
        ("layers", cfg.layers.to_string(), "--layers"),
        ("heads", cfg.heads.to_string(), "--heads"),
        ("width", cfg.width.to_string(), "--width"),
        ("seq_len", cfg.seq_len.to_string(), "--seq-len"),
        ("dtype", format!("{}", cfg.dtype), "--dtype"),
    ]
}

/// The checkpoint's step when this run may continue it: the same model flags and a step
/// below `steps` (any step when only generating).
fn check_resume(
    cfg: &GptConfig,
    path: &Path,
    meta: &Metadata,
    steps: Option<u64>,
) -> Result<u64, String> {
    let at = path.display();
    for (key, want, flag) in recorded(cfg) {
        let saved = meta.get(key).map_or("(none)", String::as_str);
        if saved != want {
            return Err(format!(
                "--resume {at}: the checkpoint was saved with {key} {saved} but this run has {flag} {want}"
            ));
        }
    }
    let step: u64 = meta
        .get("data.step")
        .ok_or_else(|| format!("--resume {at}: the checkpoint records no data position"))?
        .parse()
        .map_err(|e| format!("--resume {at}: bad data position: {e}"))?;
    match steps {
        Some(s) if step >= s => Err(format!(
            "--resume {at}: the checkpoint is at step {step}, not below --steps {s}"
        )),
        _ => Ok(step),
    }
}

fn clock(secs: f64) -> String {
    format!("{:.1}s", secs.max(0.0))
}

/// Runs the GPT job on the initialised world of `world` ranks laid out as `[dp, tp]`; `lead`
/// (rank 0) prints.
pub fn run(
    args: &Args,
    cfg: GptTrainConfig,
    world: usize,
    lead: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let steps = args.steps.unwrap_or(STEPS);
    let mut run = GptRun::new(&cfg)?;
    let only_generate = args.generate.is_some() && args.resume.is_some() && args.steps.is_none();
    if let Some(p) = &args.resume {
        let manifest = checkpoint::read_manifest_at(p)?;
        let limit = (!only_generate).then_some(steps);
        let step = check_resume(&run.model.cfg, p, &manifest.metadata, limit)?;
        run.resume(p, step)?;
    }
    let (dp, tp) = cfg.mesh;
    let pipe = cfg.pipeline;
    let m = &run.model.cfg;
    let train_entropy = Corpus::unigram_entropy(run.corpus.train());
    if lead {
        println!(
            "train: gpt layers {} heads {} width {} seq-len {} vocab {} dropout {} dtype {} | mesh [pp {}, dp {dp}, tp {tp}] sp {} world {world} | micro-batches {} schedule {} virtual-stages {} | batch {} lr {} seed {} from step {}",
            m.layers, m.heads, m.width, m.seq_len, m.vocab, m.dropout, m.dtype, pipe.stages, m.sequence_parallel,
            pipe.micro_batches, pipe.schedule, pipe.virtual_stages, cfg.batch_size, cfg.lr, m.seed, run.step
        );
        println!(
            "data: {} ({} tokens: {} train, {} held out); unigram entropy of the train split {train_entropy:.4} nats",
            run.corpus.source,
            run.corpus.len(),
            run.corpus.train().len(),
            run.corpus.heldout().len()
        );
    }
    if only_generate {
        return sample(args, &run, lead);
    }
    let bar = progress_bar(lead, steps, run.step);
    let say = |line: String| match &bar {
        Some(b) => b.println(line),
        None => println!("{line}"),
    };
    let mut meta = Metadata::new();
    for (key, value, _) in recorded(&run.model.cfg) {
        meta.insert(key.into(), value);
    }
    let save_opts = SaveOptions {
        gathered: args.save_gathered,
        ..SaveOptions::default()
    };
    let start = Instant::now();
    let first = run.step;
    let mut recent = std::collections::VecDeque::new();
    while run.step < steps {
        let loss = run.train_step()?;
        recent.push_back(loss);
        if recent.len() > 10 {
            recent.pop_front();
        }
        let n = run.step;
        let secs = start.elapsed().as_secs_f64();
        let done = (n - first) as f64;
        let tps = done * run.tokens_per_step() as f64 / secs.max(1e-9);
        if lead && (n % args.log_every == 0 || n == steps) {
            let eta = secs / done.max(1.0) * (steps - n) as f64;
            // f64 runs print enough digits to compare curves at 1e-12.
            let digits = if run.model.cfg.dtype == oxiflow::prelude::DType::F64 {
                14
            } else {
                8
            };
            say(format!(
                "step {n} loss {loss:.digits$} tokens/s {tps:.0} elapsed {} eta {}",
                clock(secs),
                clock(eta)
            ));
        }
        if let Some(b) = &bar {
            b.set_position(n);
            b.set_message(format!("loss {loss:.4}"));
        }
        if let Some(every) = args.eval_every {
            if n % every == 0 && n < steps {
                let h = run.heldout_loss()?;
                if lead {
                    say(format!("step {n} held-out loss {h:.6}"));
                }
            }
        }
        if let (Some(p), Some(every)) = (&args.save, args.save_every) {
            if n % every == 0 && n < steps {
                run.save(p, &meta, &save_opts)?;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(p) = &args.save {
        run.save(p, &meta, &save_opts)?;
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let heldout = run.heldout_loss()?;
    if lead {
        let done = (run.step - first) as f64;
        let tps = done * run.tokens_per_step() as f64 / secs.max(1e-9);
        let fin = if recent.is_empty() {
            f64::NAN
        } else {
            recent.iter().sum::<f64>() / recent.len() as f64
        };
        println!("held-out loss {heldout:.6} (unigram entropy {train_entropy:.4})");
        let f = run.step_footprint;
        let (host, device) = run.step_peak;
        let host = host.map_or_else(|| "not counted".to_string(), |b| format!("{b} B"));
        println!(
            "memory rank 0 (zero {} recompute {:?}): parameters {} B gradients {} B optimizer-state {} B; step peak host {host} device {device} B",
            run.cfg.zero, run.cfg.recompute, f.parameters, f.gradients, f.optimizer_state
        );
        if !run.bubbles.is_empty() {
            // The first step also builds caches and plans: left out when there are others.
            let b = &run.bubbles[usize::from(run.bubbles.len() > 1)..];
            let measured = b.iter().sum::<f64>() / b.len() as f64;
            println!(
                "bubble: measured {:.1}% theory {:.1}% (schedule {}, pp {}, micro-batches {}, virtual-stages {}; mean over ranks and {} steps of the time not computing)",
                100.0 * measured,
                100.0 * pipe.bubble_theory(),
                pipe.schedule,
                pipe.stages,
                pipe.micro_batches,
                pipe.virtual_stages,
                b.len()
            );
        }
        println!(
            "final loss {fin:.8} steps/s {:.2} tokens/s {tps:.0} held-out {heldout:.6} unigram-entropy {train_entropy:.4} seconds {secs:.1}",
            done / secs.max(1e-9)
        );
    }
    sample(args, &run, lead)
}

/// Prints a generated continuation of `--generate` (default: a newline) on rank 0; every
/// rank takes part in the forward passes.
fn sample(args: &Args, run: &GptRun, lead: bool) -> Result<(), Box<dyn std::error::Error>> {
    if args.gen_tokens == 0 {
        return Ok(());
    }
    let prompt = args.generate.as_deref().unwrap_or("The ");
    let text = run.generate(prompt, args.gen_tokens, args.temperature, args.seed)?;
    if lead {
        println!("sample (temperature {}): {prompt}{text}", args.temperature);
    }
    Ok(())
}
