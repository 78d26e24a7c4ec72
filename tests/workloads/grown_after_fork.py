"""A forked tree whose processes go on filling a mapping they shared at the fork: one private
mapping of argv[1] MiB, of which the parent fills the first half with random bytes before it
forks argv[2] - 1 children (default: one); then each child fills the rest with its own random
bytes, which the parent leaves untouched. So a child's mapping holds pages it shares
copy-on-write with its parent next to pages that are its alone, in the same mapping. Each process prints `ready <pid>` and,
on SIGUSR2, `checksum <pid> <sha256 of its mapping>`; the parent passes SIGUSR2 on."""
import hashlib
import mmap
import os
import signal
import sys
import time

size = int(sys.argv[1]) << 20
processes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
half = size // 2
buf[:half] = os.urandom(half)
children = []
for _ in range(processes - 1):
    child = os.fork()
    if child == 0:
        children = []
        buf[half:] = os.urandom(size - half)
        break
    children.append(child)
pending = []
signal.signal(signal.SIGUSR2, lambda *_: pending.append(1))
# One write per line: the processes share their output.
os.write(1, f"ready {os.getpid()}\n".encode())
while True:
    while pending:
        pending.pop()
        for child in children:
            os.kill(child, signal.SIGUSR2)
        os.write(1, f"checksum {os.getpid()} {hashlib.sha256(buf).hexdigest()}\n".encode())
    time.sleep(0.02)
