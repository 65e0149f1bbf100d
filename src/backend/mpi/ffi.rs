//! The MPI calls of the `mpi` backend, through rsmpi's raw bindings (`mpi::ffi`): this file is
//! the backend's only `unsafe`. Buffers cross as raw pointers, counts as bytes
//! (`MPI_UINT8_T`): the library's own kernels do every reduction, so MPI only moves bytes.
//!
//! Errors are returned, never fatal: every communicator made here gets `MPI_ERRORS_RETURN`,
//! and a failing call comes back as an [`MpiError`] with MPI's own error string.

use std::ffi::{c_char, c_int};
use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use mpi::ffi;

use crate::backend::CollectiveKind;

/// A failed MPI call: which, its code, and MPI's text for it.
#[derive(Clone, Debug)]
pub(super) struct MpiError {
    pub api: &'static str,
    pub text: String,
}

impl std::fmt::Display for MpiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.api, self.text)
    }
}

fn check(api: &'static str, code: c_int) -> Result<(), MpiError> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut buf = vec![0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING characters and a terminator, as the call needs;
    // `len` is a valid out-pointer. The call is allowed at any time, even after errors.
    let ok = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) } == ffi::MPI_SUCCESS as c_int;
    let text = if ok {
        let bytes: Vec<u8> =
            buf[..len.clamp(0, buf.len() as c_int) as usize].iter().map(|&c| c as u8).collect();
        format!("{} (MPI error {code})", String::from_utf8_lossy(&bytes))
    } else {
        format!("MPI error {code}")
    };
    Err(MpiError { api, text })
}

