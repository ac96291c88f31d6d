//! Two network namespaces joined by a veth pair, for running several oflaunch "nodes" on one
//! machine: shared by the launcher's multi-node suite and the root package's two-node training
//! suite (which includes this file by path).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Namespaces `a` (address `SUBNET.1`) and `b` (`SUBNET.2`) joined by a veth pair (`veth-a`,
/// `veth-b`); deleted on drop.
pub struct NetPair {
    pub a: String,
    pub b: String,
}

/// Runs `ip ARGS`, its stderr in the error.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetPair {
    /// A pair named `{prefix}{pid}{n}a`/`b` on `subnet` (three octets, "10.77.0"); an error
    /// (where namespaces cannot be created, e.g. not root) names the `ip` call that failed.
    pub fn create(prefix: &str, subnet: &str) -> Result<NetPair, String> {
        static N: AtomicUsize = AtomicUsize::new(0);
        let tag = format!(
            "{prefix}{}{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let pair = NetPair {
            a: format!("{tag}a"),
            b: format!("{tag}b"),
        };
        ip(&["netns", "add", &pair.a])?;
        ip(&["netns", "add", &pair.b])?;
        ip(&[
            "link", "add", "veth-a", "netns", &pair.a, "type", "veth", "peer", "name", "veth-b",
            "netns", &pair.b,
        ])?;
        for (ns, dev, host) in [(&pair.a, "veth-a", 1), (&pair.b, "veth-b", 2)] {
            let addr = format!("{subnet}.{host}/24");
            ip(&["-n", ns, "addr", "add", &addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// [`NetPair::create`], or None after a line saying the test `test` is skipped where the
    /// namespaces cannot be created.
    pub fn create_or_skip(prefix: &str, subnet: &str, test: &str) -> Option<NetPair> {
        NetPair::create(prefix, subnet)
            .map_err(|e| eprintln!("SKIP {test}: cannot create network namespaces: {e}"))
            .ok()
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}
