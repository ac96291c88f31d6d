//! Folders the launch environment names for files written later (`OXIFLOW_TRACE_DIR`,
//! `OXIFLOW_FLIGHT_DIR`, `OXIFLOW_KERNEL_CACHE`; oflaunch's `--trace` and `--log-dir`), checked
//! before anything runs: an existing folder, or one to be created under an existing folder, on
//! a file system that holds files (not /proc, /sys, cgroups or another kernel file system),
//! not mounted read-only, where this process may create files.

use std::path::Path;

/// Kernel file systems that cannot hold the files a rank writes, by `statfs` magic number.
const KERNEL_FILE_SYSTEMS: [(u64, &str); 19] = [
    (0x9fa0, "procfs"),
    (0x6265_6572, "sysfs"),
    (0x0027_e0eb, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0x1cd1, "devpts"),
    (0x6265_6570, "configfs"),
    (0xcafe_4a11, "bpf"),
    (0x6165_676c, "pstore"),
    (0xde5e_81e4, "efivarfs"),
    (0x4249_4e4d, "binfmt_misc"),
    (0x6573_5543, "fusectl"),
    (0x1980_0202, "mqueue"),
    (0x6e73_6673, "nsfs"),
    (0xf97c_ff8c, "selinuxfs"),
    (0x4341_5d53, "smackfs"),
    (0x9584_58f6, "hugetlbfs"),
];

/// Why `dir` cannot hold files this process writes there later (None: it can).
pub fn unfit_folder(dir: &Path) -> Option<String> {
    if dir.as_os_str().is_empty() {
        return Some("the path is empty".into());
    }
    // The folder itself, or the nearest existing folder it would be created in.
    let mut existing = dir;
    let meta = loop {
        match std::fs::metadata(existing) {
            Ok(m) => break m,
            // Missing, or under a file: the nearest existing part says which.
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(libc::ENOTDIR) =>
            {
                match existing.parent() {
                    Some(p) if !p.as_os_str().is_empty() => existing = p,
                    // A relative path is made in the working folder.
                    Some(_) => existing = Path::new("."),
                    None => return Some(format!("nothing of it exists ({e})")),
                }
            }
            Err(e) => return Some(format!("{} cannot be examined: {e}", existing.display())),
        }
    };
    let shown = existing.display();
    if !meta.is_dir() {
        return Some(format!("{shown} is not a folder"));
    }
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
    let path = std::ffi::CString::new(existing.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs reads a NUL-terminated path and fills the struct we own.
    if unsafe { libc::statfs(path.as_ptr(), fs.as_mut_ptr()) } == 0 {
        // SAFETY: statfs returned 0, so it filled the struct.
        let fs = unsafe { fs.assume_init() };
        let magic = fs.f_type as u64 & 0xffff_ffff;
        if let Some((_, name)) = KERNEL_FILE_SYSTEMS.iter().find(|(m, _)| *m == magic) {
            return Some(format!(
                "{shown} is on {name}, a kernel file system that cannot hold files"
            ));
        }
    }
    let mut vfs = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: statvfs reads a NUL-terminated path and fills the struct we own.
    if unsafe { libc::statvfs(path.as_ptr(), vfs.as_mut_ptr()) } == 0 {
        // SAFETY: statvfs returned 0, so it filled the struct.
        let vfs = unsafe { vfs.assume_init() };
        if vfs.f_flag & libc::ST_RDONLY != 0 {
            return Some(format!("{shown} is on a file system mounted read-only"));
        }
    }
    if existing == dir {
        // A file made and removed at once says more than the permission bits (root passes
        // those everywhere).
        let probe = dir.join(format!(".oxiflow-write-check-{}", std::process::id()));
        return match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)
        {
            Ok(_) => {
                let _ = std::fs::remove_file(&probe);
                None
            }
            Err(e) => Some(format!("no file can be created in {shown}: {e}")),
        };
    }
    // SAFETY: access reads a NUL-terminated path.
    let writable = unsafe { libc::access(path.as_ptr(), libc::W_OK | libc::X_OK) } == 0;
    (!writable).then(|| format!("{shown}, where it would be created, is not writable"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_file_systems_and_files_are_refused() {
        let why = unfit_folder(Path::new("/proc")).unwrap();
        assert!(
            why.contains("/proc is on procfs, a kernel file system"),
            "{why}"
        );
        let why = unfit_folder(Path::new("/proc/no/such/folder")).unwrap();
        assert!(why.starts_with("/proc is on procfs"), "{why}");
        let why = unfit_folder(Path::new("/sys/kernel")).unwrap();
        assert!(why.contains("on sysfs"), "{why}");
        let tmp = std::env::temp_dir();
        assert_eq!(unfit_folder(&tmp), None);
        assert_eq!(unfit_folder(&tmp.join("not/yet/made")), None);
        let file = tmp.join(format!("oxiflow_folders_file_{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let why = unfit_folder(&file.join("sub")).unwrap();
        assert!(why.ends_with("is not a folder"), "{why}");
        std::fs::remove_file(file).unwrap();
        assert_eq!(unfit_folder(Path::new("")).unwrap(), "the path is empty");
    }
}
