"""A forked tree with one memory layout: the parent holds argv[1] MiB of random memory and
forks argv[2] - 1 children (default: one); each child rewrites the first argv[3] MiB of its
copy (default 1; 0 leaves every page shared copy-on-write with the parent, as a pre-fork
server's workers do). With argv[4] = G (default 0), the same private mapping is G MiB longer
and only the children fill that part after the fork, with random bytes of their own: a
child's mapping then holds memory shared with its parent next to memory that is its alone.
With argv[5] = zeros, the parent writes zeros instead of random bytes (pages in memory that
hold nothing, as a zeroed buffer or a heap's cleared arena does).
Each process prints `ready <pid>` and, on SIGUSR2, `checksum <pid> <sha256 of its mapping>`;
the parent passes SIGUSR2 on to its children."""
import hashlib
import mmap
import os
import signal
import sys
import time

held = int(sys.argv[1]) << 20
processes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
rewrite = (int(sys.argv[3]) if len(sys.argv) > 3 else 1) << 20
grow = (int(sys.argv[4]) if len(sys.argv) > 4 else 0) << 20
zeros = len(sys.argv) > 5 and sys.argv[5] == "zeros"
buf = mmap.mmap(-1, held + grow, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf[:held] = bytes(held) if zeros else os.urandom(held)
children = []
for _ in range(processes - 1):
    child = os.fork()
    if child == 0:
        children = []
        if rewrite:
            buf[:rewrite] = os.urandom(rewrite)
        if grow:
            buf[held:] = os.urandom(grow)
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
