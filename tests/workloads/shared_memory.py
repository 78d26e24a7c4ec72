"""A parent and a child sharing three 1 MiB shared mappings: an anonymous one written with
random bytes before the fork, an anonymous one never touched, and a shared mapping of /dev/zero
never touched (not even read: a read puts pages into the mapping). Each prints `ready <pid>`.
On SIGUSR2 each prints `sums <pid> <sha256 of the written mapping>`, the parent passing the
signal on to its child. On SIGUSR1 the parent prints `zeros <sha256 untouched> <sha256 zero>`
(the first read of those mappings), writes argv[1] (an ASCII marker) at the start of both,
prints `marked <sha256 untouched> <sha256 zero>` and signals the child, which prints
`seen <the same two checksums as it reads them>`: whether it still shares them."""
import hashlib
import mmap
import os
import signal
import sys
import time

SIZE = 1 << 20
written = mmap.mmap(-1, SIZE, flags=mmap.MAP_SHARED)
written[:] = os.urandom(SIZE)
untouched = mmap.mmap(-1, SIZE, flags=mmap.MAP_SHARED)
zero_fd = os.open("/dev/zero", os.O_RDWR)
zero = mmap.mmap(zero_fd, SIZE, flags=mmap.MAP_SHARED)
os.close(zero_fd)

child = os.fork()
pending = []
signal.signal(signal.SIGUSR2, lambda *_: pending.append("sums"))
signal.signal(signal.SIGUSR1, lambda *_: pending.append("mark"))
os.write(1, f"ready {os.getpid()}\n".encode())


def sha(m):
    return hashlib.sha256(m[:]).hexdigest()


while True:
    while pending:
        what = pending.pop(0)
        if what == "sums":
            if child:
                os.kill(child, signal.SIGUSR2)
            # One write per line: the processes share their output.
            os.write(1, f"sums {os.getpid()} {sha(written)}\n".encode())
        elif child:
            os.write(1, f"zeros {sha(untouched)} {sha(zero)}\n".encode())
            marker = sys.argv[1].encode()
            untouched[: len(marker)] = marker
            zero[: len(marker)] = marker
            os.write(1, f"marked {sha(untouched)} {sha(zero)}\n".encode())
            os.kill(child, signal.SIGUSR1)
        else:
            os.write(1, f"seen {sha(untouched)} {sha(zero)}\n".encode())
    time.sleep(0.02)
