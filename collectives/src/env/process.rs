//! Process settings read from the environment beside the launch contract: where the on-disk
//! kernel cache lives (`OXIFLOW_KERNEL_CACHE`, else `$XDG_CACHE_HOME/oxiflow/kernels`, else
//! `$HOME/.cache/oxiflow/kernels`; `off`, `0` or empty: no cache) and whether compiled steps
//! may replay as device graphs (`OXIFLOW_CUDA_GRAPH=0`: launch by launch).

use std::ffi::OsString;
use std::path::PathBuf;

/// The kernel cache directory this process's environment names (None: off, or no home).
pub fn kernel_cache_dir() -> Option<PathBuf> {
    kernel_cache_dir_from(|name| std::env::var_os(name))
}

/// [`kernel_cache_dir`] with the variables read through `get`.
fn kernel_cache_dir_from(get: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    match get("OXIFLOW_KERNEL_CACHE") {
        Some(v) if v == "off" || v == "0" || v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => get("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                get("HOME")
                    .filter(|v| !v.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache"))
            })
            .map(|c| c.join("oxiflow").join("kernels")),
    }
}

/// Whether compiled steps may replay as device graphs in this process's environment.
pub fn device_graphs_allowed() -> bool {
    device_graphs_allowed_from(|name| std::env::var_os(name))
}

/// [`device_graphs_allowed`] with the variables read through `get`: anything but `0` allows
/// them.
fn device_graphs_allowed_from(get: impl Fn(&str) -> Option<OsString>) -> bool {
    get("OXIFLOW_CUDA_GRAPH").is_none_or(|v| v.to_str().map(str::trim) != Some("0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn the_kernel_cache_is_named_then_xdg_then_home_and_can_be_off() {
        let dir = |p: &[(&str, &str)]| kernel_cache_dir_from(vars(p));
        assert_eq!(dir(&[("OXIFLOW_KERNEL_CACHE", "/k")]), Some("/k".into()));
        for off in ["off", "0", ""] {
            assert_eq!(dir(&[("OXIFLOW_KERNEL_CACHE", off), ("HOME", "/h")]), None);
        }
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]),
            Some("/x/oxiflow/kernels".into())
        );
        assert_eq!(
            dir(&[("HOME", "/h")]),
            Some("/h/.cache/oxiflow/kernels".into())
        );
        assert_eq!(dir(&[]), None);
    }

    #[test]
    fn device_graphs_are_off_only_for_zero() {
        let on = |p: &[(&str, &str)]| device_graphs_allowed_from(vars(p));
        assert!(on(&[]));
        assert!(on(&[("OXIFLOW_CUDA_GRAPH", "1")]));
        assert!(!on(&[("OXIFLOW_CUDA_GRAPH", "0")]));
        assert!(!on(&[("OXIFLOW_CUDA_GRAPH", " 0 ")]));
    }
}
