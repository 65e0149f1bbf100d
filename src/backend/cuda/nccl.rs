//! A thin NCCL layer of our own, over `cudarc::nccl::sys`'s types.
//!
//! Why not cudarc's `nccl::result` functions: cudarc loads NCCL only under names that do not
//! include `libnccl.so.2` (see [`collsched_kernels::cuda::loader`]), panics when it cannot, and
//! its `NcclError` prints only its name. So this module resolves NCCL's functions itself from the
//! library the loader opened (`libnccl.so.2`, `libnccl.so`, or what `COLLSCHED_NCCL_LIB` names),
//! with the C signatures of cudarc's `nccl::sys` and its handle and id types. Every
//! `ncclResult_t` is taken as a plain `c_int` (a newer NCCL may return a code cudarc's enum does
//! not list, which must not become undefined behaviour).
//!
//! - [`Communicator`]: one rank's communicator; collectives take raw device pointers and any
//!   stream, per call; [`Communicator::split`] builds the sub-communicators of hybrid sharding;
//! - [`Group`]: `ncclGroupStart` / `ncclGroupEnd` as a guard;
//! - [`NcclError`]: carries the op, the bucket, the rank, the NCCL function, its result code,
//!   `ncclGetErrorString` and `ncclGetLastError`.
//!
//! Drops never panic: a failed `ncclCommDestroy` is parked in the [`ErrorPark`] the communicator
//! was created with and reported by the backend's next fallible call.

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::sync::OnceLock;

use collsched_kernels::cuda::{c_str, loader, LoadError};
use collsched_kernels::ElemType;
use cudarc::driver::sys as cusys;
use cudarc::nccl::sys as nsys;

use super::park::ErrorPark;

/// What a collective call was doing, for its error: the op, and where known the bucket and rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallSite {
    /// `all_gather`, `reduce_scatter`, `comm_init`, ...
    pub op: &'static str,
    /// The bucket the collective moves.
    pub bucket: Option<usize>,
    /// The calling rank.
    pub rank: Option<usize>,
}

impl CallSite {
    /// A call site for `op` with no bucket or rank yet.
    pub const fn op(op: &'static str) -> Self {
        CallSite { op, bucket: None, rank: None }
    }
    /// The same with a bucket.
    pub const fn bucket(mut self, bucket: usize) -> Self {
        self.bucket = Some(bucket);
        self
    }
    /// The same with a rank.
    pub const fn rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }
}

impl fmt::Display for CallSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.op)?;
        match (self.bucket, self.rank) {
            (Some(b), Some(r)) => write!(f, "(bucket {b}, rank {r})"),
            (Some(b), None) => write!(f, "(bucket {b})"),
            (None, Some(r)) => write!(f, "(rank {r})"),
            (None, None) => Ok(()),
        }
    }
}

/// Why an NCCL call failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum NcclError {
    /// NCCL could not be loaded.
    #[error(transparent)]
    Load(Box<LoadError>),
    /// The library lacks a function this layer needs (an NCCL older than 2.18).
    #[error("NCCL at {path} has no function {symbol} ({error}); collsched needs NCCL 2.18 or newer")]
    MissingSymbol {
        /// Where NCCL was loaded from.
        path: String,
        /// The missing function.
        symbol: &'static str,
        /// The loader's message.
        error: String,
    },
    /// An NCCL function returned an error.
    #[error(transparent)]
    Call(Box<NcclCallError>),
    /// An argument this layer refuses before calling NCCL.
    #[error("{site}: {what}")]
    InvalidArgument {
        /// What the caller was doing.
        site: CallSite,
        /// What is wrong and what to do.
        what: String,
    },
}

/// A failed NCCL call: what was being done, the function, its result and NCCL's own words.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("{site}: {api} failed with {code_name} ({code}): {message}{}", last_error_suffix(.last_error))]
pub struct NcclCallError {
    /// What the caller was doing.
    pub site: CallSite,
    /// The NCCL function.
    pub api: &'static str,
    /// The raw `ncclResult_t`.
    pub code: i32,
    /// Its name (`ncclUnhandledCudaError`, ...).
    pub code_name: &'static str,
    /// `ncclGetErrorString(code)`.
    pub message: String,
    /// `ncclGetLastError(comm)`, NCCL's description of the last failure, if any.
    pub last_error: String,
}

