//! What a job checks before its world starts, with no communication, so every rank refuses
//! bad input alike and nothing is written first: the outputs against the inputs (`outputs`:
//! no output names an input, a symlink or another output), the data (GPT: every shard), the
//! checkpoint to resume (its recorded values, token table and step), the sample's prompt (ids
//! below the vocabulary), the checkpoint target (`--save`: ours or nothing, where this process
//! may create it), the outputs (`--metrics`, `--plot`, the configuration beside a checkpoint:
//! regular files or nothing, in writable folders; an existing metrics file or plot only the
//! run's own, or `--overwrite`), the folders the launch environment names for traces and
//! flight dumps, and `--save-hf`'s folder (nothing there, or empty).

use std::path::{Path, PathBuf};

use nix::unistd::{access, AccessFlags};
use oxiflow_collectives::env::LaunchEnv;
use oxiflow_models::checkpoint;

use super::outputs::{self, OutputPlan};
use super::resume::{check_resume, recorded, Recorded};
use super::{config_path, SaveTarget};
use crate::config::{ModelKind, TrainConfig};
use crate::error::TrainError;
use crate::tasks::gpt::{prompt_ids, GptInputs};

/// The folder a file at `path` goes in.
fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Why this process cannot create files in `dir`, if it cannot.
fn unwritable(dir: &Path) -> Option<String> {
    match std::fs::metadata(dir) {
        Err(e) => Some(format!("its folder {} is unusable: {e}", dir.display())),
        Ok(m) if !m.is_dir() => Some(format!("{} is not a folder", dir.display())),
        Ok(_) => access(dir, AccessFlags::W_OK | AccessFlags::X_OK)
            .err()
            .map(|e| {
                format!(
                    "its folder {} cannot be written (read-only or not permitted): {}",
                    dir.display(),
                    e.desc()
                )
            }),
    }
}

/// A file output at `path`: nothing there yet or a writable regular file (never a folder, a
/// FIFO or a device, which a write would replace, hang on or flood), in a writable folder.
fn check_output_file(what: &'static str, path: &Path) -> Result<(), TrainError> {
    let bad = |detail: String| TrainError::Output {
        what,
        path: path.to_path_buf(),
        detail,
    };
    if let Some(why) = unwritable(folder_of(path)) {
        return Err(bad(why));
    }
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(bad(e.to_string())),
        Ok(m) if !m.is_file() => Err(bad("exists and is not a regular file".into())),
        Ok(_) => access(path, AccessFlags::W_OK)
            .map_err(|e| bad(format!("exists and cannot be written: {}", e.desc()))),
    }
}

/// Why files cannot be created at `dir` or under its missing folders (which a save or a trace
/// creates): its nearest existing ancestor must be a folder this process may write.
fn uncreatable(dir: &Path) -> Option<String> {
    let mut at: PathBuf = dir.to_path_buf();
    while std::fs::symlink_metadata(&at).is_err() {
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p.to_path_buf(),
            _ => {
                at = PathBuf::from(".");
                break;
            }
        }
    }
    unwritable(&at)
}

/// `--save PATH`: a target the save accepts (nothing, or a checkpoint of ours, and the same
/// for its `.old` and `.partial`) where this process may create it, and a configuration file
/// beside it that can be written.
fn check_save(path: &Path) -> Result<(), TrainError> {
    let bad = |detail: String| TrainError::Output {
        what: "--save",
        path: path.to_path_buf(),
        detail,
    };
    checkpoint::check_save_target(path).map_err(|e| bad(e.to_string()))?;
    let folder = folder_of(path);
    if let Some(why) = uncreatable(folder) {
        return Err(bad(why));
    }
    let conf = config_path(path);
    if folder.exists() {
        check_output_file("--save (the configuration beside it)", &conf)?;
    }
    Ok(())
}

/// `--save-hf DIR`: nothing there or an empty folder, where this process may create it.
fn check_save_hf(dir: &Path) -> Result<(), TrainError> {
    let bad = |detail: String| TrainError::Output {
        what: "--save-hf",
        path: dir.to_path_buf(),
        detail,
    };
    match std::fs::read_dir(dir).map(|mut e| e.next().is_some()) {
        Ok(true) => Err(bad(
            "exists and is not empty (a Hugging Face save replaces nothing)".into(),
        )),
        Ok(false) => unwritable(dir).map_or(Ok(()), |why| Err(bad(why))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            uncreatable(dir).map_or(Ok(()), |why| Err(bad(why)))
        }
        Err(e) => Err(bad(e.to_string())),
    }
}

/// What the checks found: the GPT's opened data, and how the outputs are written.
pub(super) struct Checked {
    pub inputs: Option<GptInputs>,
    pub outputs: OutputPlan,
    /// What its checkpoints record of the run.
    pub recorded: Vec<Recorded>,
}

/// Every check of the module's documentation.
pub(super) fn check_inputs(cfg: &TrainConfig) -> Result<Checked, TrainError> {
    let r = &cfg.run;
    outputs::check_paths(cfg)?;
    outputs::check_heldout(cfg)?;
    match r.save.as_deref().map(SaveTarget::of) {
        Some(SaveTarget::One(p)) => check_save(&p)?,
        Some(SaveTarget::Folder(d)) => {
            if let Some(why) = uncreatable(&d) {
                return Err(TrainError::Output {
                    what: "--save",
                    path: d,
                    detail: format!("a folder of checkpoints this process cannot write: {why}"),
                });
            }
        }
        None => {}
    }
    for (what, path) in [("--metrics", &r.metrics), ("--plot", &r.plot)] {
        if let Some(path) = path {
            check_output_file(what, path)?;
        }
    }
    if let Ok(env) = LaunchEnv::from_env() {
        env.check_folders()?;
    }
    if let Some(dir) = &r.save_hf {
        check_save_hf(dir)?;
    }
    let inputs = match cfg.model.model {
        ModelKind::Gpt | ModelKind::Llama => Some(GptInputs::open(cfg)?),
        ModelKind::Mlp => None,
    };
    if let Some(i) = inputs.as_ref().filter(|_| cfg.generate.gen_tokens > 0) {
        prompt_ids(&i.tokenizer, cfg.prompt(), i.vocab)?;
        let prompts = cfg.generate.prompts();
        if let Some(bad) = prompts.iter().flatten().find(|&&id| id >= i.vocab) {
            return Err(TrainError::Config {
                detail: format!(
                    "--prompt-ids: token {bad} is not below the vocabulary size {}",
                    i.vocab
                ),
            });
        }
    }
    let recorded = recorded(cfg, inputs.as_ref())?;
    let resumed = match &r.resume {
        Some(p) => Some(check_resume(
            cfg,
            inputs.as_ref(),
            &recorded,
            p,
            cfg.resume_limit(),
        )?),
        None => None,
    };
    let outputs = outputs::plan(cfg, resumed.as_ref())?;
    Ok(Checked {
        inputs,
        outputs,
        recorded,
    })
}
