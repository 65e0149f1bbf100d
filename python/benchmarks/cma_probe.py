"""Cross-memory attach against a plain copy on this machine: one process reads another's
private memory with ``process_vm_readv`` (what a backend would do to read a peer's
``torch.empty`` tensor in place), and the same bytes are copied with ``memmove`` in one
process, in the same run.

    python python/benchmarks/cma_probe.py [--sizes 1M,8M,32M] [--bytes 256M]

Prints per size the time per read and its rate for both, and their ratio. Linux only; a
kernel or container that forbids the call (Yama ``ptrace_scope`` 2-3, a seccomp profile)
makes it print the error instead.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import time

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,8M,32M", help="bytes per read, comma separated")
    p.add_argument("--bytes", type=size, default=size("256M"), help="bytes read per size and method")
    args = p.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    print("# bytes   cma_us  cma_GB/s   memmove_us  memmove_GB/s   cma/memmove")
    for n in (size(s) for s in args.sizes.split(",")):
        src = ctypes.create_string_buffer(b"\x01" * n, n)
        dst = ctypes.create_string_buffer(n)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            # The peer: its own copy of `src` (written, so the pages are its own), then wait.
            ctypes.memset(src, 3, n)
            os.write(ready_w, b"x")
            time.sleep(3600)
            os._exit(0)
        try:
            os.read(ready_r, 1)
            reps = max(4, args.bytes // n)
            local, remote = Iovec(ctypes.addressof(dst), n), Iovec(ctypes.addressof(src), n)
            t0 = time.perf_counter()
            for _ in range(reps):
                got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                if got != n:
                    err = ctypes.get_errno()
                    print(f"{n}: process_vm_readv read {got} of {n} bytes: {os.strerror(err)}")
                    return
            cma = (time.perf_counter() - t0) / reps
            if dst.raw[:1] != b"\x03":
                print(f"{n}: process_vm_readv read the wrong bytes")
                return
            t0 = time.perf_counter()
            for _ in range(reps):
                ctypes.memmove(dst, src, n)
            copy = (time.perf_counter() - t0) / reps
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(ready_r)
            os.close(ready_w)
        rates = f"{n / cma / 1e9:9.2f} {copy * 1e6:12.1f} {n / copy / 1e9:13.2f}"
        print(f"{n:>9} {cma * 1e6:8.1f} {rates} {cma / copy:13.2f}x")


if __name__ == "__main__":
    main()
