//! What a run writes, against what it reads. The outputs (`--metrics`, `--plot` and its
//! temporary file, `--save` with the `.old`, `.partial`, lock and configuration files beside
//! it) never name an input of the run (`--data`, `--val-data`, the `--config` job file, the
//! checkpoint resumed), never a symlink, never one file twice, and never a file inside a
//! checkpoint a save replaces (saving over the checkpoint the run resumes from is how a run
//! continues). Two names are one file when their (device, inode) are equal (hard links, `./x`
//! and `x`, a path through a symlinked folder), or, where a file does not exist yet, when
//! their canonical paths are (the canonical folder and the name).
//!
//! An existing metrics file or plot belongs to the run named in it (a metrics file's first
//! record, a plot's embedded id); the run's id is kept in its checkpoints. Such a file is
//! continued (metrics appended, the plot redrawn) only by a run resuming a checkpoint of its
//! run, or by the same oflaunch job restarting before its first checkpoint; anything else is
//! refused unless `--overwrite`.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use oxiflow_collectives::env::LaunchEnv;
use oxiflow_models::checkpoint::Metadata;
use sha2::{Digest, Sha256};

use super::history::History;
use super::{config_path, SaveTarget};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::{metrics, plot};

/// The checkpoint metadata key of the run's id.
pub const RUN_ID_KEY: &str = "run_id";

/// `<path><suffix>`.
pub(super) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s: OsString = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// `path` made absolute and free of symlinks: its nearest existing ancestor canonical, the
/// rest of its names joined as given.
fn canonical(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut at = path.to_path_buf();
    loop {
        if let Ok(c) = std::fs::canonicalize(&at) {
            return rest.iter().rev().fold(c, |p, n| p.join(n));
        }
        match (at.file_name(), at.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name.to_owned());
                at = match parent.as_os_str().is_empty() {
                    true => PathBuf::from("."),
                    false => parent.to_path_buf(),
                };
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// What a file is to the run, where that changes the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Plain,
    /// The checkpoint resumed (and its `.old`).
    Resumed,
    /// The `--config` job file.
    JobFile,
    /// The configuration a save writes beside its checkpoint.
    SaveConfig,
    /// Part of the checkpoint a save replaces (it, its `.old`, `.partial` and locks).
    Replaced,
}

/// A file or folder the run reads or writes, and what names it.
struct Named {
    /// The flag (and the part of its target) that names it.
    what: String,
    path: PathBuf,
    canonical: PathBuf,
    /// (device, inode) when it exists.
    inode: Option<(u64, u64)>,
    /// A folder whose whole tree counts (a checkpoint).
    tree: bool,
    role: Role,
}

impl Named {
    fn new(what: impl Into<String>, path: &Path, tree: bool) -> Named {
        Named {
            what: what.into(),
            path: path.to_path_buf(),
            canonical: canonical(path),
            inode: std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino())),
            tree,
            role: Role::Plain,
        }
    }

    fn as_(mut self, role: Role) -> Named {
        self.role = role;
        self
    }

    /// Whether `self` and `other` are one file.
    fn same(&self, other: &Named) -> bool {
        match (self.inode, other.inode) {
            (Some(a), Some(b)) => a == b,
            _ => self.canonical == other.canonical,
        }
    }

    /// Whether `self` lies inside the tree `other` (or is it).
    fn inside(&self, other: &Named) -> bool {
        other.tree && (self.same(other) || self.canonical.starts_with(&other.canonical))
    }

    fn shown(&self) -> String {
        let given = self.path.display().to_string();
        let canonical = self.canonical.display().to_string();
        match given == canonical {
            true => given,
            false => format!("{given} ({canonical})"),
        }
    }
}

/// The files of `--data` or `--val-data`: each file a glob matches, or the path.
fn data_files(what: &str, pattern: &str, out: &mut Vec<Named>) {
    if pattern.contains(['*', '?', '[']) {
        if let Ok(paths) = glob::glob(pattern) {
            for p in paths.flatten() {
                out.push(Named::new(what, &p, false));
            }
        }
    } else {
        out.push(Named::new(what, Path::new(pattern), false));
    }
}

