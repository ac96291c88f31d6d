//! The library's own NVRTC sources, each with its name and exact text, the NVRTC options every
//! source is compiled with, and the key a compiled image is found by. The single definition
//! used by the runtime (which loads these sources) and by `cuda/build.rs` (which compiles them
//! ahead of time when `OXIFLOW_PREBUILD_ARCHS` is set), and how an embedded image is packed
//! (raw deflate); it uses nothing but `std` and `miniz_oxide`, so the build script can take it
//! as a module of its own. The kernels each source holds are named beside the
//! code that launches them (`kernels.rs`, `fused.rs`, `fused/one_read.rs`, `copy_many.rs`,
//! `flash_attention.rs`).

/// One source of the library: its name (in kernel build records and error messages) and its
/// text as NVRTC compiles it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LibrarySource {
    pub what: &'static str,
    pub text: &'static str,
}

/// The device prelude every source that handles 16-bit floats starts with (`bf16_t`, `f16_t`,
/// `ld`/`st` through f32, strided views, warp reductions): what `CudaSource` puts before a
/// source from outside the library (the build script compiles only the library's own).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const DEVICE_TYPES: &str = include_str!("device_types.cuh");

/// The element-wise and layout kernels (`source.cu` after `elementwise_math.cuh`), compiled in
/// parts `OXI_PART` 0..5 on parallel threads.
macro_rules! elementwise_part {
    ($p:literal) => {
        LibrarySource {
            what: concat!("element-wise and layout kernels, part ", $p),
            text: concat!(
                "#define OXI_PART ",
                $p,
                "\n",
                include_str!("gelu.cuh"),
                include_str!("elementwise_math.cuh"),
                include_str!("source.cu")
            ),
        }
    };
}

/// The flash attention kernels (`flash_attention.cu`) for one element type (`FLASH_TYPE(T, N)`).
macro_rules! flash_attention {
    ($ty:literal, $suffix:literal) => {
        LibrarySource {
            what: concat!("flash attention (", $ty, ")"),
            text: concat!(
                include_str!("device_types.cuh"),
                include_str!("flash_attention.cu"),
                "\nFLASH_TYPE(",
                $ty,
                ", ",
                $suffix,
                ")\n"
            ),
        }
    };
}

/// The parts of the element-wise and layout source, `OXI_PART` 0..5.
pub(crate) const ELEMENTWISE_PARTS: [LibrarySource; 5] = [
    elementwise_part!(0),
    elementwise_part!(1),
    elementwise_part!(2),
    elementwise_part!(3),
    elementwise_part!(4),
];

/// Residual add + LayerNorm, the multi-tensor AdamW, the fused classifier, vectorised
/// element-wise kernels (`fused.cu`).
pub(crate) const FUSED: LibrarySource = LibrarySource {
    what: "fused norm, AdamW and classifier kernels",
    text: concat!(
        include_str!("device_types.cuh"),
        include_str!("block_reduce.cuh"),
        include_str!("gelu.cuh"),
        include_str!("fused.cu")
    ),
};

/// The classifier that reads each row once (`classifier_one_read.cu`).
pub(crate) const ONE_READ_CLASSIFIER: LibrarySource = LibrarySource {
    what: "one-read classifier kernels",
    text: concat!(
        include_str!("device_types.cuh"),
        include_str!("block_reduce.cuh"),
        include_str!("classifier_one_read.cu")
    ),
};

/// The multi-range copy (`copy_many.cu`).
pub(crate) const COPY_MANY: LibrarySource = LibrarySource {
    what: "multi-range copy",
    text: concat!(
        include_str!("device_types.cuh"),
        include_str!("copy_many.cu")
    ),
};

/// Flash attention for f32, bf16 and f16 operands, in `FloatType::ALL`'s order.
pub(crate) const FLASH_ATTENTION: [LibrarySource; 3] = [
    flash_attention!("float", "f32"),
    flash_attention!("bf16_t", "bf16"),
    flash_attention!("f16_t", "f16"),
];

/// Every source of the library (what the build script compiles).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const ALL: [&LibrarySource; 11] = [
    &ELEMENTWISE_PARTS[0],
    &ELEMENTWISE_PARTS[1],
    &ELEMENTWISE_PARTS[2],
    &ELEMENTWISE_PARTS[3],
    &ELEMENTWISE_PARTS[4],
    &FUSED,
    &ONE_READ_CLASSIFIER,
    &COPY_MANY,
    &FLASH_ATTENTION[0],
    &FLASH_ATTENTION[1],
    &FLASH_ATTENTION[2],
];

/// The NVRTC options of every source, library or generated, for the architecture `arch`
/// (`sm_XY`): machine code for that architecture, fused multiply-adds on.
pub(crate) fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=true".to_string(),
    ]
}

/// The key of the image NVRTC makes of `source` under `options` (which name the
/// architecture): a 128-bit FNV-1a hash of a format tag, the options (each ended by a NUL) and
/// the source. It leaves out the NVRTC version on purpose: an image is machine code for the
/// architecture the options name, whichever NVRTC made it.
pub(crate) fn image_key(source: &str, options: &[String]) -> u128 {
    let mut h = fnv1a_128(FNV_OFFSET, b"oxiflow kernel image v1\0");
    for o in options {
        h = fnv1a_128(h, o.as_bytes());
        h = fnv1a_128(h, b"\0");
    }
    fnv1a_128(h, source.as_bytes())
}

