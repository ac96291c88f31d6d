//! The rendezvous store: a token-authenticated, size-capped gRPC key-value service (set, get,
//! wait, add, delete, compare-set, barrier) that ranks use to find each other at start-up.
//!
//! Security model: the server binds exactly the address it is given; every request must carry
//! the job's secret token in the `x-oxiflow-token` metadata entry (compared in constant time)
//! or is refused with `unauthenticated`; messages, keys, values, the store's total size, the
//! number of connections and every wait are bounded, so a faulty or hostile peer cannot make it
//! fall over or hold it forever. A wait longer than `NOTICE_EVERY` says what it waits for
//! (`LongWait`). There is no TLS: the token keeps other jobs and stray clients
//! out, but on an untrusted network it can be sniffed, so bind to a private interface.

mod admission;
mod client;
mod config;
mod long_wait;
mod membership;
mod refusals;
mod server;
// tonic's service traits return `Result<_, tonic::Status>`; the state and service helpers
// follow them, so the size of `Status` is not ours to shrink.
#[allow(clippy::result_large_err)]
mod service;
#[allow(clippy::result_large_err)]
mod state;

/// The generated protobuf messages and gRPC stubs (`oxiflow.rendezvous.v1`).
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("oxiflow.rendezvous.v1");
}

pub use client::{ClientOptions, StoreClient};
pub use config::{
    constant_time_eq, validate_token, StoreConfig, DEFAULT_MAX_MESSAGE_BYTES, MAX_TOKEN_BYTES,
};
pub use long_wait::{LongWait, NOTICE_EVERY};
pub use membership::{
    join_world, join_world_seated, linger_after_refusal, publish_world_size, DeviceSeat,
    WORLD_SIZE_KEY,
};
pub use server::StoreServer;

use crate::CommError;

/// The gRPC metadata entry that carries the job token.
pub const TOKEN_METADATA_KEY: &str = "x-oxiflow-token";

/// A fresh job token: 32 random bytes from the OS, as 64 lowercase hex digits.
pub fn generate_token() -> Result<String, CommError> {
    random_hex(32)
}

/// `n` random bytes from the OS as lowercase hex.
pub(crate) fn random_hex(n: usize) -> Result<String, CommError> {
    let mut bytes = vec![0u8; n];
    getrandom::getrandom(&mut bytes).map_err(|e| {
        CommError::Rendezvous(format!("cannot read {n} random bytes from the OS: {e}"))
    })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
