"""Holds 16 MiB of random memory with argv[1] (a marker string) written into every 4 KiB page,
so a store that kept it in the clear would show the marker in its files. Prints `tick N SUM`
every 100 ms (SUM: a digest of that memory, so a restored process shows it came back whole);
the first line is `ready`."""
import hashlib
import os
import sys
import time

marker = sys.argv[1].encode()
buf = bytearray(os.urandom(16 << 20))
for at in range(0, len(buf), 4096):
    buf[at:at + len(marker)] = marker
digest = hashlib.sha256(buf).hexdigest()[:16]
print("ready", flush=True)
n = 0
while True:
    n += 1
    print(f"tick {n} {hashlib.sha256(buf).hexdigest()[:16] if n % 10 == 0 else digest}", flush=True)
    time.sleep(0.1)
