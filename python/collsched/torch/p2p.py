"""Point-to-point messages of the ``"collsched"`` backend (``send``, ``recv``, ``isend``,
``irecv``, ``recv`` from any source, ``batch_isend_irecv``), on shared memory.

A message is a memory file of the sender (``memfd_create``: anonymous, no name in
``/dev/shm``, gone with the last process holding it) with the tensor's bytes; the group's
store carries its announcement, ``collsched/p2p/<src>/<dst>/<tag>/<seq>`` -> ``"<pid> <fd>
<bytes>"``, and the receiver's acknowledgement (``.../ack``). The receiver opens the file
through ``/proc/<pid>/fd/<fd>`` and reads it into its tensor. Messages between two members
in one direction with one tag are matched in the order they were posted (each side counts
its own), whatever else is in flight: crossing ``isend``/``irecv`` pairs, several peers and
tags never wait on each other.

A send is eager: its bytes are copied out when it is posted and its work is complete at once
(the tensor may be reused); the file stays open until the receiver acknowledges it (checked
at each later message, and waited for when the process exits: at most
``COLLSCHED_P2P_EXIT_WAIT_SECS``, default 30 s, and the timeout). A
receive reads at its work's ``wait()`` (or a positive ``is_completed()``, which polls without
waiting) and waits at most the backend's timeout (``COLLSCHED_TIMEOUT_SECS``, or the group's
``timeout``), counted from its posting, or ``wait(timeout)``'s (the receive stays pending
then), before a :class:`collsched.PeerError` that names the peer and the op; polled, it turns
complete at the timeout and its ``wait()`` raises. A sender whose process exited (each
member's process id is in the store; a pidfd watches it) fails the receive at once.
The collectives' stream is not used: its collectives meet in launch order, which independent
``isend``/``irecv`` calls do not follow.
"""

from __future__ import annotations

import atexit
import os
import select
import sys
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from .._native import CollschedError, PeerError

_PREFIX = "collsched/p2p"