/// The architectures named by `OXIFLOW_PREBUILD_ARCHS` (`sm_90`, `sm_80,sm_90`): `sm_`, a
/// number and at most one lower-case letter (`sm_90a`), separated by commas or spaces, each
/// kept once in the order given.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn prebuild_archs(value: &str) -> Result<Vec<String>, String> {
    let is_arch = |a: &str| {
        let Some(n) = a.strip_prefix("sm_") else {
            return false;
        };
        let n = n
            .strip_suffix(|c: char| c.is_ascii_lowercase())
            .unwrap_or(n);
        !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
    };
    let mut archs: Vec<String> = Vec::new();
    for a in value
        .split([',', ' '])
        .map(str::trim)
        .filter(|a| !a.is_empty())
    {
        if !is_arch(a) {
            return Err(format!(
                "{a:?} is no architecture (expected sm_XY, e.g. sm_90 or sm_80,sm_90)"
            ));
        }
        if !archs.iter().any(|x| x == a) {
            archs.push(a.to_string());
        }
    }
    Ok(archs)
}

/// `image` packed for embedding (raw deflate: CUBINs shrink about 4.5 times; the build
/// script's).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn pack_image(image: &[u8]) -> Vec<u8> {
    miniz_oxide::deflate::compress_to_vec(image, 6)
}

/// The image of `len` bytes that `packed` holds ([`pack_image`]'s), checked to be that long and
/// an ELF image.
pub(crate) fn unpack_image(packed: &[u8], len: usize) -> Result<Vec<u8>, String> {
    let image = miniz_oxide::inflate::decompress_to_vec_with_limit(packed, len)
        .map_err(|e| format!("unpacking an embedded image: {e}"))?;
    if image.len() != len || !image.starts_with(b"\x7fELF") {
        return Err(format!(
            "an embedded image unpacks to {} bytes that are no ELF image of {len} bytes",
            image.len()
        ));
    }
    Ok(image)
}

/// FNV-1a's 128-bit offset basis.
const FNV_OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;

/// The 128-bit FNV-1a hash `h` continued over `bytes`.
fn fnv1a_128(mut h: u128, bytes: &[u8]) -> u128 {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    for &b in bytes {
        h ^= u128::from(b);
        h = h.wrapping_mul(PRIME);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fnv1a_128() {
        // The published FNV-1a 128-bit values of "" and "foobar".
        assert_eq!(fnv1a_128(FNV_OFFSET, b""), FNV_OFFSET);
        assert_eq!(
            fnv1a_128(FNV_OFFSET, b"foobar"),
            0x343e_1662_793c_64bf_6f0d_3597_ba44_6f18
        );
    }

    #[test]
    fn the_image_key_names_source_options_and_architecture() {
        let k = image_key("src", &nvrtc_options("sm_90"));
        assert_eq!(k, image_key("src", &nvrtc_options("sm_90")));
        assert_ne!(k, image_key("src2", &nvrtc_options("sm_90")));
        assert_ne!(k, image_key("src", &nvrtc_options("sm_80")));
        assert_ne!(
            k,
            image_key("src", &["--gpu-architecture=sm_90".to_string()])
        );
        // Options are separated, so moving a character between them (or into the source)
        // changes the key.
        let opts = |a: &str, b: &str| vec![a.to_string(), b.to_string()];
        assert_ne!(
            image_key("s", &opts("ab", "c")),
            image_key("s", &opts("a", "bc"))
        );
        assert_ne!(
            image_key("cs", &opts("a", "b")),
            image_key("s", &opts("a", "bc"))
        );
    }

    #[test]
    fn prebuild_architectures_are_parsed_strictly() {
        assert_eq!(prebuild_archs("sm_90").unwrap(), ["sm_90"]);
        assert_eq!(
            prebuild_archs(" sm_80, sm_90a sm_80,").unwrap(),
            ["sm_80", "sm_90a"]
        );
        assert!(prebuild_archs("").unwrap().is_empty());
        for bad in [
            "90",
            "sm90",
            "sm_",
            "sm_9x0",
            "sm_90ab",
            "compute_90",
            "sm_90;rm",
        ] {
            let e = prebuild_archs(&format!("sm_80,{bad}")).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn a_packed_image_unpacks_whole_and_a_damaged_one_is_an_error() {
        let image: Vec<u8> = b"\x7fELF"
            .iter()
            .copied()
            .chain((0..100_000u32).map(|i| (i % 251) as u8))
            .collect();
        let packed = pack_image(&image);
        assert!(packed.len() < image.len() / 4, "{}", packed.len());
        assert_eq!(unpack_image(&packed, image.len()).unwrap(), image);
        assert!(unpack_image(&packed, image.len() - 1).is_err(), "too long");
        assert!(unpack_image(&packed, image.len() + 1).is_err(), "too short");
        assert!(unpack_image(&packed[..packed.len() / 2], image.len()).is_err());
        let not_elf = pack_image(b"not an image");
        assert!(unpack_image(&not_elf, 12).is_err());
    }

    #[test]
    fn every_library_source_has_its_own_name_and_text() {
        for (i, a) in ALL.iter().enumerate() {
            for b in &ALL[i + 1..] {
                assert_ne!(a.what, b.what);
                assert_ne!(a.text, b.text, "{} and {}", a.what, b.what);
            }
        }
        assert!(ELEMENTWISE_PARTS[3]
            .text
            .starts_with("#define OXI_PART 3\n"));
        assert!(FLASH_ATTENTION[1]
            .text
            .ends_with("\nFLASH_TYPE(bf16_t, bf16)\n"));
    }
}