/// What the run reads; `resume` is the checkpoint it resumes (resolved).
fn inputs(cfg: &TrainConfig) -> Vec<Named> {
    let mut v = Vec::new();
    if let Some(d) = &cfg.data.data {
        data_files("--data", d, &mut v);
    }
    if let Some(d) = &cfg.data.val_data {
        data_files("--val-data", d, &mut v);
    }
    if let Some(f) = &cfg.job_file {
        v.push(Named::new("--config", f, false).as_(Role::JobFile));
    }
    if let Some(d) = &cfg.model.from_hf {
        v.push(Named::new("--from-hf", d, true));
    }
    if let Some(r) = &cfg.run.resume {
        v.push(Named::new("--resume", r, true).as_(Role::Resumed));
        v.push(
            Named::new(
                "--resume (its previous checkpoint)",
                &with_suffix(r, ".old"),
                true,
            )
            .as_(Role::Resumed),
        );
    }
    v
}

/// What the run writes.
fn outputs(cfg: &TrainConfig) -> Vec<Named> {
    let r = &cfg.run;
    let mut v = Vec::new();
    if let Some(p) = &r.metrics {
        v.push(Named::new("--metrics", p, false));
    }
    if let Some(d) = &r.save_hf {
        v.push(Named::new("--save-hf", d, true));
    }
    if let Some(p) = &r.plot {
        v.push(Named::new("--plot", p, false));
        let tmp = plot::partial_path(p);
        v.push(Named::new("--plot (its temporary file)", &tmp, false));
    }
    match r.save.as_deref().map(SaveTarget::of) {
        Some(SaveTarget::Folder(d)) => {
            let lock = with_suffix(&d, ".job.lock");
            let what = "--save (its .job.lock beside it)";
            v.push(Named::new(what, &lock, false).as_(Role::Replaced));
        }
        Some(SaveTarget::One(p)) => {
            v.push(Named::new("--save", &p, true).as_(Role::Replaced));
            let siblings = [
                (".old", true),
                (".partial", true),
                (".lock", false),
                (".job.lock", false),
            ];
            for (suffix, tree) in siblings {
                let what = format!("--save (its {suffix} beside it)");
                let n = Named::new(what, &with_suffix(&p, suffix), tree);
                v.push(n.as_(Role::Replaced));
            }
            let conf = config_path(&p);
            let what = "--save (the configuration beside it)";
            v.push(Named::new(what, &conf, false).as_(Role::SaveConfig));
            let what = "--save (the configuration's temporary file)";
            v.push(Named::new(what, &with_suffix(&conf, ".partial"), false));
        }
        None => {}
    }
    v
}

fn refuse(out: &Named, detail: String) -> TrainError {
    TrainError::Config {
        detail: format!("{} {}: {detail}", out.what, out.path.display()),
    }
}

/// Refuses outputs that are symlinks, name one file twice, or name (or lie in, or hold) an
/// input (see the module docs).
pub(super) fn check_paths(cfg: &TrainConfig) -> Result<(), TrainError> {
    let outs = outputs(cfg);
    for o in &outs {
        if std::fs::symlink_metadata(&o.path).is_ok_and(|m| m.is_symlink()) {
            return Err(refuse(
                o,
                "is a symlink; a run never writes through one (give the file it points to, or \
                 another path)"
                    .into(),
            ));
        }
    }
    for (i, a) in outs.iter().enumerate() {
        for b in &outs[i + 1..] {
            if a.same(b) || a.inside(b) || b.inside(a) {
                return Err(refuse(
                    a,
                    format!(
                        "is also where {} writes ({}); two outputs never share a file: give \
                         each its own path",
                        b.what,
                        b.shown()
                    ),
                ));
            }
        }
    }
    let ins = inputs(cfg);
    for o in &outs {
        for i in &ins {
            // A save replaces the checkpoint it resumed from: the run continues it.
            let resumed = i.role == Role::Resumed && o.role == Role::Replaced;
            if (o.same(i) || o.inside(i) || i.inside(o)) && !resumed {
                let what = if i.role == Role::JobFile && o.role == Role::SaveConfig {
                    "copy the job file and pass the copy as --config"
                } else {
                    "choose another path"
                };
                let how = if o.same(i) {
                    format!("is {}'s {}", i.what, i.shown())
                } else if o.inside(i) {
                    format!("lies inside {}'s {}", i.what, i.shown())
                } else {
                    format!("holds {}'s {}, which a save replaces", i.what, i.shown())
                };
                return Err(refuse(
                    o,
                    format!("{how}; an output never writes over an input of the run ({what})"),
                ));
            }
        }
    }
    Ok(())
}

