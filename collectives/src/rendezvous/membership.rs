//! Joining a job's world through the store, before any data-plane connection: every rank
//! checks its world size against the job's (the first value written: by the launcher, or else
//! by the first rank to arrive), claims its rank (a second process claiming the same rank is
//! refused), and waits for every rank's claim. A rank that finds a mismatch writes the reason
//! to a shared refusal key, which every waiting rank polls, so the whole job fails within a
//! poll interval with the same message naming the rank and what mismatched.
//!
//! A rank of a device world also takes a seat: a rank that cannot use its device (no NCCL, a
//! device ordinal beyond those visible) refuses the job before it claims its rank, and a device
//! claimed by a second rank of the same host refuses it too (NCCL needs one device per rank).
//!
//! Keys (under the client's prefix): `oxiflow/join/world` (`"<size> by <who>"`),
//! `oxiflow/join/claim/<rank>` (claim counter), `oxiflow/join/member/<rank>/<n>` (who made
//! claim n), `oxiflow/join/refused` (the first refusal's reason), `oxiflow/join/refusal_seen/<rank>`
//! (that rank knows of the refusal), `oxiflow/join/device/<host>/<ordinal>` (seat counter) and
//! `oxiflow/join/seat/<host>/<ordinal>/<n>` (who took seat n).

use std::time::{Duration, Instant};

use super::long_wait::LongWait;
use super::StoreClient;
use crate::CommError;

/// Where the job's world size is published.
pub const WORLD_SIZE_KEY: &str = "oxiflow/join/world";
const CLAIM_PREFIX: &str = "oxiflow/join/claim/";
const MEMBER_PREFIX: &str = "oxiflow/join/member/";
const REFUSED_KEY: &str = "oxiflow/join/refused";
const SEEN_PREFIX: &str = "oxiflow/join/refusal_seen/";
const DEVICE_PREFIX: &str = "oxiflow/join/device/";
const SEAT_PREFIX: &str = "oxiflow/join/seat/";

/// The device a rank of a device world computes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSeat {
    /// Identifies the host (ranks of one host share its devices).
    pub host: String,
    /// The device ordinal, or why this rank cannot take part (said to every rank).
    pub device: Result<usize, String>,
}
impl DeviceSeat {
    /// The seat of a rank of `host` bound to CUDA device `ordinal`, given what the probe of
    /// this machine found: `visible` devices with NCCL usable, or why not (`local_ranks`:
    /// the ranks of this host, named in the message). Pure, so the launch path's decision is
    /// testable without a GPU.
    pub fn for_rank(
        host: String,
        ordinal: usize,
        visible: Result<usize, String>,
        local_ranks: usize,
    ) -> DeviceSeat {
        let device = match visible {
            Err(reason) => Err(format!("NCCL is unavailable ({reason})")),
            Ok(n) if ordinal >= n => Err(format!(
                "it is bound to CUDA device {ordinal} but {n} device(s) are visible \
                 ({local_ranks} local ranks): a device world needs one GPU per rank"
            )),
            Ok(_) => Ok(ordinal),
        };
        DeviceSeat { host, device }
    }
}

/// How often a waiting rank looks for a refusal.
const POLL: Duration = Duration::from_millis(200);
/// How long a duplicate claimer waits for the first claimer's description.
const DESCRIBE_WAIT: Duration = Duration::from_secs(2);
const OP: &str = "rendezvous join";

/// Publishes the job's world size as seen by `who` (a launcher, before it starts the ranks).
/// A different size already published is an error naming both.
pub fn publish_world_size(store: &StoreClient, world: usize, who: &str) -> Result<(), CommError> {
    let mine = format!("{world} by {who}");
    let (_, found) = store.compare_set(WORLD_SIZE_KEY, None, mine.as_bytes())?;
    let found = found.map(|v| String::from_utf8_lossy(&v).into_owned());
    match found.as_deref().map(parse_world) {
        Some(Some((w, _))) if w == world => Ok(()),
        Some(Some((w, by))) => Err(mismatch(format!(
            "{who} has world size {world}, but the job's world size is {w} (set {by})"
        ))),
        _ => Err(mismatch(format!(
            "the store holds an unreadable world size {found:?}"
        ))),
    }
}

