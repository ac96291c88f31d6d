//! Limits of the rendezvous store (message, key, value and store sizes; wait caps; connections)
//! and the validation of keys, values and tokens against them.

use std::time::Duration;

use crate::CommError;

/// Default cap on one gRPC message, in either direction: 16 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;
/// Longest accepted token, in bytes.
pub const MAX_TOKEN_BYTES: usize = 1024;

/// Limits the server enforces; every field has a safe default (`StoreConfig::default()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Largest gRPC message accepted or sent, in bytes (both directions).
    pub max_message_bytes: usize,
    /// Longest key, in bytes (keys are non-empty UTF-8).
    pub max_key_bytes: usize,
    /// Largest value, in bytes.
    pub max_value_bytes: usize,
    /// Most keys one wait may name.
    pub max_keys_per_wait: usize,
    /// Most entries (keys plus barriers) the store holds.
    pub max_entries: usize,
    /// Most bytes (keys plus values) the store holds.
    pub max_total_bytes: usize,
    /// Longest a single server-side wait or barrier call may block; clients asking for longer
    /// waits re-issue their call, so no request holds the server longer than this.
    pub max_wait: Duration,
    /// Most simultaneous TCP connections. At the cap, the oldest connection that has not yet
    /// presented the token is closed and the new one is refused (its client retries).
    pub max_connections: usize,
    /// A new connection must carry a request with the job token within this long (the whole
    /// HTTP/2 handshake included), or it is closed: silent sockets and partial prefaces cannot
    /// hold connection slots.
    pub handshake_timeout: Duration,
    /// Most connections one peer address may hold before presenting the token; when it opens
    /// one more, its oldest such connection is closed.
    pub max_pending_per_peer: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_key_bytes: 4096,
            max_value_bytes: DEFAULT_MAX_MESSAGE_BYTES - 64 * 1024,
            max_keys_per_wait: 65_536,
            max_entries: 1 << 20,
            max_total_bytes: 1 << 30,
            max_wait: Duration::from_secs(30),
            max_connections: 4096,
            handshake_timeout: Duration::from_secs(10),
            max_pending_per_peer: 1024,
        }
    }
}

impl StoreConfig {
    /// Checks that the limits are usable (all positive, values fit in a message).
    pub fn validate(&self) -> Result<(), CommError> {
        let bad = |detail: String| {
            Err(CommError::InvalidArgument {
                op: "rendezvous store config".into(),
                detail,
            })
        };
        if self.max_message_bytes < 1024 {
            return bad(format!(
                "max_message_bytes {} is below 1024",
                self.max_message_bytes
            ));
        }
        if self.max_key_bytes == 0 || self.max_value_bytes == 0 || self.max_keys_per_wait == 0 {
            return bad(
                "max_key_bytes, max_value_bytes and max_keys_per_wait must be positive".into(),
            );
        }
        if self.max_value_bytes > self.max_message_bytes {
            return bad(format!(
                "max_value_bytes {} exceeds max_message_bytes {}",
                self.max_value_bytes, self.max_message_bytes
            ));
        }
        if self.max_entries == 0
            || self.max_total_bytes == 0
            || self.max_connections == 0
            || self.max_pending_per_peer == 0
        {
            return bad(
                "max_entries, max_total_bytes, max_connections and max_pending_per_peer must be \
                 positive"
                    .into(),
            );
        }
        if self.max_wait.is_zero() || self.handshake_timeout.is_zero() {
            return bad("max_wait and handshake_timeout must be positive".into());
        }
        Ok(())
    }
}

/// Checks a token: non-empty, at most `MAX_TOKEN_BYTES`, printable ASCII without spaces (it
/// travels as gRPC metadata).
pub fn validate_token(token: &str, op: &str) -> Result<(), CommError> {
    let detail = if token.is_empty() {
        "the token is empty (oflaunch generates one; otherwise set OXIFLOW_TOKEN)".to_string()
    } else if token.len() > MAX_TOKEN_BYTES {
        format!(
            "the token has {} bytes, more than {MAX_TOKEN_BYTES}",
            token.len()
        )
    } else if !token.bytes().all(|b| b.is_ascii_graphic()) {
        "the token must be printable ASCII without spaces".to_string()
    } else {
        return Ok(());
    };
    Err(CommError::InvalidArgument {
        op: op.to_string(),
        detail,
    })
}

/// Checks a key against the limits: non-empty and at most `max_key_bytes`.
pub fn check_key(op: &str, key: &str, max_key_bytes: usize) -> Result<(), String> {
    if key.is_empty() {
        return Err(format!("{op}: empty key"));
    }
    if key.len() > max_key_bytes {
        return Err(format!(
            "{op}: key of {} bytes (starting {:?}) exceeds the limit of {max_key_bytes} bytes",
            key.len(),
            key.chars().take(32).collect::<String>()
        ));
    }
    Ok(())
}

/// Checks a value's size against `max_value_bytes`.
pub fn check_value(op: &str, key: &str, len: usize, max_value_bytes: usize) -> Result<(), String> {
    if len > max_value_bytes {
        return Err(format!(
            "{op}: value of {len} bytes for key {key:?} exceeds the limit of {max_value_bytes} bytes"
        ));
    }
    Ok(())
}

/// Constant-time equality of two byte strings (the time depends only on the lengths).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= std::hint::black_box(x ^ y);
    }
    std::hint::black_box(diff) == 0
}
