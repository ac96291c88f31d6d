//! cuDNN's handle and backend-descriptor entry points, bound by hand from the library that
//! `cuda_libs::ensure_cudnn` loaded (a missing library or symbol is a typed error, never a
//! panic), and `Desc`, an owned backend descriptor with typed attribute setters.
//!
//! The attribute, type and enum values are cudarc's (`cudarc::cudnn::sys`); they are passed as
//! the C enums' `u32` values, and statuses come back as `u32` (0 is success).

use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

use cudarc::cudnn::sys::{
    cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Ty,
    cudnnBackendDescriptorType_t as Kind,
};
use oxiflow_collectives::cuda_libs::{self, LibSearch};

use crate::raw::{FResult, FusedError};

type Status = u32;
pub(super) type Raw = *mut c_void;

type SetFn = unsafe extern "C" fn(Raw, u32, u32, i64, *const c_void) -> Status;
type GetFn = unsafe extern "C" fn(Raw, u32, u32, i64, *mut i64, *mut c_void) -> Status;

/// The entry points used here.
pub(super) struct Api {
    pub create: unsafe extern "C" fn(*mut Raw) -> Status,
    pub destroy: unsafe extern "C" fn(Raw) -> Status,
    pub set_stream: unsafe extern "C" fn(Raw, *mut c_void) -> Status,
    pub version: unsafe extern "C" fn() -> usize,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    last_error: Option<unsafe extern "C" fn(*mut c_char, usize)>,
    backend_create: unsafe extern "C" fn(u32, *mut Raw) -> Status,
    backend_destroy: unsafe extern "C" fn(Raw) -> Status,
    backend_finalize: unsafe extern "C" fn(Raw) -> Status,
    backend_set: SetFn,
    backend_get: GetFn,
    pub execute: unsafe extern "C" fn(Raw, Raw, Raw) -> Status,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn bind() -> Result<Api, String> {
    let libs = cuda_libs::ensure_cudnn(&LibSearch::default()).map_err(|e| e.to_string())?;
    let lib = libs.main;
    macro_rules! sym {
        ($name:literal, $ty:ty) => {{
            let p = lib
                .symbol($name)
                .ok_or_else(|| format!("{} has no symbol {}", lib.path.display(), $name))?;
            // SAFETY: the symbol is cuDNN 9's documented entry point of this C signature.
            unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
        }};
    }
    let last_error = lib.symbol("cudnnGetLastErrorString").map(|p| {
        // SAFETY: cuDNN 9's `void cudnnGetLastErrorString(char*, size_t)`.
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_char, usize)>(p) }
    });
    Ok(Api {
        create: sym!("cudnnCreate", unsafe extern "C" fn(*mut Raw) -> Status),
        destroy: sym!("cudnnDestroy", unsafe extern "C" fn(Raw) -> Status),
        set_stream: sym!(
            "cudnnSetStream",
            unsafe extern "C" fn(Raw, *mut c_void) -> Status
        ),
        version: sym!("cudnnGetVersion", unsafe extern "C" fn() -> usize),
        error_string: sym!(
            "cudnnGetErrorString",
            unsafe extern "C" fn(Status) -> *const c_char
        ),
        last_error,
        backend_create: sym!(
            "cudnnBackendCreateDescriptor",
            unsafe extern "C" fn(u32, *mut Raw) -> Status
        ),
        backend_destroy: sym!(
            "cudnnBackendDestroyDescriptor",
            unsafe extern "C" fn(Raw) -> Status
        ),
        backend_finalize: sym!("cudnnBackendFinalize", unsafe extern "C" fn(Raw) -> Status),
        backend_set: sym!("cudnnBackendSetAttribute", SetFn),
        backend_get: sym!("cudnnBackendGetAttribute", GetFn),
        execute: sym!(
            "cudnnBackendExecute",
            unsafe extern "C" fn(Raw, Raw, Raw) -> Status
        ),
    })
}

/// The bound API, or `Unavailable` naming what is missing.
pub(super) fn api(op: &'static str) -> FResult<&'static Api> {
    API.get_or_init(bind)
        .as_ref()
        .map_err(|e| FusedError::Unavailable {
            op,
            lib: "cuDNN",
            detail: e.clone(),
        })
}

impl Api {
    /// The status's name and cuDNN's last error message.
    pub(super) fn describe(&self, status: Status) -> String {
        // SAFETY: cudnnGetErrorString returns a static C string for any status.
        let name = unsafe { CStr::from_ptr((self.error_string)(status)) }
            .to_string_lossy()
            .into_owned();
        let mut msg = String::new();
        if let Some(f) = self.last_error {
            let mut buf = vec![0 as c_char; 2048];
            // SAFETY: buf holds 2048 bytes; cuDNN writes a NUL-terminated string within them.
            unsafe { f(buf.as_mut_ptr(), buf.len()) };
            // SAFETY: the buffer is NUL-terminated (zeroed beforehand, written up to max_size).
            msg = unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned();
        }
        if msg.is_empty() {
            format!("{name} ({status})")
        } else {
            format!("{name} ({status}): {}", msg.trim())
        }
    }
    /// `Ok` for status 0, else `Refused` (building) naming `what`.
    pub(super) fn check(&self, op: &'static str, what: &str, status: Status) -> FResult<()> {
        if status == 0 {
            return Ok(());
        }
        Err(FusedError::Refused {
            op,
            lib: "cuDNN",
            what: what.to_string(),
            detail: self.describe(status),
        })
    }
}

/// An owned backend descriptor.
pub(super) struct Desc {
    pub raw: Raw,
    api: &'static Api,
    name: &'static str,
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: raw was created by cudnnBackendCreateDescriptor and is destroyed once.
        unsafe { (self.api.backend_destroy)(self.raw) };
    }
}

