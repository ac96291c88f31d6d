//! The job token oflaunch hands to the store and the workers: read from `--token-file` or the
//! `OXIFLOW_TOKEN` environment variable, never from the command line (every user can read a
//! process's arguments in /proc/PID/cmdline).

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use oxiflow_collectives::rendezvous::{validate_token, MAX_TOKEN_BYTES};

use crate::error::LaunchError;

/// The token from `file` (its first line, surrounding whitespace removed), else from `env`
/// (`OXIFLOW_TOKEN`'s value), else None. A file that other users can read is refused, as is
/// an empty or malformed token, and an `OXIFLOW_TOKEN` that is set but empty.
pub fn job_token(file: Option<&Path>, env: Option<String>) -> Result<Option<String>, LaunchError> {
    if env.as_deref().is_some_and(|t| t.trim().is_empty()) {
        return Err(LaunchError::Usage(
            "OXIFLOW_TOKEN is set but empty: unset it (node 0 then makes a token) or set the \
             job's token"
                .into(),
        ));
    }
    let Some(path) = file else {
        return env.map(|t| check(t, "OXIFLOW_TOKEN")).transpose();
    };
    let shown = path.display();
    let mut f = std::fs::File::open(path)
        .map_err(|e| LaunchError::io(format!("--token-file {shown}: cannot open"), e))?;
    let meta = f
        .metadata()
        .map_err(|e| LaunchError::io(format!("--token-file {shown}: cannot stat"), e))?;
    if meta.mode() & 0o077 != 0 {
        return Err(LaunchError::Usage(format!(
            "--token-file {shown}: other users can access it (mode {:o}); run `chmod 600 {shown}`",
            meta.mode() & 0o777
        )));
    }
    let mut text = String::new();
    // A little more than the longest token plus a newline: a longer file is refused, not read.
    let limit = MAX_TOKEN_BYTES as u64 + 3;
    f.by_ref()
        .take(limit)
        .read_to_string(&mut text)
        .map_err(|e| LaunchError::io(format!("--token-file {shown}: cannot read"), e))?;
    if text.len() as u64 >= limit {
        return Err(LaunchError::Usage(format!(
            "--token-file {shown}: longer than a token ({MAX_TOKEN_BYTES} bytes at most)"
        )));
    }
    let token = text.lines().next().unwrap_or("").trim().to_string();
    check(token, &format!("--token-file {shown}")).map(Some)
}

fn check(token: String, source: &str) -> Result<String, LaunchError> {
    validate_token(&token, source).map_err(|e| LaunchError::Usage(format!("{source}: {e}")))?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file_with(name: &str, text: &str, mode: u32) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("oflaunch_token_{name}_{}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn file_then_environment() {
        let p = file_with("ok", "abc123\n", 0o600);
        let t = job_token(Some(&p), Some("from-env".into())).unwrap();
        assert_eq!(t.as_deref(), Some("abc123"));
        assert_eq!(
            job_token(None, Some("from-env".into())).unwrap().as_deref(),
            Some("from-env")
        );
        let e = job_token(None, Some(String::new()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("OXIFLOW_TOKEN is set but empty"), "{e}");
        assert_eq!(job_token(None, None).unwrap(), None);
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let open = file_with("open", "abc\n", 0o644);
        let e = job_token(Some(&open), None).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        let empty = file_with("empty", "\n", 0o600);
        let e = job_token(Some(&empty), None).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        let long = file_with("long", &"a".repeat(5000), 0o600);
        let e = job_token(Some(&long), None).unwrap_err().to_string();
        assert!(e.contains("longer than a token"), "{e}");
        let missing = std::env::temp_dir().join("oflaunch_token_does_not_exist");
        let e = job_token(Some(&missing), None).unwrap_err().to_string();
        assert!(e.contains("cannot open"), "{e}");
        let e = job_token(None, Some("has space".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("OXIFLOW_TOKEN"), "{e}");
        for p in [open, empty, long] {
            let _ = std::fs::remove_file(p);
        }
    }
}
