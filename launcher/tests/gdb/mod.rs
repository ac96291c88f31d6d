//! A real gdb attached to a process in batch mode and busy with a shell command (as at its
//! prompt): the process stays stopped and gdb does not reap it. Shared by the launcher's and
//! the root package's catalogues (which include this file by path).

use std::process::{Child, Command, Stdio};

/// Whether gdb is installed; prints that `test` is skipped when it is not.
pub fn have_gdb(test: &str) -> bool {
    let found = Command::new("gdb").arg("--version").output().is_ok();
    if !found {
        eprintln!("SKIP {test}: gdb is not installed");
    }
    found
}

/// gdb attached to `pid`, busy for `secs` seconds; the caller kills and waits for it.
pub fn attach(pid: impl ToString, secs: u32) -> Child {
    let busy = format!("shell sleep {secs}");
    Command::new("gdb")
        .args(["-q", "-batch", "-p", &pid.to_string(), "-ex", &busy])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}