/// Refuses `--val-data` files that are `--data` files: held-out data trained on says nothing.
pub(super) fn check_heldout(cfg: &TrainConfig) -> Result<(), TrainError> {
    let (Some(d), Some(v)) = (&cfg.data.data, &cfg.data.val_data) else {
        return Ok(());
    };
    let (mut train, mut held) = (Vec::new(), Vec::new());
    data_files("--data", d, &mut train);
    data_files("--val-data", v, &mut held);
    for h in &held {
        if let Some(t) = train.iter().find(|t| t.same(h)) {
            return Err(TrainError::Config {
                detail: format!(
                    "--val-data {v}: its file {} is --data's {}: held-out data must not be \
                     trained on (give other files, or leave --val-data out to hold out the \
                     last 10% of --data)",
                    h.shown(),
                    t.shown()
                ),
            });
        }
    }
    Ok(())
}

/// Which start of an oflaunch job this is (the launch contract's `restart_count`; 0 outside
/// oflaunch).
fn restart_count() -> u32 {
    LaunchEnv::from_env().map_or(0, |e| e.restart_count)
}

/// The run's id: the resumed checkpoint's; else, under a launcher's job token, one derived
/// from it (the same on every rank and every restart of the job, revealing nothing of the
/// token); else a random one.
fn run_id(resumed: Option<&Metadata>) -> String {
    if let Some(id) = resumed.and_then(|m| m.get(RUN_ID_KEY)) {
        return id.clone();
    }
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    if let Some(token) = LaunchEnv::from_env().ok().and_then(|e| e.token) {
        let digest = Sha256::digest(format!("oxiflow run\0{token}"));
        return hex(&digest[..8]);
    }
    let mut b = [0u8; 8];
    if getrandom::getrandom(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = ((t as u64) ^ u64::from(std::process::id())).to_le_bytes();
    }
    hex(&b)
}

/// How the run writes its outputs.
#[derive(Clone, Debug)]
pub struct OutputPlan {
    /// The run's id, named in its metrics, plot and checkpoints.
    pub run_id: String,
    /// Whether the metrics file is continued (a resumed run's own) rather than started.
    pub append_metrics: bool,
    /// The losses and curves of the run so far (a resumed run's, from its checkpoint).
    pub history: History,
}

/// The run an existing, non-empty output names (`Some(None)`: it names none); None when there
/// is nothing there to lose.
fn owner(
    path: &Path,
    read: fn(&Path) -> Result<Option<String>, TrainError>,
) -> Result<Option<Option<String>>, TrainError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() && m.len() > 0 => Ok(Some(read(path)?)),
        _ => Ok(None),
    }
}

/// The plan of the module's documentation for a run that resumes a checkpoint with
/// `resumed` metadata (None: a fresh start).
pub(super) fn plan(
    cfg: &TrainConfig,
    resumed: Option<&Metadata>,
) -> Result<OutputPlan, TrainError> {
    let run_id = run_id(resumed);
    let resuming = resumed.is_some_and(|m| m.contains_key(RUN_ID_KEY));
    let restarting = resumed.is_none() && restart_count() > 0;
    let r = &cfg.run;
    let mut append_metrics = false;
    let files = [
        (
            "--metrics",
            &r.metrics,
            metrics::run_of as fn(&Path) -> _,
            "holds the records",
        ),
        (
            "--plot",
            &r.plot,
            plot::run_of as fn(&Path) -> _,
            "is the plot",
        ),
    ];
    for (what, path, read, holds) in files {
        let Some(path) = path else { continue };
        let Some(found) = owner(path, read)? else {
            continue;
        };
        let ours = found.as_deref() == Some(run_id.as_str());
        if ours && resuming {
            append_metrics |= what == "--metrics";
            continue;
        }
        if r.overwrite || (ours && restarting) {
            continue;
        }
        let whose = match &found {
            Some(id) => format!("{holds} of run {id}"),
            None => "names no run of this trainer (not its output)".into(),
        };
        return Err(TrainError::Config {
            detail: format!(
                "{what} {}: exists and {whose}; a run continues its own file only when it \
                 resumes that run's checkpoint, and this run ({run_id}) would replace it: pass \
                 --overwrite to replace it, or choose another path",
                path.display()
            ),
        });
    }
    let history = match resumed {
        Some(meta) => History::from_metadata(meta)?,
        None => History::default(),
    };
    Ok(OutputPlan {
        run_id,
        append_metrics,
        history,
    })
}