/// `MPI_UINT8_T`: everything moves as bytes.
fn byte() -> ffi::MPI_Datatype {
    // SAFETY: reading a constant handle the C shim of rsmpi defines.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// `MPI_IN_PLACE`, which rsmpi's bindings do not carry: a macro of `mpi.h` whose value each
/// implementation picks. Known for Open MPI (`(void *) 1`) and the MPICH family (`(void *) -1`);
/// `None` for another MPI (callers then send a copy instead).
pub(super) fn in_place() -> Option<*const u8> {
    static IN_PLACE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let v = *IN_PLACE.get_or_init(|| {
        let version = mpi::environment::library_version().unwrap_or_default();
        if version.contains("Open MPI") {
            Some(1)
        } else if ["MPICH", "MVAPICH", "Intel(R) MPI"].iter().any(|m| version.contains(m)) {
            Some(usize::MAX)
        } else {
            None
        }
    });
    v.map(|p| p as *const u8)
}

/// A byte count or offset as MPI takes it, or an error naming the limit.
pub(super) fn count(bytes: usize) -> Result<c_int, MpiError> {
    c_int::try_from(bytes).map_err(|_| MpiError {
        api: "count",
        text: format!(
            "{bytes} bytes exceed MPI's count limit ({} bytes); use smaller buckets (--bucket-mb)",
            c_int::MAX
        ),
    })
}

/// A communicator handle. Never freed: MPI_Finalize releases it (freeing is collective over
/// the members, and the places' communicators have no agreed order to do it in).
#[derive(Debug)]
pub(super) struct Comm(ffi::MPI_Comm);

// SAFETY: the backend runs MPI at MPI_THREAD_MULTIPLE (checked at initialisation), under which a
// communicator handle may be used from any thread; each (group, stream) communicator is used by
// one stream thread at a time (its place's lock).
unsafe impl Send for Comm {}
// SAFETY: as for `Send`.
unsafe impl Sync for Comm {}

/// Whether MPI is initialized, and at which thread level.
pub(super) fn thread_level() -> Option<c_int> {
    let mut init: c_int = 0;
    // SAFETY: MPI_Initialized may be called at any time; `init` is a valid out-pointer.
    unsafe { ffi::MPI_Initialized(&mut init) };
    let mut fin: c_int = 0;
    // SAFETY: as above.
    unsafe { ffi::MPI_Finalized(&mut fin) };
    if init == 0 || fin != 0 {
        return None;
    }
    let mut level: c_int = 0;
    // SAFETY: MPI is initialized and not finalized (just checked); `level` is an out-pointer.
    unsafe { ffi::MPI_Query_thread(&mut level) };
    Some(level)
}

/// `MPI_THREAD_MULTIPLE`.
pub(super) fn thread_multiple() -> c_int {
    // SAFETY: reading a constant the C shim of rsmpi defines.
    unsafe { ffi::RSMPI_THREAD_MULTIPLE }
}

impl Comm {
    /// A duplicate of `MPI_COMM_WORLD` with errors returned. MPI must be initialized.
    pub(super) fn world_dup() -> Result<Comm, MpiError> {
        let mut out = MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: MPI is initialized (the caller's contract, checked by `thread_level`);
        // `out` receives the new handle.
        check("MPI_Comm_dup", unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, out.as_mut_ptr()) })?;
        // SAFETY: MPI_Comm_dup succeeded, so it wrote the handle.
        let comm = Comm(unsafe { out.assume_init() });
        comm.errors_return()?;
        Ok(comm)
    }

    fn errors_return(&self) -> Result<(), MpiError> {
        // SAFETY: a valid communicator and a predefined error handler.
        check("MPI_Comm_set_errhandler", unsafe {
            ffi::MPI_Comm_set_errhandler(self.0, ffi::RSMPI_ERRORS_RETURN)
        })
    }

    /// This process's rank in the communicator.
    pub(super) fn rank(&self) -> Result<usize, MpiError> {
        let mut r: c_int = 0;
        // SAFETY: a valid communicator; `r` is an out-pointer.
        check("MPI_Comm_rank", unsafe { ffi::MPI_Comm_rank(self.0, &mut r) })?;
        Ok(r as usize)
    }

    /// Processes in the communicator.
    pub(super) fn size(&self) -> Result<usize, MpiError> {
        let mut n: c_int = 0;
        // SAFETY: a valid communicator; `n` is an out-pointer.
        check("MPI_Comm_size", unsafe { ffi::MPI_Comm_size(self.0, &mut n) })?;
        Ok(n as usize)
    }

    /// A communicator of `ranks` (ranks of this one, in that order), collective over them alone
    /// (`MPI_Comm_create_group`), with errors returned.
    pub(super) fn subgroup(&self, ranks: &[usize], tag: c_int) -> Result<Comm, MpiError> {
        let ranks: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        let mut all = MaybeUninit::<ffi::MPI_Group>::uninit();
        // SAFETY: a valid communicator; `all` receives its group.
        check("MPI_Comm_group", unsafe { ffi::MPI_Comm_group(self.0, all.as_mut_ptr()) })?;
        // SAFETY: MPI_Comm_group succeeded.
        let mut all = unsafe { all.assume_init() };
        let mut sub = MaybeUninit::<ffi::MPI_Group>::uninit();
        // SAFETY: `ranks` holds `len` valid ranks of the group (the caller's group is a subset
        // of the world); `sub` receives the new group.
        let incl = check("MPI_Group_incl", unsafe {
            ffi::MPI_Group_incl(all, ranks.len() as c_int, ranks.as_ptr(), sub.as_mut_ptr())
        });
        // SAFETY: `all` is a group this function made.
        unsafe { ffi::MPI_Group_free(&mut all) };
        incl?;
        // SAFETY: MPI_Group_incl succeeded.
        let mut sub = unsafe { sub.assume_init() };
        let mut out = MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: a valid communicator and group of its processes; `out` receives the handle.
        let made = check("MPI_Comm_create_group", unsafe {
            ffi::MPI_Comm_create_group(self.0, sub, tag, out.as_mut_ptr())
        });
        // SAFETY: `sub` is a group this function made.
        unsafe { ffi::MPI_Group_free(&mut sub) };
        made?;
        // SAFETY: MPI_Comm_create_group succeeded and this process is in the group.
        let comm = Comm(unsafe { out.assume_init() });
        comm.errors_return()?;
        Ok(comm)
    }

    /// An all-gather of `mine` (the same length on every member) that returns when done:
    /// every member's bytes, in rank order. For small control exchanges: it waits napping, at
    /// most `timeout` ([`wait_napping`]).
    pub(super) fn all_gather_blocking(&self, mine: &[u8], timeout: Duration) -> Result<Vec<u8>, MpiError> {
        let n = self.size()?;
        let len = count(mine.len())?;
        let send = mine.to_vec();
        let mut out = vec![0u8; mine.len() * n];
        let mut reqs = Requests::default();
        // SAFETY: `send` holds `len` bytes and `out` `n * len`, not overlapping; both live until
        // the request completed, or are leaked below if it may not have.
        let started = unsafe { reqs.all_gather(self, send.as_ptr(), len, out.as_mut_ptr()) };
        if let Err(e) = started.and_then(|()| wait_napping(&mut reqs, "MPI_Iallgather", timeout)) {
            if !reqs.pending().is_empty() {
                // MPI may still write into them: never freed.
                std::mem::forget(send);
                std::mem::forget(out);
            }
            return Err(e);
        }
        Ok(out)
    }

    /// MPI's own blocking `op` on f32 sums (a reference for benchmarks): all-gather of `send`
    /// into `recv` (`n` times as long), reduce-scatter of `send` into `recv` (`1/n` of it),
    /// or all-reduce of `send` into `recv` (as long). A broadcast has no reference: an error.
    pub(super) fn reference_f32(
        &self,
        op: CollectiveKind,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), MpiError> {
        let n = self.size()?;
        let (f, sum) = (
            // SAFETY: reading constant handles the C shim of rsmpi defines.
            unsafe { ffi::RSMPI_FLOAT },
            // SAFETY: as above.
            unsafe { ffi::RSMPI_SUM },
        );
        let bad =
            |what: &str| MpiError { api: "reference", text: format!("buffer lengths do not fit an {what}") };
        match op {
            CollectiveKind::Broadcast => {
                Err(MpiError { api: "reference", text: "no MPI reference is timed for broadcast".into() })
            }
            CollectiveKind::AllGather => {
                if recv.len() != send.len() * n {
                    return Err(bad("all-gather"));
                }
                let c = count(send.len())?;
                // SAFETY: `send` holds `c` floats and `recv` `n * c`, distinct, alive through the
                // blocking call.
                check("MPI_Allgather", unsafe {
                    ffi::MPI_Allgather(send.as_ptr().cast(), c, f, recv.as_mut_ptr().cast(), c, f, self.0)
                })
            }
            CollectiveKind::ReduceScatter => {
                if send.len() != recv.len() * n {
                    return Err(bad("reduce-scatter"));
                }
                let c = count(recv.len())?;
                // SAFETY: `send` holds `n * c` floats and `recv` `c`, distinct, alive through the
                // blocking call.
                check("MPI_Reduce_scatter_block", unsafe {
                    ffi::MPI_Reduce_scatter_block(
                        send.as_ptr().cast(),
                        recv.as_mut_ptr().cast(),
                        c,
                        f,
                        sum,
                        self.0,
                    )
                })
            }
            CollectiveKind::AllReduce => {
                if send.len() != recv.len() {
                    return Err(bad("all-reduce"));
                }
                let c = count(send.len())?;
                // SAFETY: both hold `c` floats, distinct, alive through the blocking call.
                check("MPI_Allreduce", unsafe {
                    ffi::MPI_Allreduce(send.as_ptr().cast(), recv.as_mut_ptr().cast(), c, f, sum, self.0)
                })
            }
        }
    }

    /// A barrier that returns when every member entered it, waiting napping, at most
    /// `timeout` ([`wait_napping`]).
    pub(super) fn barrier(&self, timeout: Duration) -> Result<(), MpiError> {
        let mut reqs = Requests::default();
        // SAFETY: a valid communicator; the request touches no memory of ours.
        reqs.push("MPI_Ibarrier", |r| unsafe { ffi::MPI_Ibarrier(self.0, r) })?;
        wait_napping(&mut reqs, "MPI_Ibarrier", timeout)
    }
}

