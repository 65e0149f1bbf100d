//! [`Hub`]: the processes of a job on one machine meet on a Unix socket, exchange a few bytes
//! and file descriptors, and watch each other's liveness.
//!
//! Rank 0 listens on an abstract Unix socket named after the user and the job key (no file is
//! created, and the name vanishes with the process, whatever way it ends); every other rank
//! connects, retrying until the timeout, and says hello (protocol version, world size, rank,
//! process id, job digest). Once every rank said hello, rank 0 sends each the roster of process
//! ids and every rank opens a pidfd per peer: from then on a peer that dies, SIGKILL included,
//! is seen at once ([`Liveness`]). Exchanges are relayed by rank 0: each rank sends its part,
//! rank 0 sends everyone the whole. A rank that never joins, a peer that dies during an
//! exchange, or a hello that does not fit ends the bootstrap on every rank with an error naming
//! the rank.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

use super::env::LaunchEnv;
use super::{BootstrapError, HubConfig};

const MAGIC: u64 = 0x636f_6c6c_6875_6201; // "collhub", version 1
const HELLO: u8 = 1;
const ROSTER: u8 = 2;
const ABORT: u8 = 3;
const DATA: u8 = 4;
const FD: u8 = 5;
/// Header of a frame: kind (1 byte), sequence number (8), payload length (4).
const HEADER: usize = 13;
/// Longest wait between two liveness checks.
const SLICE: Duration = Duration::from_millis(50);

/// Process liveness of a job's peers: one pidfd per peer, readable once it exited.
#[derive(Debug)]
pub struct Liveness {
    rank: usize,
    pids: Vec<u32>,
    pidfds: Vec<Option<OwnedFd>>,
}

impl Liveness {
    pub(crate) fn new(rank: usize, pids: Vec<u32>) -> Self {
        let pidfds = pids
            .iter()
            .enumerate()
            .map(|(r, &pid)| {
                if r == rank {
                    return None;
                }
                let pid = rustix::process::Pid::from_raw(pid as i32)?;
                rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
            })
            .collect();
        Liveness { rank, pids, pidfds }
    }

    /// Process id of every rank.
    pub fn pids(&self) -> &[u32] {
        &self.pids
    }

    /// The lowest rank whose process has exited, if any (never blocks).
    pub fn first_dead(&self) -> Option<usize> {
        (0..self.pids.len()).find(|&r| self.is_dead(r))
    }

    /// Whether rank `r`'s process has exited (never blocks; `false` for this process, for a
    /// rank outside the job, and for a rank whose pid is 0: on another machine, not watched).
    pub fn is_dead(&self, r: usize) -> bool {
        if r == self.rank || r >= self.pids.len() || self.pids[r] == 0 {
            return false;
        }
        match &self.pidfds[r] {
            Some(fd) => {
                let mut p = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
                let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
                matches!(rustix::event::poll(&mut p, Some(&zero)), Ok(n) if n > 0)
            }
            // No pidfd (an old kernel): a signal-0 probe, which a zombie still passes.
            None => rustix::process::Pid::from_raw(self.pids[r] as i32)
                .is_none_or(|p| rustix::process::test_kill_process(p).is_err()),
        }
    }
}

/// One end of a hub connection, with what arrived and was not consumed yet.
#[derive(Debug)]
struct Link {
    stream: UnixStream,
    inbuf: Vec<u8>,
    fds: std::collections::VecDeque<OwnedFd>,
}

struct Frame {
    kind: u8,
    seq: u64,
    payload: Vec<u8>,
}

impl Link {
    fn new(stream: UnixStream) -> Self {
        Link { stream, inbuf: Vec::new(), fds: Default::default() }
    }

