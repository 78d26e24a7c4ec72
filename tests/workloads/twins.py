"""Processes with the same memory layout: holds argv[1] MiB of random memory and forks
argv[2] - 1 children (default: one); each child rewrites the first MiB of its copy. Each prints
`ready <pid>` and, on SIGUSR2, `checksum <pid> <sha256 of its buffer>`; the parent passes
SIGUSR2 on to its children."""
import hashlib
import os
import signal
import sys
import time

buf = bytearray(os.urandom(int(sys.argv[1]) << 20))
children = []
for _ in range(int(sys.argv[2]) - 1 if len(sys.argv) > 2 else 1):
    child = os.fork()
    if child == 0:
        children = []
        buf[: 1 << 20] = os.urandom(1 << 20)
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
