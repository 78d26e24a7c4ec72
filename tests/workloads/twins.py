"""Two processes with the same memory layout: holds argv[1] MiB of random memory, forks, and the
child rewrites the first MiB of its copy. Each prints `ready <pid>` and, on SIGUSR2, `checksum
<pid> <sha256 of its buffer>`; the parent passes SIGUSR2 on to the child."""
import hashlib
import os
import signal
import sys
import time

buf = bytearray(os.urandom(int(sys.argv[1]) << 20))
child = os.fork()
if child == 0:
    buf[: 1 << 20] = os.urandom(1 << 20)
pending = []
signal.signal(signal.SIGUSR2, lambda *_: pending.append(1))
print("ready", os.getpid(), flush=True)
while True:
    while pending:
        pending.pop()
        if child:
            os.kill(child, signal.SIGUSR2)
        print("checksum", os.getpid(), hashlib.sha256(buf).hexdigest(), flush=True)
    time.sleep(0.02)