fn last_error_suffix(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!("; NCCL says: {s}")
    }
}

/// Names of `ncclResult_t` values (NCCL 2.30); unknown codes are named as such.
pub const fn result_name(code: i32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "an unknown ncclResult_t",
    }
}

type RawResult = c_int;
type Stream = nsys::cudaStream_t;

macro_rules! nccl_api {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*) -> $ret:ty; )*) => {
        /// NCCL's functions, resolved from the loaded library.
        pub(crate) struct NcclApi {
            /// Where NCCL came from.
            pub path: &'static str,
            $( pub $field: unsafe extern "C" fn($($arg),*) -> $ret, )*
        }

        impl NcclApi {
            fn resolve(loaded: &'static loader::Loaded) -> Result<Self, NcclError> {
                Ok(NcclApi {
                    path: &loaded.opened_as,
                    $( $field: {
                        // SAFETY: the symbol is NCCL's public function of this name, whose C
                        // signature (NCCL 2.18+, as in cudarc's `nccl::sys`) is the type given;
                        // the library stays loaded for the life of the process.
                        let s = unsafe {
                            loaded.library.get::<unsafe extern "C" fn($($arg),*) -> $ret>($sym.as_bytes())
                        };
                        match s {
                            Ok(s) => *s,
                            Err(e) => return Err(NcclError::MissingSymbol {
                                path: loaded.opened_as.clone(), symbol: $sym, error: e.to_string(),
                            }),
                        }
                    }, )*
                })
            }
        }
    };
}

nccl_api! {
    get_version = "ncclGetVersion": fn(*mut c_int) -> RawResult;
    get_error_string = "ncclGetErrorString": fn(c_int) -> *const c_char;
    get_last_error = "ncclGetLastError": fn(nsys::ncclComm_t) -> *const c_char;
    get_unique_id = "ncclGetUniqueId": fn(*mut nsys::ncclUniqueId) -> RawResult;
    comm_init_rank = "ncclCommInitRank": fn(*mut nsys::ncclComm_t, c_int, nsys::ncclUniqueId, c_int) -> RawResult;
    comm_split = "ncclCommSplit": fn(nsys::ncclComm_t, c_int, c_int, *mut nsys::ncclComm_t, *mut c_void) -> RawResult;
    comm_destroy = "ncclCommDestroy": fn(nsys::ncclComm_t) -> RawResult;
    comm_abort = "ncclCommAbort": fn(nsys::ncclComm_t) -> RawResult;
    comm_get_async_error = "ncclCommGetAsyncError": fn(nsys::ncclComm_t, *mut c_int) -> RawResult;
    comm_count = "ncclCommCount": fn(nsys::ncclComm_t, *mut c_int) -> RawResult;
    comm_user_rank = "ncclCommUserRank": fn(nsys::ncclComm_t, *mut c_int) -> RawResult;
    group_start = "ncclGroupStart": fn() -> RawResult;
    group_end = "ncclGroupEnd": fn() -> RawResult;
    all_gather = "ncclAllGather": fn(*const c_void, *mut c_void, usize, nsys::ncclDataType_t, nsys::ncclComm_t, Stream) -> RawResult;
    reduce_scatter = "ncclReduceScatter": fn(*const c_void, *mut c_void, usize, nsys::ncclDataType_t, nsys::ncclRedOp_t, nsys::ncclComm_t, Stream) -> RawResult;
    all_reduce = "ncclAllReduce": fn(*const c_void, *mut c_void, usize, nsys::ncclDataType_t, nsys::ncclRedOp_t, nsys::ncclComm_t, Stream) -> RawResult;
    broadcast = "ncclBroadcast": fn(*const c_void, *mut c_void, usize, nsys::ncclDataType_t, c_int, nsys::ncclComm_t, Stream) -> RawResult;
}

/// The C signature NCCL's `ncclReduceScatter` and `ncclAllReduce` share.
type ReducingFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    nsys::ncclDataType_t,
    nsys::ncclRedOp_t,
    nsys::ncclComm_t,
    Stream,
) -> RawResult;

