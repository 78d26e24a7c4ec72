"""Memory for measuring dirty-page tracking (kernel-matrix case `track-cost`).

Holds argv[1] MiB (default 512) in one anonymous mapping: the first half random bytes, the
second half compressible text, each 4 KiB page numbered (no two pages alike). Prints `ready
MIB`. Each SIGUSR1 rewrites 10% of the memory with random bytes, in 2 MiB runs at random
2 MiB-aligned addresses, and prints `rewrote N` (N counts the rewrites). The runs are huge pages:
Debian's kernels back anonymous memory with transparent huge pages, whose soft-dirty bit
covers 2 MiB, so scattered smaller writes would leave little memory clean (10% in 64 KiB runs
left 54 MiB of 512 unchanged on 6.1). argv[2] seeds the generator (default 1), so that two
runs hold different memory."""
import ctypes
import mmap
import random
import signal
import sys
import time

PAGE = 4096
MIB = 1 << 20
RUN = 2 * MIB

size = (int(sys.argv[1]) if len(sys.argv) > 1 else 512) * MIB
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
half = size // 2
for at in range(0, half, 16 * MIB):
    n = min(16 * MIB, half - at)
    mem[at:at + n] = rng.randbytes(n)
text = b"".join(b"compressible line %04d of a page: the same words each time\n" % i for i in range(64))
template = (text * 2)[:PAGE - 8]
for at in range(half, size, 16 * MIB):
    n = min(16 * MIB, size - at)
    mem[at:at + n] = b"".join((p).to_bytes(8, "little") + template for p in range(at // PAGE, (at + n) // PAGE))

# The runs: every whole huge page of the mapping.
first = -ctypes.addressof(ctypes.c_char.from_buffer(mem)) % RUN
runs = (size - first) // RUN
pending = []
signal.signal(signal.SIGUSR1, lambda *_: pending.append(1))
print(f"ready {size // MIB}", flush=True)
rewrites = 0
while True:
    while pending:
        pending.pop()
        for run in rng.sample(range(runs), runs // 10):
            at = first + run * RUN
            mem[at:at + RUN] = rng.randbytes(RUN)
        rewrites += 1
        print(f"rewrote {rewrites}", flush=True)
    time.sleep(0.1)
