//! What a checkpoint records of its run, and the checks a run resuming it passes before its
//! world starts. Recorded: the model's sizes, dtype, seed and optimizer, the batch size, the
//! tokenizer (a built-in one's name; a tokenizer.json's SHA-256 and, for people, its path: the
//! hash must match, wherever the file lies) and the data's identity (each `--data` and `--val-data` file's canonical path,
//! size and crc32c of its first 64 KiB, in reading order: the shard set). A resume whose values
//! differ is refused naming what changed (the data, batch size, tokenizer, seed and optimizer
//! may be overridden with `--allow-resume-mismatch`; the sizes never). Beyond its checksum a
//! manifest must be consistent: the step its data position records is its step, and an
//! optimizer that has updated holds the state of every parameter (an edited manifest that
//! resets it is refused naming the field).

use std::io::Read;
use std::path::{Path, PathBuf};

use oxiflow_models::checkpoint::{self, LoadOptions, Manifest, Metadata};
use oxiflow_models::data::Tokenizer;
use oxiflow_models::hf::Family;
use oxiflow_models::nn::gpt::TOKEN_TABLE;
use serde::{Deserialize, Serialize};

use crate::config::{ModelKind, Opt, TrainConfig};
use crate::error::TrainError;
use crate::tasks::gpt::GptInputs;

/// Bytes of a data file whose checksum marks its content.
const MARKED_BYTES: u64 = 64 << 10;

/// A value the checkpoint records that a resumed run must repeat.
pub(super) struct Recorded {
    pub key: &'static str,
    pub value: String,
    pub flag: &'static str,
    /// `--allow-resume-mismatch` may override a difference.
    pub soft: bool,
    /// Only a run that trains repeats it (one that only generates does not read the data).
    pub training: bool,
}

fn rec(key: &'static str, value: String, flag: &'static str, soft: bool) -> Recorded {
    Recorded {
        key,
        value,
        flag,
        soft,
        training: false,
    }
}

/// One data file as a checkpoint records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct FileMark {
    path: PathBuf,
    bytes: u64,
    /// crc32c of the first `MARKED_BYTES`, hex.
    head: String,
}

