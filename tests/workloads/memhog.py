"""Holds 64 MiB (or argv[1] MiB) of random memory, then argv[2] MiB (default none) of zeros it wrote (a
buffer it cleared: resident, every page its own), then argv[3] MiB (default none) of text (numbered
lines: compressible, no two chunks alike). SIGUSR1 rewrites 1/16 of the random part and of the text
(prints `dirtied`), SIGUSR2 prints `checksum <sha256 of all three>`; otherwise it only sleeps, so
its memory is still."""
import hashlib
import os
import signal
import sys
import time

SIZE = (int(sys.argv[1]) if len(sys.argv) > 1 else 64) << 20
ZEROS = (int(sys.argv[2]) if len(sys.argv) > 2 else 0) << 20
TEXT = (int(sys.argv[3]) if len(sys.argv) > 3 else 0) << 20
buf = bytearray(os.urandom(SIZE))
cleared = bytearray(ZEROS)
cleared[:] = bytes(ZEROS)


def lines(n, tag):
    """n bytes of numbered lines of a table, tagged so that each rewrite differs."""
    out = b"".join(b"%s row %09d: a read-mostly table of a long job\n" % (tag, i) for i in range(n // 40 + 1))
    return out[:n]


text = bytearray(lines(TEXT, b"first"))
rewrites = 0
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
            rewrites += 1
            text[TEXT // 3:TEXT // 3 + TEXT // 16] = lines(TEXT // 16, b"again%d" % rewrites)
            print("dirtied", flush=True)
        else:
            digest = hashlib.sha256(buf)
            digest.update(cleared)
            digest.update(text)
            print("checksum", digest.hexdigest(), flush=True)
    time.sleep(0.02)