/// Loads NCCL (once per process) and resolves its functions.
pub(crate) fn api() -> Result<&'static NcclApi, NcclError> {
    static API: OnceLock<NcclApi> = OnceLock::new();
    if let Some(a) = API.get() {
        return Ok(a);
    }
    let loaded = loader::nccl().map_err(|e| NcclError::Load(Box::new(e)))?;
    let a = NcclApi::resolve(loaded)?;
    Ok(API.get_or_init(|| a))
}

impl NcclApi {
    /// Turns a raw result into `Ok` or an [`NcclError::Call`] (with NCCL's strings).
    fn check(
        &self,
        site: CallSite,
        api: &'static str,
        code: c_int,
        comm: nsys::ncclComm_t,
    ) -> Result<(), NcclError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: both return pointers to strings NCCL keeps (or null); `comm` is null or a
        // live communicator.
        let (message, last_error) = unsafe {
            (
                c_str((self.get_error_string)(code)).to_string(),
                // NCCL documents `comm` as unused here (NULL allowed): its last error is per thread.
                c_str((self.get_last_error)(comm)).to_string(),
            )
        };
        Err(NcclError::Call(Box::new(NcclCallError {
            site,
            api,
            code,
            code_name: result_name(code),
            message,
            last_error,
        })))
    }
}

/// NCCL's version as `(major, minor, patch)`.
///
/// # Errors
/// [`NcclError::Load`] without NCCL.
pub fn version() -> Result<(i32, i32, i32), NcclError> {
    let a = api()?;
    let mut v: c_int = 0;
    // SAFETY: `v` is a live local.
    let code = unsafe { (a.get_version)(&mut v) };
    a.check(CallSite::op("version"), "ncclGetVersion", code, std::ptr::null_mut())?;
    // NCCL_VERSION(X,Y,Z): X*10000 + Y*100 + Z since 2.9.
    Ok((v / 10000, (v % 10000) / 100, v % 100))
}

/// Where NCCL was loaded from.
///
/// # Errors
/// [`NcclError::Load`] without NCCL.
pub fn library_path() -> Result<&'static str, NcclError> {
    Ok(api()?.path)
}

/// `ncclGetErrorString` for a raw result code.
///
/// # Errors
/// [`NcclError::Load`] without NCCL.
pub fn error_string(code: i32) -> Result<String, NcclError> {
    let a = api()?;
    // SAFETY: returns a pointer to a static string inside NCCL.
    Ok(unsafe { c_str((a.get_error_string)(code)) }.to_string())
}

/// The 128 bytes every rank of a communicator must agree on (`ncclUniqueId`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId(pub [u8; UniqueId::BYTES]);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({}...)", hex(&self.0[..8]))
    }
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl UniqueId {
    /// `NCCL_UNIQUE_ID_BYTES`.
    pub const BYTES: usize = 128;

    /// A fresh id from `ncclGetUniqueId` (on one rank; the others receive it).
    ///
    /// # Errors
    /// [`NcclError`] if NCCL is missing or cannot set up its bootstrap network.
    pub fn generate() -> Result<Self, NcclError> {
        let a = api()?;
        let mut id = nsys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a live, correctly sized local.
        let code = unsafe { (a.get_unique_id)(&mut id) };
        a.check(CallSite::op("unique_id"), "ncclGetUniqueId", code, std::ptr::null_mut())?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// An id an engine passes as bytes (exactly 128).
    ///
    /// # Errors
    /// [`NcclError::InvalidArgument`] for any other length.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, NcclError> {
        let arr: [u8; Self::BYTES] = bytes.try_into().map_err(|_| NcclError::InvalidArgument {
            site: CallSite::op("unique_id"),
            what: format!(
                "an NCCL unique id has {} bytes, {} were given; pass the bytes rank 0 got from ncclGetUniqueId",
                Self::BYTES,
                bytes.len()
            ),
        })?;
        Ok(UniqueId(arr))
    }

    fn raw(&self) -> nsys::ncclUniqueId {
        nsys::ncclUniqueId { internal: self.0.map(|b| b as c_char) }
    }
}

/// NCCL's element type for an [`ElemType`].
pub const fn nccl_type(t: ElemType) -> nsys::ncclDataType_t {
    match t {
        ElemType::F32 => nsys::ncclDataType_t::ncclFloat32,
        ElemType::F16 => nsys::ncclDataType_t::ncclFloat16,
        ElemType::BF16 => nsys::ncclDataType_t::ncclBfloat16,
    }
}