impl FileMark {
    fn of(path: &Path) -> Result<FileMark, TrainError> {
        let io = |e: std::io::Error| TrainError::Config {
            detail: format!("{}: cannot read it: {e}", path.display()),
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        let mut head = Vec::new();
        if meta.is_file() {
            std::fs::File::open(path)
                .and_then(|f| f.take(MARKED_BYTES).read_to_end(&mut head))
                .map_err(io)?;
        }
        Ok(FileMark {
            path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
            bytes: meta.len(),
            head: format!("{:08x}", crc32c::crc32c(&head)),
        })
    }

    fn same_content(&self, other: &FileMark) -> bool {
        self.bytes == other.bytes && self.head == other.head
    }

    fn show(&self) -> String {
        format!(
            "{} ({} bytes, crc32c {} of its first 64 KiB)",
            self.path.display(),
            self.bytes,
            self.head
        )
    }
}

/// The files a `--data`/`--val-data` value reads, in reading order, marked.
fn marks(pattern: &str) -> Result<String, TrainError> {
    let files: Vec<PathBuf> = if pattern.contains(['*', '?', '[']) {
        let mut v: Vec<PathBuf> = glob::glob(pattern)
            .map(|g| g.flatten().collect())
            .unwrap_or_default();
        v.sort();
        v
    } else {
        vec![PathBuf::from(pattern)]
    };
    let marks = files
        .iter()
        .map(|f| FileMark::of(f))
        .collect::<Result<Vec<_>, _>>()?;
    serde_json::to_string(&marks).map_err(|e| TrainError::Config {
        detail: format!("marking the data: {e}"),
    })
}

/// What changed between the data files a checkpoint recorded (`saved`) and this run's (`now`);
/// None when their contents are the same (a moved file is the same data).
fn data_change(flag: &str, saved: &str, now: &str) -> Option<String> {
    if saved == now {
        return None;
    }
    let parse = |v: &str| serde_json::from_str::<Vec<FileMark>>(v).ok();
    let (Some(a), Some(b)) = (parse(saved), parse(now)) else {
        let show = |v: &str| match (v, parse(v)) {
            ("(none)", _) => format!("no {flag} file"),
            (_, Some(m)) => m
                .iter()
                .map(|m| m.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            (v, None) => v.to_string(),
        };
        return Some(format!(
            "the checkpoint was saved reading {} but this run reads {}",
            show(saved),
            show(now)
        ));
    };
    if a.len() != b.len() {
        let names = |v: &[FileMark]| {
            v.iter()
                .map(|m| m.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Some(format!(
            "the checkpoint was saved reading {} {flag} file(s) [{}] but this run reads {} [{}]",
            a.len(),
            names(&a),
            b.len(),
            names(&b)
        ));
    }
    let (i, (x, y)) = a
        .iter()
        .zip(&b)
        .enumerate()
        .find(|(_, (x, y))| !x.same_content(y))?;
    Some(format!(
        "{flag} file {} was {} when the checkpoint was saved and is {} now",
        i + 1,
        x.show(),
        y.show()
    ))
}

/// The values a checkpoint of `cfg` records (GPT: with its opened `inputs`).
pub(super) fn recorded(
    cfg: &TrainConfig,
    inputs: Option<&GptInputs>,
) -> Result<Vec<Recorded>, TrainError> {
    let m = &cfg.model;
    let lower = |s: String| s.to_lowercase();
    let mut v = vec![
        rec("model", lower(format!("{:?}", m.model)), "--model", false),
        rec("seed", m.seed.to_string(), "--seed", true),
        rec(
            "optimizer",
            lower(format!("{:?}", cfg.optim.optimizer)),
            "--optimizer",
            true,
        ),
        rec("dtype", m.dtype.to_string(), "--dtype", false),
        Recorded {
            training: true,
            ..rec(
                "batch_size",
                cfg.data.batch_size.to_string(),
                "--batch-size",
                true,
            )
        },
    ];
    match m.model {
        ModelKind::Gpt | ModelKind::Llama => {
            let vocab = inputs.map_or(0, |i| i.vocab);
            let spec = inputs.map(|i| &i.spec);
            let sizes = spec.map_or((m.layers, m.heads, m.width, m.seq_len), |d| {
                (d.cfg.layers, d.cfg.heads, d.cfg.width, d.cfg.seq_len)
            });
            let (layers, heads, width, seq_len) = sizes;
            v.extend([
                rec("layers", layers.to_string(), "--layers", false),
                rec("heads", heads.to_string(), "--heads", false),
                rec("width", width.to_string(), "--width", false),
                rec("seq_len", seq_len.to_string(), "--seq-len", false),
                rec(
                    "tokenizer",
                    inputs.map_or(String::new(), |i| tokenizer_record(&i.tokenizer)),
                    "--tokenizer",
                    true,
                ),
                rec(
                    "vocab",
                    vocab.to_string(),
                    "--tokenizer/--data vocabulary",
                    false,
                ),
            ]);
            // Beyond GPT-2 (whose checkpoints record only the keys above), the architecture.
            if let Some(d) = spec.filter(|d| d.family != Family::Gpt2 || d.hf.is_some()) {
                let (c, a) = (&d.cfg, &d.arch);
                v.extend([
                    rec(
                        "architecture",
                        d.family.architecture().to_string(),
                        "--from-hf",
                        false,
                    ),
                    rec("kv_heads", a.kv(c).to_string(), "--kv-heads", false),
                    rec("ffn_width", a.ffn(c).to_string(), "--ffn-width", false),
                    rec(
                        "positions",
                        format!("{:?}", a.positions),
                        "--rope-theta",
                        false,
                    ),
                    rec("norm_eps", a.norm_eps.to_string(), "--norm-eps", false),
                    rec(
                        "tie_embeddings",
                        a.tie_embeddings.to_string(),
                        "--tie-embeddings",
                        false,
                    ),
                ]);
            }
            let data = match &cfg.data.data {
                Some(p) => marks(p)?,
                None => inputs.map_or(String::new(), |i| i.description.clone()),
            };
            let val = match &cfg.data.val_data {
                Some(p) => marks(p)?,
                None => "(none)".into(),
            };
            for (key, value, flag) in [
                ("data.files", data, "--data"),
                ("data.val_files", val, "--val-data"),
            ] {
                v.push(Recorded {
                    training: true,
                    ..rec(key, value, flag, true)
                });
            }
        }
        ModelKind::Mlp => v.extend([
            rec("hidden", m.hidden.to_string(), "--hidden", false),
            rec("features", m.features.to_string(), "--features", false),
            rec("classes", m.classes.to_string(), "--classes", false),
        ]),
    }
    Ok(v)
}

/// Separates a tokenizer file's identity from its path in a record.
const RECORDED_FROM: &str = " from ";

/// `tokenizer` as a checkpoint records it: `bytes`, `gpt2`, or `sha256:HEX from PATH`.
fn tokenizer_record(tokenizer: &Tokenizer) -> String {
    match tokenizer {
        Tokenizer::Json(t) => format!(
            "{}{RECORDED_FROM}{}",
            tokenizer.identity(),
            std::fs::canonicalize(t.path())
                .unwrap_or_else(|_| t.path().to_path_buf())
                .display()
        ),
        _ => tokenizer.identity(),
    }
}

/// (identity, what `--tokenizer` takes) of a recorded tokenizer.
fn recorded_tokenizer(record: &str) -> (&str, &str) {
    match record.split_once(RECORDED_FROM) {
        Some((identity, path)) => (identity, path),
        None => (record, record),
    }
}

/// The recorded values as checkpoint metadata.
pub(super) fn metadata(recorded: &[Recorded]) -> Metadata {
    recorded
        .iter()
        .map(|r| (r.key.to_string(), r.value.clone()))
        .collect()
}

/// Why the manifest's step, data position and optimizer state disagree, if they do, for a run
/// of `cfg` (see the module docs).
fn inconsistency(cfg: &TrainConfig, manifest: &Manifest) -> Option<String> {
    let meta = &manifest.metadata;
    let step = manifest.step();
    if let Some(d) = meta.get("data.step") {
        if d.parse::<u64>().ok() != Some(step) {
            return Some(format!(
                "its metadata data.step {d:?} is not its step {step} (the manifest was edited)"
            ));
        }
    }
    let o = manifest.optimizer.as_ref()?;
    let saved_state = manifest.tensors.keys().any(|k| k.starts_with("optim/"));
    if o.step_count == 0 && saved_state {
        return Some(
            "it holds optimizer state but optimizer.step_count is 0 (the manifest was edited)"
                .into(),
        );
    }
    // Every parameter of a job's model has a gradient, so after an update AdamW (and SGD with
    // momentum) holds state for each.
    let ours = match cfg.optim.optimizer {
        Opt::Adamw => ["exp_avg", "exp_avg_sq"].as_slice(),
        Opt::Sgd if cfg.optim.momentum != 0.0 => ["momentum_buffer"].as_slice(),
        Opt::Sgd => &[],
    };
    let same_optimizer = o.slots.iter().map(String::as_str).eq(ours.iter().copied());
    if o.step_count > 0 && same_optimizer && !ours.is_empty() {
        if let Some(first) = o.empty.first() {
            return Some(format!(
                "optimizer.empty lists {first} ({} of {} states) though optimizer.step_count is \
                 {}: every parameter has its state after the first update (the manifest was \
                 edited to reset it)",
                o.empty.len(),
                o.params.len() * o.slots.len(),
                o.step_count
            ));
        }
    }
    None
}

/// The checkpoint's metadata when this run may continue it: the manifest is consistent, the
/// recorded values match (or may be overridden), a GPT's token table has this run's rows (the
/// vocabulary padded to `--vocab-multiple`), and the step is below `limit` (None: the run only
/// generates, any step).
pub(super) fn check_resume(
    cfg: &TrainConfig,
    inputs: Option<&GptInputs>,
    recorded: &[Recorded],
    path: &Path,
    limit: Option<u64>,
) -> Result<Metadata, TrainError> {
    let bad = |detail: String| TrainError::Resume {
        path: path.to_path_buf(),
        detail,
    };
    let manifest = checkpoint::read_manifest_at(path)?;
    if let Some(why) = inconsistency(cfg, &manifest) {
        return Err(bad(why));
    }
    let meta = &manifest.metadata;
    for r in recorded.iter().filter(|r| !r.training || limit.is_some()) {
        let saved = meta.get(r.key).map_or("(none)", String::as_str);
        if saved == r.value || (r.soft && cfg.run.allow_resume_mismatch) {
            continue;
        }
        let (saved, suggested) = match r.key {
            "tokenizer" if recorded_tokenizer(saved).0 == recorded_tokenizer(&r.value).0 => {
                continue
            }
            "tokenizer" => (saved, recorded_tokenizer(saved).1),
            _ => (saved, saved),
        };
        let change = match r.key {
            "data.files" | "data.val_files" => match data_change(r.flag, saved, &r.value) {
                Some(c) => c,
                None => continue,
            },
            key => format!(
                "the checkpoint was saved with {key} {saved} but this run has {} {}",
                r.flag, r.value
            ),
        };
        let hint = match (r.soft, r.key.starts_with("data.")) {
            (false, _) => String::new(),
            (true, true) => "; pass --allow-resume-mismatch to resume on this data".into(),
            (true, false) => format!("; pass {} {suggested} or --allow-resume-mismatch", r.flag),
        };
        return Err(bad(format!("{change}{hint}")));
    }
    let vocab = inputs.map_or(0, |i| i.vocab);
    let saved_table = manifest
        .tensors
        .get(TOKEN_TABLE)
        .map(|t| t.shape.as_slice());
    if let (Some(i), Some(saved)) = (inputs, saved_table) {
        let rows = i.table_rows;
        if saved.first() != Some(&rows) {
            let fits = match saved.first() {
                Some(&s) if s == vocab => "; --vocab-multiple 1 loads it".to_string(),
                Some(&s) if s > vocab => format!("; --vocab-multiple {s} loads it"),
                _ => String::new(),
            };
            return Err(bad(format!(
                "the checkpoint's token table {TOKEN_TABLE} is {saved:?} but this run's is [{rows}, {}] \
                 (the vocabulary {vocab} padded to --vocab-multiple {}){fits}",
                cfg.model.width, cfg.model.vocab_multiple
            )));
        }
    }
    let step: u64 = meta
        .get("step")
        .ok_or_else(|| bad("the checkpoint records no step".into()))?
        .parse()
        .map_err(|e| bad(format!("bad step: {e}")))?;
    match limit {
        Some(s) if step >= s => Err(bad(format!(
            "the checkpoint is at step {step}, not below --steps {s}"
        ))),
        _ => Ok(manifest.metadata),
    }
}

/// How `--resume` loads: `--allow-resume-mismatch` also starts the optimizer fresh when the
/// checkpoint holds no state of this optimizer (the load names every slot it resets).
pub(super) fn load_options(cfg: &TrainConfig) -> LoadOptions {
    LoadOptions {
        reset_missing_optimizer_state: cfg.run.allow_resume_mismatch,
    }
}