    fn send(
        &mut self,
        kind: u8,
        seq: u64,
        payload: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> std::io::Result<()> {
        let mut head = [0u8; HEADER];
        head[0] = kind;
        head[1..9].copy_from_slice(&seq.to_le_bytes());
        head[9..13].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let fds;
        let mut control = SendAncillaryBuffer::new(&mut space);
        if let Some(fd) = fd {
            fds = [fd];
            control.push(SendAncillaryMessage::ScmRights(&fds));
        }
        // The descriptor travels with the first byte; the rest follows in plain writes.
        let mut sent =
            rustix::net::sendmsg(&self.stream, &[IoSlice::new(&head)], &mut control, SendFlags::NOSIGNAL)?;
        while sent < HEADER {
            sent += rustix::net::send(&self.stream, &head[sent..], SendFlags::NOSIGNAL)?;
        }
        let mut off = 0;
        while off < payload.len() {
            off += rustix::net::send(&self.stream, &payload[off..], SendFlags::NOSIGNAL)?;
        }
        Ok(())
    }

    fn parse(&mut self) -> Option<Frame> {
        if self.inbuf.len() < HEADER {
            return None;
        }
        let len = u32::from_le_bytes(self.inbuf[9..13].try_into().ok()?) as usize;
        if self.inbuf.len() < HEADER + len {
            return None;
        }
        let kind = self.inbuf[0];
        let seq = u64::from_le_bytes(self.inbuf[1..9].try_into().ok()?);
        let payload = self.inbuf[HEADER..HEADER + len].to_vec();
        self.inbuf.drain(..HEADER + len);
        Some(Frame { kind, seq, payload })
    }

    /// The next frame, waiting until `deadline`; `check` runs between slices of waiting (a
    /// liveness probe) and ends the wait with its error.
    fn recv(
        &mut self,
        deadline: Instant,
        check: &mut dyn FnMut() -> Result<(), BootstrapError>,
        eof: &mut dyn FnMut() -> BootstrapError,
        timed_out: &mut dyn FnMut() -> BootstrapError,
    ) -> Result<Frame, BootstrapError> {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(f) = self.parse() {
                return Ok(f);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(timed_out());
            }
            let _ = self.stream.set_read_timeout(Some((deadline - now).min(SLICE)));
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                &self.stream,
                &mut [IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            );
            for msg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = msg {
                    self.fds.extend(fds);
                }
            }
            match got {
                Ok(m) if m.bytes == 0 => return Err(eof()),
                Ok(m) => self.inbuf.extend_from_slice(&buf[..m.bytes]),
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => check()?,
                Err(_) => return Err(eof()),
            }
        }
    }
}

/// The processes of one job, met: exchanges of bytes and descriptors, and liveness.
#[derive(Debug)]
pub struct Hub {
    rank: usize,
    world: usize,
    /// Rank 0: a link per peer (`None` at 0); others: the link to rank 0 at index 0.
    links: Vec<Option<Link>>,
    liveness: Liveness,
    seq: u64,
    timeout: Duration,
}

/// The abstract socket name of a job: user, job digest, world size.
fn socket_name(job: &str, world: usize) -> String {
    let uid = rustix::process::getuid().as_raw();
    format!("collsched-hub-{uid}-{:016x}-{world}", fnv(job.as_bytes()))
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
}