/// The reduction of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclOp {
    /// `ncclSum`.
    Sum,
    /// `ncclAvg`.
    Avg,
}

impl NcclOp {
    const fn raw(self) -> nsys::ncclRedOp_t {
        match self {
            NcclOp::Sum => nsys::ncclRedOp_t::ncclSum,
            NcclOp::Avg => nsys::ncclRedOp_t::ncclAvg,
        }
    }
}

fn stream_of(s: cusys::CUstream) -> Stream {
    s.cast()
}

/// One rank's NCCL communicator.
///
/// Created with the rank's CUDA device current on the calling thread. Collectives take raw
/// device pointers and the stream to run on, per call. Dropping it calls `ncclCommDestroy`
/// (after the caller made sure no collective is still running on it, e.g. by synchronizing its
/// streams); an error there is parked.
pub struct Communicator {
    comm: nsys::ncclComm_t,
    rank: usize,
    size: usize,
    park: ErrorPark,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `Communicator` is Send but not Sync, so one thread at a time uses it.
unsafe impl Send for Communicator {}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

impl Communicator {
    /// `ncclCommInitRank`: joins the communicator of `world` ranks named by `id` as `rank`.
    /// Blocks until every rank joined (NCCL's bootstrap has its own timeouts).
    ///
    /// # Errors
    /// [`NcclError::InvalidArgument`] for `rank >= world` or a world that does not fit `int`;
    /// [`NcclError::Call`] from NCCL.
    pub fn init_rank(id: &UniqueId, world: usize, rank: usize, park: ErrorPark) -> Result<Self, NcclError> {
        let site = CallSite::op("comm_init").rank(rank);
        if rank >= world || world > c_int::MAX as usize {
            return Err(NcclError::InvalidArgument {
                site,
                what: format!("rank {rank} is not in a world of {world} ranks (0..{world})"),
            });
        }
        let a = api()?;
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a live out-pointer; the id is passed by value as NCCL expects.
        let code = unsafe { (a.comm_init_rank)(&mut comm, world as c_int, id.raw(), rank as c_int) };
        a.check(site, "ncclCommInitRank", code, comm)?;
        Ok(Communicator { comm, rank, size: world, park })
    }

    /// This rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The raw handle (for an engine that wants to issue its own NCCL calls on it).
    pub fn raw(&self) -> nsys::ncclComm_t {
        self.comm
    }

    /// `ncclCommSplit`: every rank of this communicator calls it; ranks with the same `color`
    /// form a new communicator, ordered by `key`. `color: None` (`NCCL_SPLIT_NOCOLOR`) takes
    /// no part and gets `None`. The new communicator inherits this one's configuration.
    ///
    /// # Errors
    /// [`NcclError::InvalidArgument`] for a color or key above `i32::MAX`; [`NcclError::Call`].
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>, NcclError> {
        let site = CallSite::op("comm_split").rank(self.rank);
        let too_big = |what: &str, v: u32| NcclError::InvalidArgument {
            site,
            what: format!("{what} {v} does not fit NCCL's int; use a smaller one"),
        };
        let color = match color {
            Some(c) => c_int::try_from(c).map_err(|_| too_big("color", c))?,
            None => -1, // NCCL_SPLIT_NOCOLOR
        };
        let key = c_int::try_from(key).map_err(|_| too_big("key", key))?;
        let a = api()?;
        let mut new: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `self.comm` is live; `new` is a live out-pointer; a null config means "inherit".
        let code = unsafe { (a.comm_split)(self.comm, color, key, &mut new, std::ptr::null_mut()) };
        a.check(site, "ncclCommSplit", code, self.comm)?;
        if new.is_null() {
            return Ok(None);
        }
        let (mut n, mut r): (c_int, c_int) = (0, 0);
        // SAFETY: `new` is a live communicator; out-pointers are live locals.
        let (c1, c2) = unsafe { ((a.comm_count)(new, &mut n), (a.comm_user_rank)(new, &mut r)) };
        let out = Communicator {
            comm: new,
            rank: r.max(0) as usize,
            size: n.max(0) as usize,
            park: self.park.clone(),
        };
        a.check(site, "ncclCommCount", c1, new)?;
        a.check(site, "ncclCommUserRank", c2, new)?;
        Ok(Some(out))
    }