/// Joins the world as `rank` of `world`: checks the world size, claims the rank and waits (up
/// to `timeout`) until every rank has claimed its own. `who` describes this process in
/// messages (pid, host).
pub fn join_world(
    store: &StoreClient,
    rank: usize,
    world: usize,
    who: &str,
    timeout: Duration,
) -> Result<(), CommError> {
    join_world_seated(store, rank, world, who, timeout, None)
}

/// `join_world` for a rank of a device world, which takes `seat` (see the module docs) after
/// the world-size check and before it claims its rank.
pub fn join_world_seated(
    store: &StoreClient,
    rank: usize,
    world: usize,
    who: &str,
    timeout: Duration,
    seat: Option<&DeviceSeat>,
) -> Result<(), CommError> {
    let deadline = Instant::now() + timeout;
    let me = format!("rank {rank} ({who})");
    let mine = format!("{world} by {me}");
    let (_, found) = store.compare_set(WORLD_SIZE_KEY, None, mine.as_bytes())?;
    let job_world = found.map(|v| String::from_utf8_lossy(&v).into_owned());
    match job_world.as_deref().map(parse_world) {
        Some(Some((w, _))) if w == world => {}
        Some(Some((w, by))) if rank >= w => {
            return refuse(
                store,
                rank,
                format!(
                    "{me} is not below the job's world size {w} (set {by}); it has \
                     WORLD_SIZE={world}"
                ),
            )
        }
        Some(Some((w, by))) => {
            return refuse(
                store,
                rank,
                format!("{me} has WORLD_SIZE={world}, but the job's world size is {w} (set {by})"),
            )
        }
        _ => {
            return refuse(
                store,
                rank,
                format!("{me} found an unreadable world size {job_world:?} in the store"),
            )
        }
    }

    if let Some(seat) = seat {
        take_seat(store, rank, &me, seat)?;
    }
    let claims = store.add(&format!("{CLAIM_PREFIX}{rank}"), 1)?;
    store.set(&format!("{MEMBER_PREFIX}{rank}/{claims}"), who.as_bytes())?;
    if claims > 1 {
        let first = first_claim(
            store,
            &format!("{MEMBER_PREFIX}{rank}/1"),
            "another process",
        );
        return refuse(
            store,
            rank,
            format!("rank {rank} is claimed twice: by {first} and by {who} (duplicate RANK)"),
        );
    }

    let keys: Vec<String> = (0..world).map(|r| format!("{CLAIM_PREFIX}{r}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut notice = LongWait::new(timeout, "OXIFLOW_TIMEOUT");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let waited = store.wait(&key_refs, left.min(POLL));
        if let Some(reason) = store.get(REFUSED_KEY)? {
            let _ = store.set(&format!("{SEEN_PREFIX}{rank}"), b"1");
            return Err(mismatch(format!(
                "{me}: the job was refused: {}",
                String::from_utf8_lossy(&reason)
            )));
        }
        match waited {
            Ok(_) => return Ok(()),
            Err(CommError::StoreTimeout { missing_keys, .. }) if left > POLL => {
                notice.tick(|| {
                    format!(
                        "{me}: waiting for rank(s) {:?} of {world} to join the job at the store {}",
                        ranks_of(&missing_keys),
                        store.addr()
                    )
                });
            }
            Err(CommError::StoreTimeout { missing_keys, .. }) => {
                return Err(CommError::Timeout {
                    op: format!("{OP} as {me}: ranks never arrived"),
                    timeout,
                    missing: ranks_of(&missing_keys),
                })
            }
            Err(e) => return Err(e),
        }
    }
}

/// Takes `seat` for rank `rank` (`me` describes it), refusing the job when the rank cannot use
/// a device or another rank of its host took the same one.
fn take_seat(
    store: &StoreClient,
    rank: usize,
    me: &str,
    seat: &DeviceSeat,
) -> Result<(), CommError> {
    let device = match &seat.device {
        Ok(d) => *d,
        Err(why) => return refuse(store, rank, format!("{me} cannot join: {why}")),
    };
    let host = seat.host.replace('/', "_");
    let n = store.add(&format!("{DEVICE_PREFIX}{host}/{device}"), 1)?;
    store.set(&format!("{SEAT_PREFIX}{host}/{device}/{n}"), me.as_bytes())?;
    if n == 1 {
        return Ok(());
    }
    let first = first_claim(
        store,
        &format!("{SEAT_PREFIX}{host}/{device}/1"),
        "another rank",
    );
    refuse(
        store,
        rank,
        format!(
            "{me} and {first} both use CUDA device {device} of one host: a device world needs \
             one GPU per rank (fewer ranks per host, or more GPUs)"
        ),
    )
}

/// For the rank that serves the store itself: after a refusal, waits (at most `limit`) until
/// every rank of `0..world` has read it, so none of them finds the store gone instead.
pub fn linger_after_refusal(store: &StoreClient, world: usize, limit: Duration) {
    let keys: Vec<String> = (0..world).map(|r| format!("{SEEN_PREFIX}{r}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    if let Err(e) = store.wait(&key_refs, limit) {
        tracing::debug!("{OP}: not every rank saw the refusal: {e}");
    }
}

/// What the first claimant wrote under `key` (who it is), or `unknown` when that cannot be
/// read within `DESCRIBE_WAIT`.
fn first_claim(store: &StoreClient, key: &str, unknown: &str) -> String {
    store
        .wait(&[key], DESCRIBE_WAIT)
        .ok()
        .and_then(|v| v.into_iter().next())
        .map_or_else(
            || unknown.to_string(),
            |v| String::from_utf8_lossy(&v).into_owned(),
        )
}

/// Publishes `reason` as the job's refusal (the first one wins) and returns it as this rank's
/// error, with the job's refusal when another rank's came first (so every rank's error names
/// the one the others report).
fn refuse(store: &StoreClient, rank: usize, reason: String) -> Result<(), CommError> {
    let _ = store.set(&format!("{SEEN_PREFIX}{rank}"), b"1");
    match store.compare_set(REFUSED_KEY, None, reason.as_bytes()) {
        Ok((false, Some(first))) if first != reason.as_bytes() => Err(mismatch(format!(
            "{reason} (the job was refused first: {})",
            String::from_utf8_lossy(&first)
        ))),
        Ok(_) => Err(mismatch(reason)),
        Err(e) => {
            tracing::warn!("{OP}: could not tell the other ranks why this one is refused: {e}");
            Err(mismatch(reason))
        }
    }
}

/// The ranks whose claim keys (`.../claim/<rank>`) are among `keys`.
fn ranks_of(keys: &[String]) -> Vec<usize> {
    keys.iter()
        .filter_map(|k| k.rsplit('/').next()?.parse().ok())
        .collect()
}

fn mismatch(detail: String) -> CommError {
    CommError::Mismatch {
        op: OP.into(),
        detail,
    }
}

/// `"<size> by <who>"` as (size, "by <who>").
fn parse_world(text: &str) -> Option<(usize, &str)> {
    let (w, rest) = text.split_once(' ')?;
    Some((w.parse().ok()?, rest))
}

#[cfg(test)]
mod tests {
    use super::parse_world;

    #[test]
    fn world_values_parse() {
        assert_eq!(parse_world("4 by oflaunch"), Some((4, "by oflaunch")));
        assert_eq!(parse_world("x by y"), None);
        assert_eq!(parse_world("4"), None);
    }
}