def _bytes_of(t: torch.Tensor) -> Any:
    """A contiguous tensor's bytes as a writable buffer (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class Mailbox:
    """One group's point-to-point messages on this member (``me`` of ``n``)."""

    def __init__(self, store: Any, me: int, n: int, ranks: list[int], timeout: float) -> None:
        self._store = store
        self._me = me
        self._n = n
        self._ranks = ranks
        self._timeout = timeout
        self._sent: dict[tuple[int, int], int] = defaultdict(int)
        self._taken: dict[tuple[int, int], int] = defaultdict(int)
        # Claims of messages (sequence numbers) are made under this lock: a receive may be read
        # on the futures' thread while the caller posts or polls others.
        self._claim = threading.Lock()
        # Receives from any source posted and not yet read, per tag.
        self._any: dict[int, int] = defaultdict(int)
        # Announced messages whose file this rank keeps open until acknowledged.
        self._held: dict[str, int] = {}
        # Each member's process id, in the store, so that a receive from a member whose process
        # exited fails at once, not at the timeout; pidfds of the peers looked up (or None).
        self._store.set(f"{_PREFIX}/pid/{me}", str(os.getpid()))
        self._pidfds: dict[int, int | None] = {}
        weakref.finalize(self, _close_all, self._pidfds)
        atexit.register(_flush_at_exit, weakref.ref(self))

    def where(self, op: str, peer: int | None, tag: int) -> str:
        who = f"rank {self._ranks[self._me]} (group rank {self._me} of {self._n})"
        to = "" if peer is None else (" to" if op == "send" else " from") + f" group rank {peer}"
        return f"collsched: {op}{to} with tag {tag} on {who}"

    def check_peer(self, op: str, peer: int, tag: int) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self._n or peer == self._me:
            raise CollschedError(
                f"{self.where(op, peer, tag)}: no such peer; give a group rank in 0..{self._n - 1} other than "
                f"{self._me}"
            )

    @staticmethod
    def _key(src: int, dst: int, tag: int, seq: int) -> str:
        return f"{_PREFIX}/{src}/{dst}/{tag}/{seq}"

    # -- sending -----------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Posts ``tensor`` to group rank ``dst`` (its bytes copied now)."""
        self.check_peer("send", dst, tag)
        self._reap()
        data = tensor.detach().contiguous()
        fd = os.memfd_create("collsched-p2p", os.MFD_CLOEXEC)
        try:
            view = _bytes_of(data) if data.numel() else memoryview(b"")
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            seq = self._sent[(dst, tag)]
            key = self._key(self._me, dst, tag, seq)
            self._store.set(key, f"{os.getpid()} {fd} {len(view)}")
        except BaseException:
            os.close(fd)
            raise
        self._sent[(dst, tag)] = seq + 1
        self._held[key] = fd

    def _reap(self) -> None:
        """Closes the files of messages their receivers acknowledged."""
        for key, fd in list(self._held.items()):
            if self._store.check([f"{key}/ack"]):
                os.close(fd)
                del self._held[key]
                for k in (key, f"{key}/ack"):
                    try:
                        self._store.delete_key(k)
                    except Exception:  # a store without deletion (FileStore) keeps the few bytes
                        pass

    def flush(self) -> None:
        """Waits (at most ``COLLSCHED_P2P_EXIT_WAIT_SECS``, 30 s, and the timeout) for the
        receivers of this rank's messages, so that a rank that sends and exits does not take
        its messages with it (run at exit)."""
        try:
            most = float(os.environ.get("COLLSCHED_P2P_EXIT_WAIT_SECS", "30"))
        except ValueError:
            most = 30.0
        deadline = time.monotonic() + min(self._timeout, most)
        try:
            self._reap()
            while self._held and time.monotonic() < deadline:
                time.sleep(0.005)
                self._reap()
        except Exception:  # the store is gone: no receiver can take them any more
            return
        if self._held:
            print(
                f"{self.where('send', None, -1)}: {len(self._held)} messages not received by the time "
                "this process exited (COLLSCHED_P2P_EXIT_WAIT_SECS)",
                file=sys.stderr,
            )

    # -- receiving ---------------------------------------------------------------------------

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> tuple[Callable[[], None], Callable[[], bool]]:
        """Claims the next message from group rank ``src`` with ``tag``; returns what reads it
        into ``tensor`` (waiting for it until the timeout, counted from now) and what tells
        whether reading would not wait (it came, or the time is up)."""
        self.check_peer("recv", src, tag)
        with self._claim:
            if self._any[tag]:
                raise CollschedError(
                    f"{self.where('recv', src, tag)}: a receive from any source with this tag, posted before, "
                    "is not read yet; wait for it first (messages are matched to receives in posting order)"
                )
            seq = self._taken[(src, tag)]
            self._taken[(src, tag)] = seq + 1
        key = self._key(src, self._me, tag, seq)
        deadline = time.monotonic() + self._timeout

        def ready() -> bool:
            return bool(self._store.check([key])) or time.monotonic() > deadline or self.exited(src)

        return (lambda: self._read(key, tensor, "recv", src, tag, deadline)), ready

    def recv_any(self, tensor: torch.Tensor, tag: int) -> tuple[Callable[[], int], Callable[[], bool]]:
        """What waits for the first message with ``tag`` from any member (until the timeout,
        counted from now), reads it into ``tensor`` and returns its sender's group rank; and
        what tells whether that would not wait."""
        deadline = time.monotonic() + self._timeout
        peers = [r for r in range(self._n) if r != self._me]
        with self._claim:
            self._any[tag] += 1

        def ready() -> bool:
            came = any(self.ready(p, tag, self._taken[(p, tag)]) for p in peers)
            return came or time.monotonic() > deadline or all(self.exited(p) for p in peers)

        def read() -> int:
            try:
                return self._read_any(tensor, tag, deadline)
            finally:
                with self._claim:
                    self._any[tag] -= 1

        return read, ready

    def ready(self, src: int, tag: int, seq: int) -> bool:
        return bool(self._store.check([self._key(src, self._me, tag, seq)]))

    def _read_any(self, tensor: torch.Tensor, tag: int, deadline: float) -> int:
        peers = [r for r in range(self._n) if r != self._me]
        claimed: list[tuple[int, int]] = []

        def claim() -> bool:
            for src in peers:
                with self._claim:
                    seq = self._taken[(src, tag)]
                    if self.ready(src, tag, seq):
                        self._taken[(src, tag)] = seq + 1
                        claimed.append((src, seq))
                        return True
            return False

        if not poll_until(lambda: claim() or all(self.exited(p) for p in peers), deadline) or not claimed:
            raise PeerError(
                f"{self.where('recv from any source', None, tag)}: no message from group ranks {peers} "
                f"within {self._timeout:g} s (the group's timeout, or COLLSCHED_TIMEOUT_SECS), or their "
                "processes exited; a peer died, or sends with another tag or to another rank"
            )
        src, seq = claimed[0]
        self._read(self._key(src, self._me, tag, seq), tensor, "recv from any source", src, tag, deadline)
        return src

    def exited(self, peer: int) -> bool:
        """Whether group rank ``peer``'s process has exited (never blocks; False while unknown:
        a peer that has not made this group yet, a process this one cannot watch)."""
        with self._claim:  # (the futures' thread asks too)
            if peer not in self._pidfds:
                key = f"{_PREFIX}/pid/{peer}"
                if not self._store.check([key]):
                    return False
                try:
                    self._pidfds[peer] = os.pidfd_open(int(self._store.get(key)))
                except ProcessLookupError:
                    return True
                except (OSError, ValueError):
                    self._pidfds[peer] = None
            fd = self._pidfds[peer]
        if fd is None:
            return False
        # A pidfd turns readable when its process exits (a zombie too); poll takes any fd number.
        watch = select.poll()
        watch.register(fd, select.POLLIN)
        return bool(watch.poll(0))

    def _announced(self, key: str, src: int, where: str, deadline: float) -> str:
        """The announcement at ``key`` once it is there; a :class:`PeerError` when ``src``'s
        process exited first or at the deadline."""

        def came() -> bool:
            try:
                if self._store.check([key]):
                    return True
            except Exception as e:
                raise PeerError(f"{where}: the group's store is gone ({type(e).__name__}: {e})") from None
            if self.exited(src) and not self._store.check([key]):
                raise PeerError(f"{where}: group rank {src}'s process exited before it sent this message")
            return False

        if not poll_until(came, deadline):
            raise PeerError(
                f"{where}: nothing came within {self._timeout:g} s (the group's timeout, or "
                f"COLLSCHED_TIMEOUT_SECS); group rank {src} sends with another tag or to another rank, or not yet"
            )
        return self._store.get(key).decode()

    def _read(self, key: str, tensor: torch.Tensor, op: str, src: int, tag: int, deadline: float) -> None:
        where = self.where(op, src, tag)
        pid, fd, nbytes = (int(x) for x in self._announced(key, src, where, deadline).split())
        expected = tensor.numel() * tensor.element_size()
        try:
            if nbytes != expected:
                raise CollschedError(
                    f"{where}: {nbytes} bytes were sent, the receiving tensor {tuple(tensor.shape)} {tensor.dtype} "
                    f"holds {expected}; give a tensor of the sent size and dtype"
                )
            out = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
            try:
                file = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise PeerError(f"{where}: the sender's message is gone ({e}); group rank {src} died") from None
            try:
                view = _bytes_of(out) if nbytes else memoryview(b"")
                done = 0
                while done < nbytes:
                    got = os.preadv(file, [view[done:]], done)
                    if got <= 0:
                        raise PeerError(f"{where}: the message ended after {done} of {nbytes} bytes")
                    done += got
            finally:
                os.close(file)
            if out is not tensor:
                tensor.copy_(out)
        finally:
            # Acknowledged even when refused: the sender may close its file.
            self._store.set(f"{key}/ack", b"1")


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Polls ``done`` (which may raise) until it says True (True) or ``time.monotonic()``
    passes ``deadline`` (False, after one last poll): back to back at first, then sleeping
    from 0.2 ms up to 10 ms between polls."""
    pause = 0.0002
    while not done():
        if time.monotonic() > deadline:
            return done()
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True


def _close_all(pidfds: dict[int, int | None]) -> None:
    """Closes a mailbox's pidfds (when it is collected)."""
    for fd in pidfds.values():
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    pidfds.clear()


def _flush_at_exit(ref: weakref.ref) -> None:
    box = ref()
    if box is not None and box._held:
        box.flush()
