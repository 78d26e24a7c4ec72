"""A pre-fork tree: the parent holds argv[1] MiB of random bytes and forks argv[2] children
that only read them, so every page of the buffer is shared copy-on-write by the whole tree.
Each process prints `ready <pid>` and, on SIGUSR2, `checksum <pid> <sha256 of the buffer>`;
the parent passes SIGUSR2 on to its children."""
import hashlib
import os
import signal
import sys
import time

# Immutable: nothing writes the buffer's pages after the fork (the object's header, with its
# reference count, is on the first page only).
data = os.urandom(int(sys.argv[1]) << 20)
children = []
for _ in range(int(sys.argv[2])):
    child = os.fork()
    if child == 0:
        children = []
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
        os.write(1, f"checksum {os.getpid()} {hashlib.sha256(data).hexdigest()}\n".encode())
    time.sleep(0.05)
