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

/// `Nccl`, the bound NCCL entry points (with the library's path), and `bind`, which loads
/// the library and resolves them, from one table: `field: Type = required("symbol")` for the
/// entry points every NCCL 2 has (a missing one fails the binding),
/// `field: Option<Type> = optional("symbol")` for those of later versions.
macro_rules! entry_points {
    (@required $lib:ident, $symbol:literal) => {
        sym($lib, $symbol)?
    };
    (@optional $lib:ident, $symbol:literal) => {
        sym($lib, $symbol).ok()
    };
    ($($(#[$doc:meta])* $field:ident: $ty:ty = $how:ident($symbol:literal),)*) => {
        /// The bound NCCL entry points.
        pub struct Nccl {
            pub path: String,
            $($(#[$doc])* pub $field: $ty,)*
        }

        fn bind(search: &LibSearch) -> Result<Nccl, CommError> {
            let lib = cuda_libs::load(CudaLib::Nccl, search)
                .map_err(|e| CommError::Device(e.to_string()))?;
            Ok(Nccl {
                path: lib.path.display().to_string(),
                $($field: entry_points!(@$how lib, $symbol),)*
            })
        }
    };
}

entry_points! {
    get_unique_id: FnGetUniqueId = required("ncclGetUniqueId"),
    comm_init_rank: FnCommInitRank = required("ncclCommInitRank"),
    comm_destroy: FnComm = required("ncclCommDestroy"),
    comm_abort: FnComm = required("ncclCommAbort"),
    comm_get_async_error: FnAsyncErr = required("ncclCommGetAsyncError"),
    group_start: FnVoid = required("ncclGroupStart"),
    group_end: FnVoid = required("ncclGroupEnd"),
    get_error_string: FnErrStr = required("ncclGetErrorString"),
    get_last_error: Option<FnLastErr> = optional("ncclGetLastError"),
    get_version: FnVersion = required("ncclGetVersion"),
    all_reduce: FnCollective = required("ncclAllReduce"),
    all_gather: FnAllGather = required("ncclAllGather"),
    reduce_scatter: FnCollective = required("ncclReduceScatter"),
    broadcast: FnCollective = required("ncclBroadcast"),
    reduce: FnReduce = required("ncclReduce"),
    send: FnSend = required("ncclSend"),
    recv: FnRecv = required("ncclRecv"),
    /// Buffer registration (NCCL >= 2.19): `ncclMemAlloc`, `ncclMemFree`, `ncclCommRegister`,
    /// `ncclCommDeregister`.
    mem_alloc: Option<FnMemAlloc> = optional("ncclMemAlloc"),
    mem_free: Option<FnMemFree> = optional("ncclMemFree"),
    comm_register: Option<FnRegister> = optional("ncclCommRegister"),
    comm_deregister: Option<FnDeregister> = optional("ncclCommDeregister"),
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