fn io_err(rank: usize, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BootstrapError {
    let what = what.into();
    move |e| BootstrapError::Socket { rank, what: format!("{what}: {e}") }
}

impl Hub {
    /// Meets the other processes of `env`'s job (collective: every rank calls it).
    ///
    /// # Errors
    /// [`BootstrapError::Timeout`] naming the ranks that never joined (on every rank that did);
    /// [`BootstrapError::Env`] when the job has no key and more than one process;
    /// [`BootstrapError::Socket`] for a socket failure (the name in use: another job with the
    /// same key); [`BootstrapError::Protocol`] for a hello that does not fit (another world
    /// size, a rank twice).
    pub fn connect(env: &LaunchEnv, config: &HubConfig) -> Result<Hub, BootstrapError> {
        let (rank, world) = (env.rank, env.world);
        if world == 1 {
            return Ok(Hub {
                rank,
                world,
                links: vec![None],
                liveness: Liveness::new(0, vec![std::process::id()]),
                seq: 0,
                timeout: config.timeout,
            });
        }
        if env.job.is_empty() {
            return Err(BootstrapError::Env(super::EnvError {
                var: "COLLSCHED_RUN_ID",
                value: String::new(),
                what: "nothing tells this job apart from another on the machine; set COLLSCHED_RUN_ID to \
                       one value in every process of the job"
                    .into(),
            }));
        }
        let name = socket_name(&env.job, world);
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(io_err(rank, format!("bootstrap socket name @{name}")))?;
        let deadline = Instant::now() + config.timeout;
        if rank == 0 {
            Self::serve(env, config, &name, &addr, deadline)
        } else {
            Self::join(env, config, &name, &addr, deadline)
        }
    }

    fn serve(
        env: &LaunchEnv,
        config: &HubConfig,
        name: &str,
        addr: &SocketAddr,
        deadline: Instant,
    ) -> Result<Hub, BootstrapError> {
        let world = env.world;
        let listener = UnixListener::bind_addr(addr).map_err(|e| BootstrapError::Socket {
            rank: 0,
            what: format!(
                "cannot listen on bootstrap socket @{name}: {e}; if it is in use, another job with the same job key \
                 runs on this machine: set COLLSCHED_RUN_ID to tell them apart"
            ),
        })?;
        listener.set_nonblocking(true).map_err(io_err(0, "bootstrap socket"))?;
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        let mut pids = vec![0u32; world];
        pids[0] = std::process::id();
        let mut joined = 1;
        let fail = |links: &mut Vec<Option<Link>>, err: BootstrapError| -> BootstrapError {
            let why = err.to_string();
            for l in links.iter_mut().flatten() {
                let _ = l.send(ABORT, 0, why.as_bytes(), None);
            }
            err
        };
        while joined < world {
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let mut link = Link::new(stream);
                    let hello = link.recv(
                        deadline.min(Instant::now() + Duration::from_secs(5)),
                        &mut || Ok(()),
                        &mut || BootstrapError::Protocol {
                            rank: 0,
                            what: "a process connected and hung up".into(),
                        },
                        &mut || BootstrapError::Protocol {
                            rank: 0,
                            what: "a process connected but sent no hello".into(),
                        },
                    );
                    let hello = match hello {
                        Ok(h) => h,
                        Err(e) => {
                            tracing::warn!(target: "collsched::init", "bootstrap: {e}");
                            continue;
                        }
                    };
                    let (peer, pid) = match check_hello(&hello, env, &links) {
                        Ok(x) => x,
                        Err(what) => {
                            let _ = link.send(ABORT, 0, what.as_bytes(), None);
                            return Err(fail(&mut links, BootstrapError::Protocol { rank: 0, what }));
                        }
                    };
                    pids[peer] = pid;
                    links[peer] = Some(link);
                    joined += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (1..world).filter(|&r| links[r].is_none()).collect();
                        let err = BootstrapError::Timeout {
                            rank: 0,
                            missing,
                            waited: config.timeout,
                            what: "never joined the job".into(),
                        };
                        return Err(fail(&mut links, err));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(fail(&mut links, io_err(0, "accepting on the bootstrap socket")(e))),
            }
        }
        let roster: Vec<u8> = pids.iter().flat_map(|p| p.to_le_bytes()).collect();
        for l in links.iter_mut().flatten() {
            l.send(ROSTER, 0, &roster, None).map_err(io_err(0, "sending the roster"))?;
        }
        Ok(Hub { rank: 0, world, links, liveness: Liveness::new(0, pids), seq: 0, timeout: config.timeout })
    }

    fn join(
        env: &LaunchEnv,
        config: &HubConfig,
        name: &str,
        addr: &SocketAddr,
        deadline: Instant,
    ) -> Result<Hub, BootstrapError> {
        let rank = env.rank;
        let stream = loop {
            match UnixStream::connect_addr(addr) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => {
                    return Err(BootstrapError::Timeout {
                        rank,
                        missing: vec![0],
                        waited: config.timeout,
                        what: format!("never opened the bootstrap socket @{name} (last error: {e})"),
                    })
                }
            }
        };
        let mut link = Link::new(stream);
        let mut hello = Vec::with_capacity(28);
        hello.extend_from_slice(&MAGIC.to_le_bytes());
        hello.extend_from_slice(&(env.world as u32).to_le_bytes());
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&std::process::id().to_le_bytes());
        hello.extend_from_slice(&fnv(env.job.as_bytes()).to_le_bytes());
        link.send(HELLO, 0, &hello, None).map_err(io_err(rank, "saying hello to rank 0"))?;
        // Rank 0 gives up at the same deadline and then says who is missing: wait a little
        // longer for its word.
        let grace = (config.timeout / 10).max(Duration::from_secs(1));
        let frame = link.recv(
            deadline + grace,
            &mut || Ok(()),
            &mut || BootstrapError::PeerDied { rank, peer: 0, during: "the bootstrap" },
            &mut || BootstrapError::Timeout {
                rank,
                missing: Vec::new(),
                waited: config.timeout,
                what: "rank 0 did not send the roster (some ranks never joined)".into(),
            },
        )?;
        match frame.kind {
            ROSTER if frame.payload.len() == 4 * env.world => {
                let pids = frame
                    .payload
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Ok(Hub {
                    rank,
                    world: env.world,
                    links: vec![Some(link)],
                    liveness: Liveness::new(rank, pids),
                    seq: 0,
                    timeout: config.timeout,
                })
            }
            ABORT => {
                Err(BootstrapError::Aborted { rank, reason: String::from_utf8_lossy(&frame.payload).into() })
            }
            k => Err(BootstrapError::Protocol {
                rank,
                what: format!("expected the roster from rank 0, got frame kind {k}"),
            }),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The peers' liveness (pidfds), for waits outside the hub.
    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// Every rank's `data`, in rank order (collective).
    ///
    /// # Errors
    /// [`BootstrapError::PeerDied`] naming a rank that exited, [`BootstrapError::Aborted`] when
    /// rank 0 saw one, [`BootstrapError::Timeout`].
    pub fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        self.seq += 1;
        let (rank, seq) = (self.rank, self.seq);
        if self.world == 1 {
            return Ok(vec![data.to_vec()]);
        }
        if rank != 0 {
            let link = self.links[0].as_mut().ok_or_else(|| lost(rank))?;
            link.send(DATA, seq, data, None).map_err(|_| BootstrapError::PeerDied {
                rank,
                peer: 0,
                during: "an exchange",
            })?;
            let f = recv_from(&mut self.links, 0, rank, &self.liveness, self.timeout, "an exchange")?;
            let f = expect(f, DATA, seq, rank)?;
            return decode_list(&f.payload, self.world).ok_or_else(|| BootstrapError::Protocol {
                rank,
                what: "rank 0 sent a malformed exchange".into(),
            });
        }
        let mut parts: Vec<Vec<u8>> = vec![Vec::new(); self.world];
        parts[0] = data.to_vec();
        #[allow(clippy::needless_range_loop)] // `peer` names the link too
        for peer in 1..self.world {
            let f = self.relay_recv(peer, "an exchange")?;
            parts[peer] = expect(f, DATA, seq, 0).map_err(|e| self.abort_all(e))?.payload;
        }
        let list = encode_list(&parts);
        for peer in 1..self.world {
            if let Some(l) = self.links[peer].as_mut() {
                l.send(DATA, seq, &list, None).map_err(|_| BootstrapError::PeerDied {
                    rank: 0,
                    peer,
                    during: "an exchange",
                })?;
            }
        }
        Ok(parts)
    }

    /// Every rank's descriptor `fd`, in rank order (this rank's own as a duplicate; collective).
    ///
    /// # Errors
    /// As [`Hub::all_gather`].
    pub fn all_gather_fds(&mut self, fd: BorrowedFd<'_>) -> Result<Vec<OwnedFd>, BootstrapError> {
        self.seq += 1;
        let (rank, seq, world) = (self.rank, self.seq, self.world);
        let own = fd.try_clone_to_owned().map_err(io_err(rank, "duplicating a descriptor"))?;
        if world == 1 {
            return Ok(vec![own]);
        }
        if rank != 0 {
            let link = self.links[0].as_mut().ok_or_else(|| lost(rank))?;
            link.send(FD, seq, &[], Some(fd)).map_err(|_| BootstrapError::PeerDied {
                rank,
                peer: 0,
                during: "a descriptor exchange",
            })?;
            let mut out = Vec::with_capacity(world);
            for r in 0..world {
                let f = recv_from(
                    &mut self.links,
                    0,
                    rank,
                    &self.liveness,
                    self.timeout,
                    "a descriptor exchange",
                )?;
                expect(f, FD, seq, rank)?;
                let link = self.links[0].as_mut().ok_or_else(|| lost(rank))?;
                match (r == rank, link.fds.pop_front()) {
                    (_, None) => {
                        return Err(BootstrapError::Protocol {
                            rank,
                            what: format!("rank 0 sent no descriptor for rank {r}"),
                        })
                    }
                    (true, Some(_)) => {
                        out.push(own.try_clone().map_err(io_err(rank, "duplicating a descriptor"))?)
                    }
                    (false, Some(d)) => out.push(d),
                }
            }
            return Ok(out);
        }
        let mut fds: Vec<Option<OwnedFd>> = (0..world).map(|_| None).collect();
        fds[0] = Some(own);
        #[allow(clippy::needless_range_loop)] // `peer` names the link too
        for peer in 1..world {
            let f = self.relay_recv(peer, "a descriptor exchange")?;
            expect(f, FD, seq, 0).map_err(|e| self.abort_all(e))?;
            let d = self.links[peer].as_mut().and_then(|l| l.fds.pop_front());
            fds[peer] = Some(d.ok_or_else(|| BootstrapError::Protocol {
                rank: 0,
                what: format!("rank {peer} sent no descriptor"),
            })?);
        }
        let fds: Vec<OwnedFd> = fds.into_iter().flatten().collect();
        for peer in 1..world {
            for d in &fds {
                if let Some(l) = self.links[peer].as_mut() {
                    l.send(FD, seq, &[], Some(d.as_fd())).map_err(|_| BootstrapError::PeerDied {
                        rank: 0,
                        peer,
                        during: "a descriptor exchange",
                    })?;
                }
            }
        }
        Ok(fds)
    }

    /// Waits until every rank arrived (collective).
    ///
    /// # Errors
    /// As [`Hub::all_gather`].
    pub fn barrier(&mut self) -> Result<(), BootstrapError> {
        self.all_gather(&[]).map(|_| ())
    }

    /// Rank 0: the next frame of `peer`; a peer that dies meanwhile (any peer) aborts everyone.
    fn relay_recv(&mut self, peer: usize, during: &'static str) -> Result<Frame, BootstrapError> {
        match recv_from(&mut self.links, peer, 0, &self.liveness, self.timeout, during) {
            Ok(f) => Ok(f),
            Err(e) => Err(self.abort_all(e)),
        }
    }

    /// Rank 0: tells every peer why the job ends, and returns the error.
    fn abort_all(&mut self, e: BootstrapError) -> BootstrapError {
        let why = e.to_string();
        for l in self.links.iter_mut().flatten() {
            let _ = l.send(ABORT, 0, why.as_bytes(), None);
        }
        e
    }
}