/// Tests `reqs` until they completed, sleeping at least 20 us between tests (with the kernel's
/// timer slack, about 70 us on Linux; MPI moves a non-blocking collective on only inside a
/// test, so each of its rounds may wait one nap: fine for control exchanges). MPI's blocking calls spin,
/// and on a machine with as many busy threads as cores a spinning rank keeps a peer's thread
/// (or the network's softirq work) off a core until the scheduler's next tick: 4 ms on a 2-core
/// VM, where a rank that reached a control exchange first held up the other's last collective
/// by that much (`collsched bench` over `mpi` counted it in its timed iterations). Past
/// `timeout` it gives up, naming `api` (the requests stay pending: MPI may still use their
/// buffers).
pub(super) fn wait_napping(
    reqs: &mut Requests,
    api: &'static str,
    timeout: Duration,
) -> Result<(), MpiError> {
    let start = Instant::now();
    while !reqs.test()? {
        if start.elapsed() >= timeout {
            return Err(MpiError {
                api,
                text: format!(
                    "a control exchange over the job (every rank's part in a bench's rows, a checkpoint's \
                     index, a barrier) did not complete within {timeout:?}: a rank stalled, exited or never \
                     reached it (raise COLLSCHED_TIMEOUT_SECS if merely slow)"
                ),
            });
        }
        std::thread::sleep(Duration::from_micros(20));
    }
    Ok(())
}