impl Desc {
    pub(super) fn new(
        api: &'static Api,
        op: &'static str,
        kind: Kind,
        name: &'static str,
    ) -> FResult<Desc> {
        let mut raw: Raw = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer.
        let s = unsafe { (api.backend_create)(kind as u32, &mut raw) };
        api.check(op, &format!("creating {name}"), s)?;
        Ok(Desc { raw, api, name })
    }
    fn set(
        &self,
        op: &'static str,
        attr: Attr,
        ty: Ty,
        count: usize,
        data: *const c_void,
    ) -> FResult<()> {
        // SAFETY: data points to `count` values of the C type that `ty` names.
        let s =
            unsafe { (self.api.backend_set)(self.raw, attr as u32, ty as u32, count as i64, data) };
        self.api
            .check(op, &format!("{} attribute {attr:?}", self.name), s)
    }
    pub(super) fn i64s(&self, op: &'static str, attr: Attr, v: &[i64]) -> FResult<()> {
        self.set(op, attr, Ty::CUDNN_TYPE_INT64, v.len(), v.as_ptr().cast())
    }
    /// One value of a C enum type (`ty` names which).
    pub(super) fn enum_(&self, op: &'static str, attr: Attr, ty: Ty, v: u32) -> FResult<()> {
        self.set(op, attr, ty, 1, (&v as *const u32).cast())
    }
    pub(super) fn boolean(&self, op: &'static str, attr: Attr, v: bool) -> FResult<()> {
        // cuDNN's BOOLEAN attribute type is C `bool`.
        let b = v;
        self.set(
            op,
            attr,
            Ty::CUDNN_TYPE_BOOLEAN,
            1,
            (&b as *const bool).cast(),
        )
    }
    pub(super) fn f32(&self, op: &'static str, attr: Attr, v: f32) -> FResult<()> {
        self.set(op, attr, Ty::CUDNN_TYPE_FLOAT, 1, (&v as *const f32).cast())
    }
    pub(super) fn descs(&self, op: &'static str, attr: Attr, v: &[&Desc]) -> FResult<()> {
        let raws: Vec<Raw> = v.iter().map(|d| d.raw).collect();
        self.set(
            op,
            attr,
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            raws.len(),
            raws.as_ptr().cast(),
        )
    }
    pub(super) fn handle(&self, op: &'static str, attr: Attr, h: Raw) -> FResult<()> {
        self.set(
            op,
            attr,
            Ty::CUDNN_TYPE_HANDLE,
            1,
            (&h as *const Raw).cast(),
        )
    }
    pub(super) fn ptrs(&self, op: &'static str, attr: Attr, v: &[*mut c_void]) -> FResult<()> {
        self.set(
            op,
            attr,
            Ty::CUDNN_TYPE_VOID_PTR,
            v.len(),
            v.as_ptr().cast(),
        )
    }
    pub(super) fn finalize(&self, op: &'static str) -> FResult<()> {
        // SAFETY: raw is a live descriptor.
        let s = unsafe { (self.api.backend_finalize)(self.raw) };
        self.api.check(op, &format!("finalizing {}", self.name), s)
    }
    /// Reads up to `out.len()` values of type `ty` into `out`; returns how many were written.
    pub(super) fn get<T>(
        &self,
        op: &'static str,
        attr: Attr,
        ty: Ty,
        out: &mut [T],
    ) -> FResult<usize> {
        let mut n = 0i64;
        // SAFETY: out has room for out.len() values of the C type that `ty` names.
        let s = unsafe {
            (self.api.backend_get)(
                self.raw,
                attr as u32,
                ty as u32,
                out.len() as i64,
                &mut n,
                out.as_mut_ptr().cast(),
            )
        };
        self.api
            .check(op, &format!("reading {} attribute {attr:?}", self.name), s)?;
        Ok(n.max(0) as usize)
    }
    /// Reads descriptors into the already created `out` descriptors; returns how many were
    /// filled.
    pub(super) fn get_descs(&self, op: &'static str, attr: Attr, out: &[Desc]) -> FResult<usize> {
        // The handles of out.len() live descriptors of the kind the attribute returns, which
        // cuDNN fills in place.
        let mut raws: Vec<Raw> = out.iter().map(|d| d.raw).collect();
        self.get(op, attr, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &mut raws)
    }
}