fn lost(rank: usize) -> BootstrapError {
    BootstrapError::Protocol { rank, what: "the link to rank 0 is gone".into() }
}

/// The next frame on `links[at]` (rank 0's link to peer `at`, or a peer's link to rank 0),
/// watching every peer's liveness.
fn recv_from(
    links: &mut [Option<Link>],
    at: usize,
    rank: usize,
    liveness: &Liveness,
    timeout: Duration,
    during: &'static str,
) -> Result<Frame, BootstrapError> {
    let link = links[at].as_mut().ok_or_else(|| lost(rank))?;
    let peer = if rank == 0 { at } else { 0 };
    let f = link.recv(
        Instant::now() + timeout,
        &mut || match liveness.first_dead() {
            Some(dead) => Err(BootstrapError::PeerDied { rank, peer: dead, during }),
            None => Ok(()),
        },
        &mut || BootstrapError::PeerDied { rank, peer: liveness.first_dead().unwrap_or(peer), during },
        &mut || BootstrapError::Timeout {
            rank,
            missing: vec![peer],
            waited: timeout,
            what: format!("did not take part in {during}"),
        },
    )?;
    if f.kind == ABORT {
        return Err(BootstrapError::Aborted { rank, reason: String::from_utf8_lossy(&f.payload).into() });
    }
    Ok(f)
}