/// Requests of started non-blocking calls, in the order started.
#[derive(Debug, Default)]
pub(super) struct Requests {
    reqs: Vec<ffi::MPI_Request>,
    done: Vec<bool>,
}

// SAFETY: request handles may be tested from any thread at MPI_THREAD_MULTIPLE; a `Requests`
// belongs to one place, used by one stream thread at a time.
unsafe impl Send for Requests {}

impl Requests {
    /// Whether every started request completed (MPI frees completed ones); then forgets them.
    pub(super) fn test(&mut self) -> Result<bool, MpiError> {
        let mut all = true;
        for (req, done) in self.reqs.iter_mut().zip(self.done.iter_mut()) {
            if *done {
                continue;
            }
            let mut flag: c_int = 0;
            // SAFETY: a request this backend started and that did not complete yet; the status
            // is ignored.
            check("MPI_Test", unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) })?;
            *done = flag != 0;
            all &= *done;
        }
        if all {
            self.reqs.clear();
            self.done.clear();
        }
        Ok(all)
    }

    /// Indices (in start order) of the requests not complete yet.
    pub(super) fn pending(&self) -> Vec<usize> {
        (0..self.done.len()).filter(|&i| !self.done[i]).collect()
    }

    fn push(
        &mut self,
        api: &'static str,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
    ) -> Result<(), MpiError> {
        let mut req = MaybeUninit::<ffi::MPI_Request>::uninit();
        check(api, start(req.as_mut_ptr()))?;
        // SAFETY: the call succeeded, so it wrote the request.
        self.reqs.push(unsafe { req.assume_init() });
        self.done.push(false);
        Ok(())
    }

    /// Starts sending `bytes` at `buf` to rank `to` of `comm`, with `tag`.
    ///
    /// # Safety
    /// `buf` readable for `bytes` and unchanged until this request completes.
    pub(super) unsafe fn send(
        &mut self,
        comm: &Comm,
        buf: *const u8,
        bytes: usize,
        to: usize,
        tag: c_int,
    ) -> Result<(), MpiError> {
        let (t, len) = (byte(), count(bytes)?);
        // SAFETY: the caller's contract.
        self.push("MPI_Isend", |r| unsafe { ffi::MPI_Isend(buf.cast(), len, t, to as c_int, tag, comm.0, r) })
    }

    /// Starts receiving `bytes` into `buf` from rank `from` of `comm`, with `tag`.
    ///
    /// # Safety
    /// `buf` writable for `bytes` and untouched by anyone else until this request completes.
    pub(super) unsafe fn recv(
        &mut self,
        comm: &Comm,
        buf: *mut u8,
        bytes: usize,
        from: usize,
        tag: c_int,
    ) -> Result<(), MpiError> {
        let (t, len) = (byte(), count(bytes)?);
        // SAFETY: the caller's contract.
        self.push("MPI_Irecv", |r| unsafe {
            ffi::MPI_Irecv(buf.cast(), len, t, from as c_int, tag, comm.0, r)
        })
    }

    /// Starts an all-gather: `send` (`bytes`) from every member into `recv` (`n * bytes`).
    /// `send` may be [`in_place`]'s value (this member's part already in `recv`).
    ///
    /// # Safety
    /// `send` readable and `recv` writable for those sizes, not overlapping, both untouched by
    /// anyone else until these requests complete.
    pub(super) unsafe fn all_gather(
        &mut self,
        comm: &Comm,
        send: *const u8,
        bytes: c_int,
        recv: *mut u8,
    ) -> Result<(), MpiError> {
        let t = byte();
        // SAFETY: the caller's contract.
        self.push("MPI_Iallgather", |r| unsafe {
            ffi::MPI_Iallgather(send.cast(), bytes, t, recv.cast(), bytes, t, comm.0, r)
        })
    }

    /// Starts an all-gather of different sizes: `send` (`counts[me]` bytes) from every member
    /// to `recv + displs[q]` (`counts[q]` bytes).
    ///
    /// # Safety
    /// As [`Requests::all_gather`]; `counts` and `displs` (one per member) stay unchanged until
    /// these requests complete.
    pub(super) unsafe fn all_gather_v(
        &mut self,
        comm: &Comm,
        send: *const u8,
        recv: *mut u8,
        counts: &[c_int],
        displs: &[c_int],
        me: usize,
    ) -> Result<(), MpiError> {
        let t = byte();
        // SAFETY: the caller's contract.
        self.push("MPI_Iallgatherv", |r| unsafe {
            ffi::MPI_Iallgatherv(
                send.cast(),
                counts[me],
                t,
                recv.cast(),
                counts.as_ptr(),
                displs.as_ptr(),
                t,
                comm.0,
                r,
            )
        })
    }

    /// Starts an all-to-all: chunk q of `send` (`bytes` each) to member q, member p's chunk for
    /// this member into chunk p of `recv`.
    ///
    /// # Safety
    /// As [`Requests::all_gather`], for `n * bytes` on both sides.
    pub(super) unsafe fn all_to_all(
        &mut self,
        comm: &Comm,
        send: *const u8,
        bytes: c_int,
        recv: *mut u8,
    ) -> Result<(), MpiError> {
        let t = byte();
        // SAFETY: the caller's contract.
        self.push("MPI_Ialltoall", |r| unsafe {
            ffi::MPI_Ialltoall(send.cast(), bytes, t, recv.cast(), bytes, t, comm.0, r)
        })
    }

    /// Starts an all-to-all of different sizes (`scounts`/`sdispls` into `send`,
    /// `rcounts`/`rdispls` into `recv`, one per member, in bytes).
    ///
    /// # Safety
    /// As [`Requests::all_gather_v`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn all_to_all_v(
        &mut self,
        comm: &Comm,
        send: *const u8,
        scounts: &[c_int],
        sdispls: &[c_int],
        recv: *mut u8,
        rcounts: &[c_int],
        rdispls: &[c_int],
    ) -> Result<(), MpiError> {
        let t = byte();
        // SAFETY: the caller's contract.
        self.push("MPI_Ialltoallv", |r| unsafe {
            ffi::MPI_Ialltoallv(
                send.cast(),
                scounts.as_ptr(),
                sdispls.as_ptr(),
                t,
                recv.cast(),
                rcounts.as_ptr(),
                rdispls.as_ptr(),
                t,
                comm.0,
                r,
            )
        })
    }

    /// Starts a broadcast of `bytes` at `buf` from member `root`.
    ///
    /// # Safety
    /// `buf` valid for `bytes` (read on the root, written elsewhere) and untouched by anyone
    /// else until these requests complete.
    pub(super) unsafe fn broadcast(
        &mut self,
        comm: &Comm,
        buf: *mut u8,
        bytes: c_int,
        root: usize,
    ) -> Result<(), MpiError> {
        let t = byte();
        // SAFETY: the caller's contract.
        self.push("MPI_Ibcast", |r| unsafe {
            ffi::MPI_Ibcast(buf.cast(), bytes, t, root as c_int, comm.0, r)
        })
    }
}