    /// `ncclCommGetAsyncError`: an error of a collective that already returned.
    ///
    /// # Errors
    /// The asynchronous error, as [`NcclError::Call`].
    pub fn async_error(&self, site: CallSite) -> Result<(), NcclError> {
        let a = api()?;
        let mut e: c_int = 0;
        // SAFETY: `self.comm` is live; `e` is a live local.
        let code = unsafe { (a.comm_get_async_error)(self.comm, &mut e) };
        a.check(site, "ncclCommGetAsyncError", code, self.comm)?;
        a.check(site, "a previous collective (ncclCommGetAsyncError)", e, self.comm)
    }

    /// `ncclCommAbort`: frees the communicator without waiting for pending collectives (after
    /// an error, or a peer that died).
    ///
    /// # Errors
    /// [`NcclError::Call`].
    pub fn abort(mut self) -> Result<(), NcclError> {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        let a = api()?;
        // SAFETY: `comm` is live and not used again (the field is null now, so Drop skips it).
        let code = unsafe { (a.comm_abort)(comm) };
        a.check(CallSite::op("comm_abort").rank(self.rank), "ncclCommAbort", code, std::ptr::null_mut())
    }

    fn check_count(
        &self,
        site: CallSite,
        what: &str,
        count: usize,
        bytes_each: usize,
    ) -> Result<(), NcclError> {
        if count.checked_mul(bytes_each).and_then(|b| b.checked_mul(self.size)).is_none() {
            return Err(NcclError::InvalidArgument {
                site,
                what: format!(
                    "{what} of {count} elements times {} ranks overflows the address space",
                    self.size
                ),
            });
        }
        Ok(())
    }

    /// `ncclAllGather`: every rank's `count` elements at `send` land, in rank order, in the
    /// `count * size` elements at `recv`; queued on `stream`.
    ///
    /// # Errors
    /// [`NcclError`] from NCCL (bad pointers it detects, a CUDA error, a peer failure).
    ///
    /// # Safety
    /// `send` has `count` readable elements and `recv` `count * size()` writable ones, on this
    /// communicator's device, valid until the collective completed on `stream` (a stream of the
    /// same device); `send` may be `recv + rank * count` (in place).
    pub unsafe fn all_gather(
        &self,
        site: CallSite,
        send: u64,
        recv: u64,
        count: usize,
        ty: ElemType,
        stream: cusys::CUstream,
    ) -> Result<(), NcclError> {
        self.check_count(site, "all_gather", count, ty.size())?;
        let a = api()?;
        // SAFETY: guaranteed by the caller.
        let code = unsafe {
            (a.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_type(ty),
                self.comm,
                stream_of(stream),
            )
        };
        a.check(site, "ncclAllGather", code, self.comm)
    }

    /// `ncclReduceScatter`: the `count * size` elements at `send` are reduced over ranks; this
    /// rank's `count` elements of the result land at `recv`.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    ///
    /// # Safety
    /// `send` has `count * size()` readable elements and `recv` `count` writable ones (it may be
    /// `send + rank * count`), valid until the collective completed on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_scatter(
        &self,
        site: CallSite,
        send: u64,
        recv: u64,
        count: usize,
        ty: ElemType,
        op: NcclOp,
        stream: cusys::CUstream,
    ) -> Result<(), NcclError> {
        let a = api()?;
        // SAFETY: guaranteed by the caller.
        unsafe {
            self.reducing(site, a, a.reduce_scatter, "ncclReduceScatter", send, recv, count, ty, op, stream)
        }
    }

