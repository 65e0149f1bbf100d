#!/usr/bin/env python3
"""A network link with a fixed one-way delay, for kernels without `tc netem`.

Makes two TAP devices and relays every Ethernet frame that leaves one out of the other after
DELAY_MS milliseconds (frames keep their order; nothing is dropped or rate-limited). Move each
device into a network namespace of its own and give them addresses of one subnet: the two
namespaces then talk over a link with that delay each way. Writes READY_FILE once both
devices exist, then relays until it is killed (or, for safety, for at most MAX_SECONDS).

    delaylink.py TAP0 TAP1 DELAY_MS READY_FILE [MAX_SECONDS]

Used by ci/multihost.sh. Needs root (/dev/net/tun).
"""

import fcntl
import heapq
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main() -> int:
    if len(sys.argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    name0, name1, delay_ms, ready = sys.argv[1:5]
    limit = float(sys.argv[5]) if len(sys.argv) == 6 else 3600.0
    delay = float(delay_ms) / 1e3
    fd0, fd1 = tap(name0), tap(name1)
    other = {fd0: fd1, fd1: fd0}
    with open(ready, "w") as f:
        f.write("ready\n")
    end = time.monotonic() + limit
    queue: list[tuple[float, int, int, bytes]] = []
    seq = 0
    while time.monotonic() < end:
        now = time.monotonic()
        wait = max(0.0, queue[0][0] - now) if queue else 0.5
        readable, _, _ = select.select([fd0, fd1], [], [], wait)
        now = time.monotonic()
        for fd in readable:
            try:
                frame = os.read(fd, 65536)
            except OSError:
                continue  # the device is down for a moment (moved, reconfigured)
            heapq.heappush(queue, (now + delay, seq, other[fd], frame))
            seq += 1
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                os.write(out, frame)
            except OSError:
                pass  # the other side is not up yet: the frame is lost, as on a cable
    return 0


if __name__ == "__main__":
    sys.exit(main())
