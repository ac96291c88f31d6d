//! Checkpoints in safetensors: a directory with one file per writing rank
//! (`rank-00003.safetensors`, holding that rank's pieces) and `manifest.json` (every tensor's
//! shape, dtype, the layout it was saved under and the global region of each saved piece; the
//! optimizer's slots, parameters and step count; free-form metadata; its own checksum).
//!
//! Saving (a collective: every rank of the world calls it) writes each distinct piece once:
//! partial-sum axes are reduced first, and of the copies along broadcast axes only mesh
//! coordinate 0 writes. With `SaveOptions::gathered`, the first rank of each placement writes
//! the whole value instead. Loading needs no communication: each rank reads the regions its
//! own layout needs from the files that hold them, so a checkpoint saved under one parallel
//! layout (DP=4) loads under another (TP=2). Writes are atomic (see `atomic`): a crash at any
//! point leaves the previous checkpoint loadable; a save holds a lock on its path (see `lock`).
//!
//! A checkpoint is whole or refused: a load verifies the manifest's checksum and every file
//! and piece (sizes, checksums, layouts, finite values) before it changes anything, requires
//! the optimizer state of every (parameter, slot) it loads into, and when `<path>` is damaged
//! but `<path>.old` is complete, loads that with a warning naming both (see `locate`).

mod atomic;
mod layout;
mod limits;
mod load;
mod locate;
mod lock;
mod manifest;
mod paths;
mod pieces;
mod save;
mod verify;

use std::collections::BTreeMap;
use std::time::Duration;

use oxiflow_placement::NamedMesh;

pub use atomic::check_save_target;
pub use layout::LayoutEntry;
pub use load::{
    load, load_tensors, load_with, read_manifest_at, read_manifest_names, LoadOptions, LoadReport,
};
pub use locate::newest_complete;
pub use lock::{JobLock, DEFAULT_LOCK_WAIT};
pub use manifest::{FileEntry, Manifest, OptimizerEntry, PieceEntry, TensorEntry};
pub use save::{save, save_tensors};

/// Points of a save where `SaveOptions::stage_hook` is called (a test hook: a crash there
/// must leave the previous checkpoint loadable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveStage {
    /// Half of this rank's file is written.
    MidFile,
    /// Every file and the manifest are written under `<path>.partial`, nothing published yet.
    BeforePublish,
    /// The previous checkpoint was moved to `<path>.old`; the new one is not in place yet.
    BetweenRenames,
}

/// How to save.
#[derive(Clone, Default)]
pub struct SaveOptions {
    /// The first rank of each placement writes whole tensors (instead of every rank its pieces).
    pub gathered: bool,
    /// Called at each `SaveStage` (tests use it to crash a save on purpose).
    pub stage_hook: Option<fn(SaveStage)>,
    /// How long rank 0 waits for another save of the same path to finish before failing
    /// (None: `DEFAULT_LOCK_WAIT`).
    pub lock_wait: Option<Duration>,
    /// The job's named meshes: a tensor saved in pieces on one of their placements records
    /// the names of its mesh axes.
    pub meshes: Vec<NamedMesh>,
}

impl std::fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("gathered", &self.gathered)
            .field("lock_wait", &self.lock_wait)
            .field("meshes", &self.meshes)
            .finish()
    }
}

/// Free-form string metadata stored in the manifest (e.g. the training step).
pub type Metadata = BTreeMap<String, String>;

/// Name of the checkpoint entry of an optimizer state slot.
pub fn optim_key(param: &str, slot: &str) -> String {
    format!("optim/{param}/{slot}")
}
