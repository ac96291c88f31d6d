//! NCCL's C API, bound by hand from the library that `cuda_libs` found (any soname, `.so.2` too).
//!
//! Only the stable subset OxiFlow uses; the types follow `nccl.h` (2.x ABI).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::cuda_libs::{self, CudaLib, LibSearch, LoadedLib};
use crate::{CommError, DType, ReduceOp};

pub type NcclComm = *mut c_void;
pub type Stream = *mut c_void;
pub type NcclResult = c_int;

pub const NCCL_SUCCESS: NcclResult = 0;
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

type FnGetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type FnCommInitRank = unsafe extern "C" fn(*mut NcclComm, c_int, UniqueId, c_int) -> NcclResult;
type FnComm = unsafe extern "C" fn(NcclComm) -> NcclResult;
type FnAsyncErr = unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult;
type FnVoid = unsafe extern "C" fn() -> NcclResult;
type FnErrStr = unsafe extern "C" fn(NcclResult) -> *const c_char;
type FnLastErr = unsafe extern "C" fn(NcclComm) -> *const c_char;
type FnVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
/// ncclAllReduce, ncclReduceScatter and ncclBroadcast: (send, recv, count, dtype, the reduce
/// op or the root, comm, stream).
type FnCollective = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    NcclComm,
    Stream,
) -> NcclResult;
type FnAllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, Stream) -> NcclResult;
type FnReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    c_int,
    NcclComm,
    Stream,
) -> NcclResult;
type FnSend =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, Stream) -> NcclResult;
type FnRecv =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, Stream) -> NcclResult;
type FnMemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult;
type FnMemFree = unsafe extern "C" fn(*mut c_void) -> NcclResult;
type FnRegister =
    unsafe extern "C" fn(NcclComm, *mut c_void, usize, *mut *mut c_void) -> NcclResult;
type FnDeregister = unsafe extern "C" fn(NcclComm, *mut c_void) -> NcclResult;

/// The bound NCCL entry points.
pub struct Nccl {
    pub path: String,
    pub get_unique_id: FnGetUniqueId,
    pub comm_init_rank: FnCommInitRank,
    pub comm_destroy: FnComm,
    pub comm_abort: FnComm,
    pub comm_get_async_error: FnAsyncErr,
    pub group_start: FnVoid,
    pub group_end: FnVoid,
    pub get_error_string: FnErrStr,
    pub get_last_error: Option<FnLastErr>,
    pub get_version: FnVersion,
    pub all_reduce: FnCollective,
    pub all_gather: FnAllGather,
    pub reduce_scatter: FnCollective,
    pub broadcast: FnCollective,
    pub reduce: FnReduce,
    pub send: FnSend,
    pub recv: FnRecv,
    /// Buffer registration (NCCL >= 2.19): `ncclMemAlloc`, `ncclMemFree`, `ncclCommRegister`,
    /// `ncclCommDeregister`.
    pub mem_alloc: Option<FnMemAlloc>,
    pub mem_free: Option<FnMemFree>,
    pub comm_register: Option<FnRegister>,
    pub comm_deregister: Option<FnDeregister>,
}

fn sym<T: Copy>(lib: &LoadedLib, name: &str) -> Result<T, CommError> {
    let p = lib.symbol(name).ok_or_else(|| {
        CommError::Device(format!(
            "NCCL library {} has no symbol {name}",
            lib.path.display()
        ))
    })?;
    // SAFETY: T is the fn-pointer type of the C declaration of `name` (same size as a pointer).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();

/// Loads NCCL once per process (the first caller's search wins).
pub fn nccl(search: &LibSearch) -> Result<&'static Nccl, CommError> {
    NCCL.get_or_init(|| bind(search).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| CommError::Device(e.clone()))
}

fn bind(search: &LibSearch) -> Result<Nccl, CommError> {
    let lib =
        cuda_libs::load(CudaLib::Nccl, search).map_err(|e| CommError::Device(e.to_string()))?;
    Ok(Nccl {
        path: lib.path.display().to_string(),
        get_unique_id: sym(lib, "ncclGetUniqueId")?,
        comm_init_rank: sym(lib, "ncclCommInitRank")?,
        comm_destroy: sym(lib, "ncclCommDestroy")?,
        comm_abort: sym(lib, "ncclCommAbort")?,
        comm_get_async_error: sym(lib, "ncclCommGetAsyncError")?,
        group_start: sym(lib, "ncclGroupStart")?,
        group_end: sym(lib, "ncclGroupEnd")?,
        get_error_string: sym(lib, "ncclGetErrorString")?,
        get_last_error: sym(lib, "ncclGetLastError").ok(),
        get_version: sym(lib, "ncclGetVersion")?,
        all_reduce: sym(lib, "ncclAllReduce")?,
        all_gather: sym(lib, "ncclAllGather")?,
        reduce_scatter: sym(lib, "ncclReduceScatter")?,
        broadcast: sym(lib, "ncclBroadcast")?,
        reduce: sym(lib, "ncclReduce")?,
        send: sym(lib, "ncclSend")?,
        recv: sym(lib, "ncclRecv")?,
        mem_alloc: sym(lib, "ncclMemAlloc").ok(),
        mem_free: sym(lib, "ncclMemFree").ok(),
        comm_register: sym(lib, "ncclCommRegister").ok(),
        comm_deregister: sym(lib, "ncclCommDeregister").ok(),
    })
}

impl Nccl {
    /// Turns a result code into `CommError::Device` naming the op.
    pub(crate) fn check(&self, op: &str, comm: NcclComm, r: NcclResult) -> Result<(), CommError> {
        if r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS {
            return Ok(());
        }
        Err(CommError::Device(format!(
            "{op}: {}",
            self.describe(comm, r)
        )))
    }

    pub(crate) fn describe(&self, comm: NcclComm, r: NcclResult) -> String {
        // SAFETY: ncclGetErrorString returns a static C string.
        let s = unsafe { CStr::from_ptr((self.get_error_string)(r)) }
            .to_string_lossy()
            .into_owned();
        let last = match self.get_last_error {
            Some(f) => {
                // SAFETY: ncclGetLastError accepts any comm (or null) and returns a C string.
                let p = unsafe { f(comm) };
                if p.is_null() {
                    String::new()
                } else {
                    // SAFETY: a non-null NUL-terminated string owned by NCCL, copied at once.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            }
            None => String::new(),
        };
        format!(
            "NCCL error {r} ({s}){}",
            if last.is_empty() {
                String::new()
            } else {
                format!(": {last}")
            }
        )
    }

    /// NCCL's version code (e.g. 22803 for 2.28.3).
    pub fn version(&self) -> Result<i32, CommError> {
        let mut v = 0;
        // SAFETY: writes one int.
        self.check("ncclGetVersion", std::ptr::null_mut(), unsafe {
            (self.get_version)(&mut v)
        })?;
        Ok(v)
    }
}

/// `ncclDataType_t` of a dtype.
pub fn nccl_dtype(d: DType) -> c_int {
    match d {
        DType::F32 => 7,
        DType::F64 => 8,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::BF16 => 9,
    }
}

/// `ncclRedOp_t` of a reduce op.
pub fn nccl_op(o: ReduceOp) -> c_int {
    match o {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}
