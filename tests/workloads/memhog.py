"""Holds 64 MiB (or argv[1] MiB) of random memory, then argv[2] MiB (default none) of zeros it wrote (a
buffer it cleared: resident, every page its own). SIGUSR1 rewrites 1/16 of the random part (prints
`dirtied`), SIGUSR2 prints `checksum <sha256 of both>`; otherwise it only sleeps, so its memory is still."""
import hashlib
import os
import signal
import sys
import time

SIZE = (int(sys.argv[1]) if len(sys.argv) > 1 else 64) << 20
ZEROS = (int(sys.argv[2]) if len(sys.argv) > 2 else 0) << 20
buf = bytearray(os.urandom(SIZE))
cleared = bytearray(ZEROS)
cleared[:] = bytes(ZEROS)
pending = []
signal.signal(signal.SIGUSR1, lambda *_: pending.append("dirty"))
signal.signal(signal.SIGUSR2, lambda *_: pending.append("sum"))
print("ready", flush=True)
while True:
    while pending:
        what = pending.pop(0)
        if what == "dirty":
            start = SIZE // 3
            buf[start:start + SIZE // 16] = os.urandom(SIZE // 16)
            print("dirtied", flush=True)
        else:
            digest = hashlib.sha256(buf)
            digest.update(cleared)
            print("checksum", digest.hexdigest(), flush=True)
    time.sleep(0.02)