    /// `ncclAllReduce` of `count` elements (in place when `send == recv`).
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    ///
    /// # Safety
    /// `send` and `recv` have `count` elements (readable, writable), valid until the collective
    /// completed on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce(
        &self,
        site: CallSite,
        send: u64,
        recv: u64,
        count: usize,
        ty: ElemType,
        op: NcclOp,
        stream: cusys::CUstream,
    ) -> Result<(), NcclError> {
        let a = api()?;
        // SAFETY: guaranteed by the caller.
        unsafe { self.reducing(site, a, a.all_reduce, "ncclAllReduce", send, recv, count, ty, op, stream) }
    }

    /// The shared body of [`Communicator::reduce_scatter`] and [`Communicator::all_reduce`]
    /// (NCCL gives both the same C signature): checks the count, calls `f`, checks its result.
    ///
    /// # Safety
    /// As the public function `name` names.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reducing(
        &self,
        site: CallSite,
        a: &NcclApi,
        f: ReducingFn,
        name: &'static str,
        send: u64,
        recv: u64,
        count: usize,
        ty: ElemType,
        op: NcclOp,
        stream: cusys::CUstream,
    ) -> Result<(), NcclError> {
        let what = if name == "ncclAllReduce" { "all_reduce" } else { "reduce_scatter" };
        self.check_count(site, what, count, ty.size())?;
        // SAFETY: guaranteed by the caller of the public function.
        let code = unsafe {
            f(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_type(ty),
                op.raw(),
                self.comm,
                stream_of(stream),
            )
        };
        a.check(site, name, code, self.comm)
    }

    /// `ncclBroadcast` of `bytes` bytes from `root` (as `ncclUint8`, so any element type).
    ///
    /// # Errors
    /// [`NcclError::InvalidArgument`] for a root outside the communicator; NCCL's errors.
    ///
    /// # Safety
    /// `send` (read on the root) and `recv` have `bytes` bytes, valid until the collective
    /// completed on `stream`.
    pub unsafe fn broadcast(
        &self,
        site: CallSite,
        send: u64,
        recv: u64,
        bytes: usize,
        root: usize,
        stream: cusys::CUstream,
    ) -> Result<(), NcclError> {
        if root >= self.size {
            return Err(NcclError::InvalidArgument {
                site,
                what: format!(
                    "broadcast root {root} is not a rank of this communicator of {} ranks",
                    self.size
                ),
            });
        }
        let a = api()?;
        // SAFETY: guaranteed by the caller.
        let code = unsafe {
            (a.broadcast)(
                send as *const c_void,
                recv as *mut c_void,
                bytes,
                nsys::ncclDataType_t::ncclUint8,
                root as c_int,
                self.comm,
                stream_of(stream),
            )
        };
        a.check(site, "ncclBroadcast", code, self.comm)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        let r = api().and_then(|a| {
            // SAFETY: `comm` is live and destroyed once, here.
            let code = unsafe { (a.comm_destroy)(comm) };
            a.check(
                CallSite::op("comm_destroy").rank(self.rank),
                "ncclCommDestroy",
                code,
                std::ptr::null_mut(),
            )
        });
        if let Err(e) = r {
            self.park.park(e);
        }
    }
}

/// An open NCCL group (`ncclGroupStart`): collectives issued until [`Group::end`] are fused
/// (several communicators driven from one thread, or many collectives in one launch).
///
/// Dropping it without `end` ends the group anyway and parks any error.
#[derive(Debug)]
pub struct Group {
    open: bool,
    park: ErrorPark,
}

impl Group {
    /// `ncclGroupStart`.
    ///
    /// # Errors
    /// [`NcclError`] from NCCL.
    pub fn start(park: ErrorPark) -> Result<Self, NcclError> {
        let a = api()?;
        // SAFETY: no arguments; group calls nest.
        let code = unsafe { (a.group_start)() };
        a.check(CallSite::op("group_start"), "ncclGroupStart", code, std::ptr::null_mut())?;
        Ok(Group { open: true, park })
    }

    /// `ncclGroupEnd`: launches what the group collected.
    ///
    /// # Errors
    /// [`NcclError`] from NCCL (an error of any collective of the group surfaces here).
    pub fn end(mut self) -> Result<(), NcclError> {
        self.open = false;
        end_group()
    }
}

fn end_group() -> Result<(), NcclError> {
    let a = api()?;
    // SAFETY: matches the `ncclGroupStart` of the group being closed.
    let code = unsafe { (a.group_end)() };
    a.check(CallSite::op("group_end"), "ncclGroupEnd", code, std::ptr::null_mut())
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.open {
            if let Err(e) = end_group() {
                self.park.park(e);
            }
        }
    }
}

#[cfg(test)]
#[path = "nccl_tests.rs"]
mod tests;
