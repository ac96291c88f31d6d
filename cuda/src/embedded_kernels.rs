//! The library's NVRTC sources compiled when the crate was built: `build.rs`, given
//! `OXIFLOW_PREBUILD_ARCHS` (e.g. `sm_90` or `sm_80,sm_90`), compiles every source of
//! [`super::library_sources`] for each architecture with the runtime's options and embeds the
//! CUBINs here, packed (`library_sources::pack_image`); without it the table is empty. The runtime takes an image from this table
//! before the kernel cache and NVRTC, found by [`image_key`] of the source and options it would
//! compile with (so only an image of exactly that source for the device's architecture).

use super::library_sources::{image_key, unpack_image};

/// One embedded CUBIN.
#[derive(Debug)]
pub(crate) struct EmbeddedImage {
    /// The architecture it was compiled for (`sm_XY`).
    pub arch: &'static str,
    /// [`image_key`] of the source and the options it was compiled with.
    pub key: u128,
    /// The CUBIN's length.
    pub len: usize,
    /// The CUBIN, packed.
    pub packed: &'static [u8],
}

impl EmbeddedImage {
    /// The CUBIN, unpacked and checked.
    pub(crate) fn image(&self) -> Result<Vec<u8>, String> {
        unpack_image(self.packed, self.len)
    }
}

/// The images this build embeds (written by `cuda/build.rs`).
pub(crate) static EMBEDDED: &[EmbeddedImage] =
    include!(concat!(env!("OUT_DIR"), "/embedded_kernels.rs"));

/// The image of `table` compiled from `source` under `options`, if any.
pub(crate) fn find<'t>(
    table: &'t [EmbeddedImage],
    source: &str,
    options: &[String],
) -> Option<&'t EmbeddedImage> {
    if table.is_empty() {
        return None;
    }
    let key = image_key(source, options);
    table.iter().find(|e| e.key == key)
}

/// The architectures this build embeds the library's kernels for (empty: none, every source is
/// compiled at run time or read from the kernel cache).
pub fn embedded_kernel_archs() -> Vec<&'static str> {
    let mut archs: Vec<&'static str> = EMBEDDED.iter().map(|e| e.arch).collect();
    archs.sort_unstable();
    archs.dedup();
    archs
}

#[cfg(test)]
mod tests {
    use super::super::library_sources::{nvrtc_options, pack_image, ALL, COPY_MANY, FUSED};
    use super::*;

    #[test]
    fn a_lookup_finds_what_was_embedded_and_nothing_else() {
        let opts = nvrtc_options("sm_90");
        let (copy, fused) = (pack_image(b"\x7fELF copy"), pack_image(b"\x7fELF fused"));
        let table = [
            EmbeddedImage {
                arch: "sm_90",
                key: image_key(COPY_MANY.text, &opts),
                len: 9,
                packed: copy.leak(),
            },
            EmbeddedImage {
                arch: "sm_80",
                key: image_key(FUSED.text, &nvrtc_options("sm_80")),
                len: 10,
                packed: fused.leak(),
            },
        ];
        let hit = find(&table, COPY_MANY.text, &opts).expect("the embedded source");
        assert_eq!(hit.image().unwrap(), b"\x7fELF copy");
        assert_eq!(
            find(&table, FUSED.text, &nvrtc_options("sm_80")).map(|e| e.image().unwrap()),
            Some(b"\x7fELF fused".to_vec())
        );
        // Another architecture, another source, other options, a changed text: not found.
        assert!(find(&table, COPY_MANY.text, &nvrtc_options("sm_80")).is_none());
        assert!(find(&table, FUSED.text, &opts).is_none());
        assert!(find(&table, COPY_MANY.text, &opts[..1]).is_none());
        let edited = format!("{} ", COPY_MANY.text);
        assert!(find(&table, &edited, &opts).is_none());
        assert!(find(&[], COPY_MANY.text, &opts).is_none());
    }

    #[test]
    fn this_builds_images_are_found_as_the_runtime_looks_them_up() {
        let archs = embedded_kernel_archs();
        if archs.is_empty() {
            assert!(EMBEDDED.is_empty());
            println!("skipped: this build embeds no kernels (OXIFLOW_PREBUILD_ARCHS was unset)");
            return;
        }
        // Every library source for every embedded architecture, under the runtime's key.
        for arch in &archs {
            for s in ALL {
                let e = find(EMBEDDED, s.text, &nvrtc_options(arch))
                    .unwrap_or_else(|| panic!("{} for {arch} is not embedded", s.what));
                assert_eq!(e.arch, *arch);
                let image = e
                    .image()
                    .unwrap_or_else(|err| panic!("{} for {arch}: {err}", s.what));
                assert_eq!(image.len(), e.len);
            }
        }
        assert_eq!(EMBEDDED.len(), ALL.len() * archs.len(), "{archs:?}");
    }
}