fn expect(f: Frame, kind: u8, seq: u64, rank: usize) -> Result<Frame, BootstrapError> {
    if f.kind != kind || f.seq != seq {
        return Err(BootstrapError::Protocol {
            rank,
            what: format!(
                "expected exchange {seq} (frame kind {kind}), got exchange {} (kind {}): the ranks called the hub's \
                 exchanges in different orders",
                f.seq, f.kind
            ),
        });
    }
    Ok(f)
}

/// Checks a hello against this job; returns the peer's rank and process id, or why not.
fn check_hello(f: &Frame, env: &LaunchEnv, links: &[Option<Link>]) -> Result<(usize, u32), String> {
    let p = &f.payload;
    if f.kind != HELLO || p.len() != 28 || u64::from_le_bytes(p[0..8].try_into().unwrap_or_default()) != MAGIC
    {
        return Err(
            "a process spoke another protocol on the bootstrap socket (another collsched version?)".into()
        );
    }
    let word = |i: usize| u32::from_le_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]) as usize;
    let (world, rank, pid) = (word(8), word(12), word(16) as u32);
    let job = u64::from_le_bytes(p[20..28].try_into().unwrap_or_default());
    if world != env.world || job != fnv(env.job.as_bytes()) {
        return Err(format!(
            "rank {rank} (pid {pid}) belongs to another job (world {world}, rank 0 has world {}); give every process \
             of one job the same launcher variables",
            env.world
        ));
    }
    if rank == 0 || rank >= env.world || links[rank].is_some() {
        return Err(format!(
            "rank {rank} (pid {pid}) joined twice or is out of range for world {}",
            env.world
        ));
    }
    Ok((rank, pid))
}

fn encode_list(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

fn decode_list(mut b: &[u8], n: usize) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
        out.push(b.get(4..4 + len)?.to_vec());
        b = &b[4 + len..];
    }
    b.is_empty().then_some(out)
}
