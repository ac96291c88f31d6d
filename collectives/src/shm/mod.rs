//! Shared-memory data plane for ranks of one host. At connect time the ranks publish a host id
//! in the rendezvous store; same-host ranks each create a segment (`segment`), map their peers'
//! and unlink their own once everyone has mapped it, so nothing is left in /dev/shm. Collectives
//! of a group whose members all share the host then run through the segments (`call`, `ops`):
//! a writer copies into its own slot and posts a tagged word; readers reduce or copy straight
//! out of the writer's slot into their buffers and acknowledge. TCP stays the liveness channel.

mod call;
mod direct;
mod ops;
mod segment;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::rendezvous::StoreClient;
use crate::CommError;
pub(crate) use call::{Call, OpCode};
use segment::{path_of, Segment};

/// The shared-memory plane's decoders of a peer's slot words, public for the fuzz tests only.
#[doc(hidden)]
pub mod wire {
    pub use super::call::{post_ready, seal_of, sealed_info, INFO_WORDS};
}

/// This process's slots: what was last posted in each and who must acknowledge it.
#[derive(Default)]
pub(crate) struct SlotState {
    last_post: [u64; 2],
    last_readers: [Vec<usize>; 2],
}

/// The same-host part of a world: segments by world rank (`None`: another host or no shm).
pub(crate) struct ShmWorld {
    segs: Vec<Option<Segment>>,
    state: Mutex<SlotState>,
    /// Every shm rank of this host can read its peers' memory directly (process_vm_readv).
    cma: bool,
}

impl ShmWorld {
    /// Whether every one of `ranks` (world ranks) is reachable through shared memory.
    pub fn covers(&self, ranks: &[usize]) -> bool {
        ranks
            .iter()
            .all(|&r| self.segs.get(r).is_some_and(Option::is_some))
    }
    pub fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Identifies the host (and its /dev/shm): machine id, boot id and host name.
pub(crate) fn host_id() -> String {
    let mut name = [0u8; 256];
    // SAFETY: writes at most name.len() bytes into the buffer.
    let rc = unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len()) };
    let host = if rc == 0 {
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        String::from_utf8_lossy(&name[..end]).into_owned()
    } else {
        String::new()
    };
    format!(
        "{}/{}/{host}",
        read_trimmed("/etc/machine-id"),
        read_trimmed("/proc/sys/kernel/random/boot_id")
    )
}

fn wait_all(
    store: &StoreClient,
    keys: &[String],
    deadline: Instant,
    timeout: Duration,
    rank_of: impl Fn(&str) -> Option<usize>,
) -> Result<Vec<Vec<u8>>, CommError> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let left = deadline.saturating_duration_since(Instant::now());
    store.wait(&refs, left).map_err(|e| match e {
        CommError::StoreTimeout { missing_keys, .. } => CommError::Timeout {
            op: "shm setup".into(),
            timeout,
            missing: missing_keys.iter().filter_map(|k| rank_of(k)).collect(),
        },
        other => other,
    })
}

/// Finds the same-host ranks and maps their segments. Every rank of the world calls this (with
/// `enabled` false it only announces that it takes no part). Returns `None` when this rank has
/// no usable same-host peer. The set of shm ranks is the same on every rank of a host.
/// The /dev/shm names that ranks `ranks` of a job use for their segments, found through the
/// job's store handle (with the job's key prefix). A rank unlinks its own name once every peer
/// has mapped it; one killed before that leaves it behind, and the launcher removes these.
/// Empty when the job never got as far as its data plane.
pub fn job_segment_paths(
    store: &StoreClient,
    ranks: impl IntoIterator<Item = usize>,
) -> Result<Vec<String>, CommError> {
    let key = format!("{}/nonce", crate::tcp::mesh::KEY_PREFIX);
    Ok(match store.get(&key)? {
        Some(nonce) => ranks.into_iter().map(|r| path_of(&nonce, r)).collect(),
        None => Vec::new(),
    })
}

pub(crate) fn setup(
    store: &StoreClient,
    rank: usize,
    world: usize,
    nonce: &[u8],
    enabled: bool,
    timeout: Duration,
) -> Result<Option<ShmWorld>, CommError> {
    let deadline = Instant::now() + timeout;
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let key = |what: &str, r: usize| format!("oxiflow/shm/{hex}/{what}/{r}");
    let rank_of = |k: &str| k.rsplit('/').next().and_then(|r| r.parse().ok());
    let host = host_id();
    store.set(
        &key("host", rank),
        format!("{}{host}", if enabled { "1" } else { "0" }).as_bytes(),
    )?;
    let keys: Vec<String> = (0..world).map(|r| key("host", r)).collect();
    let hosts = wait_all(store, &keys, deadline, timeout, rank_of)?;
    let mine = format!("1{host}");
    let local: Vec<usize> = (0..world)
        .filter(|&r| hosts[r] == mine.as_bytes())
        .collect();
    if !enabled || local.len() < 2 {
        return Ok(None);
    }
    // Create ours, announce the outcome, map the peers', announce again, then unlink.
    let own = Segment::create(&path_of(nonce, rank), world, rank);
    if let Err(e) = &own {
        tracing::warn!("shm setup: rank {rank} falls back to TCP: {e}");
    }
    store.set(&key("made", rank), if own.is_ok() { b"1" } else { b"0" })?;
    let keys: Vec<String> = local.iter().map(|&r| key("made", r)).collect();
    let made = wait_all(store, &keys, deadline, timeout, rank_of)?;
    let mut segs: Vec<Option<Segment>> = (0..world).map(|_| None).collect();
    let mut ok = own.is_ok();
    for (&r, m) in local.iter().zip(&made) {
        if r == rank || m != b"1" {
            continue;
        }
        match Segment::open(&path_of(nonce, r), world, r) {
            Ok(s) => segs[r] = Some(s),
            Err(e) => {
                tracing::warn!("shm setup: rank {rank} cannot map rank {r}'s segment: {e}");
                ok = false;
            }
        }
    }
    let cma = ok && segs.iter().flatten().all(Segment::probe_cma);
    let status: &[u8] = match (ok, cma) {
        (true, true) => b"2",
        (true, false) => b"1",
        _ => b"0",
    };
    store.set(&key("mapped", rank), status)?;
    let keys: Vec<String> = local.iter().map(|&r| key("mapped", r)).collect();
    let mapped = wait_all(store, &keys, deadline, timeout, rank_of)?;
    let mut own = match own {
        Ok(s) => s,
        Err(_) => return Ok(None),
    };
    own.unlink();
    if !ok {
        return Ok(None);
    }
    segs[rank] = Some(own);
    let mut usable = 0;
    for (&r, (m, g)) in local.iter().zip(made.iter().zip(&mapped)) {
        if m != b"1" || g.as_slice() == b"0" {
            segs[r] = None;
        } else {
            usable += 1;
        }
    }
    if usable < 2 {
        return Ok(None);
    }
    let cma = local
        .iter()
        .zip(made.iter().zip(&mapped))
        .filter(|(_, (m, g))| m.as_slice() == b"1" && g.as_slice() != b"0")
        .all(|(_, (_, g))| g.as_slice() == b"2");
    Ok(Some(ShmWorld {
        segs,
        cma,
        state: Mutex::new(SlotState::default()),
    }))
}
