"""A process whose memory moves while it arrives: it holds `big` (argv[1] MiB, random) and
`grow` (argv[2] MiB, random), prints `ready`, then:

SIGUSR2 prints `sums <sha256 of big> <sha256 of grow>`.
SIGUSR1 forks a child that prints `child <sha256 of big>` and exits; then the parent makes
`grow` larger (glibc moves a large buffer with mremap), frees a buffer of its own (munmap), and
prints `parent <sha256 of big> <sha256 of grow's first argv[2] MiB>`.

Restored lazily, each of these touches memory that may not have arrived yet: the child's
copy, memory mremap moved elsewhere, memory given back.
"""
import hashlib
import os
import signal
import sys
import time

BIG = int(sys.argv[1]) << 20
GROW = int(sys.argv[2]) << 20
big = bytearray(os.urandom(BIG))
grow = bytearray(os.urandom(GROW))
spare = bytearray(os.urandom(8 << 20))
pending = []
signal.signal(signal.SIGUSR1, lambda *_: pending.append("fork"))
signal.signal(signal.SIGUSR2, lambda *_: pending.append("sums"))


def sha(data):
    return hashlib.sha256(data).hexdigest()


print("ready", flush=True)
while True:
    while pending:
        if pending.pop(0) == "sums":
            print("sums", sha(big), sha(grow), flush=True)
            continue
        child = os.fork()
        if child == 0:
            print("child", sha(big), flush=True)
            os._exit(0)
        grow.extend(b"x" * (GROW // 2))
        del spare
        spare = bytearray(1)
        print("parent", sha(big), sha(memoryview(grow)[:GROW]), flush=True)
        os.waitpid(child, 0)
    time.sleep(0.02)
