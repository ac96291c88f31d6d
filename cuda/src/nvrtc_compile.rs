//! NVRTC's C API, bound from a loaded `libnvrtc` by symbol: a source compiled to a CUBIN (the
//! architecture's machine code) or NVRTC's log, and NVRTC's version. One compile path for the
//! runtime (NVRTC found by `oxiflow_collectives::cuda_libs`) and for `cuda/build.rs` (NVRTC
//! opened by `nvrtc_open`); plain `std` only, so the build script can take this file as a module
//! of its own.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

/// `nvrtcProgram`.
type Program = *mut c_void;
/// `nvrtcResult` (0 is success).
type Status = c_int;

/// `nvrtcVersion`.
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
/// `nvrtcCreateProgram`.
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
/// `nvrtcCompileProgram`.
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
/// `nvrtcGetProgramLogSize`, `nvrtcGetCUBINSize`.
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
/// `nvrtcGetProgramLog`, `nvrtcGetCUBIN`.
type BytesFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;
/// `nvrtcDestroyProgram`.
type DestroyFn = unsafe extern "C" fn(*mut Program) -> Status;
/// `nvrtcGetErrorString`.
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;

/// The NVRTC entry points a compile needs.
#[derive(Clone, Copy)]
pub(crate) struct Nvrtc {
    version: VersionFn,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: BytesFn,
    cubin_size: SizeFn,
    cubin: BytesFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
}

// SAFETY: the entry points are plain functions of a library loaded for the life of the process;
// NVRTC allows concurrent use of distinct programs from several threads.
unsafe impl Send for Nvrtc {}
// SAFETY: as above.
unsafe impl Sync for Nvrtc {}

/// A program, destroyed when dropped.
struct Owned<'a>(&'a Nvrtc, Program);

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from `nvrtcCreateProgram` and is destroyed only here, once.
        let _ = unsafe { (self.0.destroy)(&mut self.1) };
    }
}

impl Nvrtc {
    /// The entry points found by `symbol` (a `dlsym` of a loaded `libnvrtc`).
    pub(crate) fn from_symbols(
        symbol: impl Fn(&str) -> Option<*mut c_void>,
    ) -> Result<Nvrtc, String> {
        let get = |name: &str| symbol(name).ok_or_else(|| format!("NVRTC has no symbol {name}"));
        // The entry point `$name` as the function pointer type `$t`.
        macro_rules! entry {
            ($t:ty, $name:literal) => {
                std::mem::transmute::<*mut c_void, $t>(get($name)?)
            };
        }
        // SAFETY: each symbol is NVRTC's function of that name, whose C signature is the field's
        // type (nvrtc.h).
        unsafe {
            Ok(Nvrtc {
                version: entry!(VersionFn, "nvrtcVersion"),
                create: entry!(CreateFn, "nvrtcCreateProgram"),
                compile: entry!(CompileFn, "nvrtcCompileProgram"),
                log_size: entry!(SizeFn, "nvrtcGetProgramLogSize"),
                log: entry!(BytesFn, "nvrtcGetProgramLog"),
                cubin_size: entry!(SizeFn, "nvrtcGetCUBINSize"),
                cubin: entry!(BytesFn, "nvrtcGetCUBIN"),
                destroy: entry!(DestroyFn, "nvrtcDestroyProgram"),
                error_string: entry!(ErrorStringFn, "nvrtcGetErrorString"),
            })
        }
    }

    /// NVRTC's `(major, minor)` version.
    pub(crate) fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are valid for one int each.
        let _ = unsafe { (self.version)(&mut major, &mut minor) };
        (major, minor)
    }

    /// NVRTC's name of `status`.
    fn error(&self, status: Status) -> String {
        // SAFETY: NVRTC returns a static NUL-terminated string for every status (or null).
        let s = unsafe { (self.error_string)(status) };
        if s.is_null() {
            format!("NVRTC error {status}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        }
    }

    /// The program's log (empty when NVRTC has none).
    fn program_log(&self, prog: Program) -> String {
        let mut size = 0usize;
        // SAFETY: `prog` is live; `size` is valid for one usize.
        if unsafe { (self.log_size)(prog, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size];
        // SAFETY: `log` holds the `size` bytes NVRTC reported for this program's log.
        if unsafe { (self.log)(prog, log.as_mut_ptr().cast::<c_char>()) } != 0 {
            return String::new();
        }
        let end = log.iter().position(|&c| c == 0).unwrap_or(log.len());
        String::from_utf8_lossy(&log[..end]).trim_end().to_string()
    }

    /// NVRTC's CUBIN of `source` under `options`, or NVRTC's error and log.
    pub(crate) fn compile(&self, source: &str, options: &[String]) -> Result<Vec<u8>, String> {
        let src =
            CString::new(source).map_err(|_| "NVRTC: the source holds a NUL byte".to_string())?;
        let opts = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| "NVRTC: an option holds a NUL byte".to_string())?;
        let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut raw: Program = std::ptr::null_mut();
        // SAFETY: `raw` receives the program; `src` is NUL-terminated and outlives the call; no
        // headers are passed (null arrays of length 0).
        let status = unsafe {
            (self.create)(
                &mut raw,
                src.as_ptr(),
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if status != 0 {
            return Err(format!(
                "NVRTC: creating the program: {}",
                self.error(status)
            ));
        }
        let prog = Owned(self, raw);
        // SAFETY: `prog` is live; `ptrs` holds `ptrs.len()` NUL-terminated options that outlive
        // the call.
        let status = unsafe { (self.compile)(prog.1, ptrs.len() as c_int, ptrs.as_ptr()) };
        if status != 0 {
            return Err(format!(
                "NVRTC: {}: {}",
                self.error(status),
                self.program_log(prog.1)
            ));
        }
        let mut size = 0usize;
        // SAFETY: `prog` is live and compiled; `size` is valid for one usize.
        let status = unsafe { (self.cubin_size)(prog.1, &mut size) };
        if status != 0 {
            return Err(format!("NVRTC CUBIN size: {}", self.error(status)));
        }
        let mut image = vec![0u8; size];
        // SAFETY: `image` holds the `size` bytes NVRTC reported for this program's CUBIN.
        let status = unsafe { (self.cubin)(prog.1, image.as_mut_ptr().cast::<c_char>()) };
        if status != 0 {
            return Err(format!("NVRTC CUBIN: {}", self.error(status)));
        }
        Ok(image)
    }
}
