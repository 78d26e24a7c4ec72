"""Holds argv[1] MiB (default 256) of random memory in a bytearray, and on each SIGUSR1 does
what a Python job does between two checkpoints: rewrites a tenth of that memory in place in
1 MiB blocks, allocates new objects (small ones and large ones, of page counts that are no
multiple of anything) and frees older ones, so that the heap and the anonymous mappings around
the buffer shift. It then prints `dirtied W`: the 64 KiB-aligned address windows it wrote to
(new objects, and freed ones, whose first bytes the allocator overwrites, included). Random
bytes are read straight into place, so no temporary object writes memory it does not count.
SIGUSR2 prints `checksum <sha256 of the buffer>`.
"""
import ctypes
import hashlib
import random
import signal
import sys
import time

WINDOW = 64 << 10
urandom = open("/dev/urandom", "rb", buffering=0)
rng = random.Random(7)


def fill(view):
    done = 0
    while done < len(view):
        done += urandom.readinto(view[done:])


def new_object(size):
    b = bytearray(size)
    fill(memoryview(b))
    return b


def address(b):
    return ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))


def windows(addr, length):
    return set(range(addr // WINDOW, (addr + length - 1) // WINDOW + 1))


SIZE = (int(sys.argv[1]) if len(sys.argv) > 1 else 256) << 20
buf = new_object(SIZE)
extras = [new_object(rng.randint(256, 2048) * 4096 + rng.randint(1, 4095)) for _ in range(3)]
small = [new_object(rng.randint(1, 60) << 10) for _ in range(50)]


def dirty():
    written = set()
    base = address(buf)
    block = 1 << 20
    view = memoryview(buf)
    for i in range(SIZE // block // 10):
        at = i * 10 * block
        fill(view[at:at + block])
        written |= windows(base + at, block)
    view.release()
    gone = [extras.pop(0)] + small[: len(small) // 2]
    del small[: len(small) // 2]
    for b in gone:
        written |= windows(address(b), 1)
    del gone, b
    new = new_object(rng.randint(256, 2048) * 4096 + rng.randint(1, 4095))
    extras.append(new)
    written |= windows(address(new), len(new))
    for _ in range(25):
        b = new_object(rng.randint(1, 60) << 10)
        small.append(b)
        written |= windows(address(b), len(b))
    return len(written)


pending = []
signal.signal(signal.SIGUSR1, lambda *_: pending.append("dirty"))
signal.signal(signal.SIGUSR2, lambda *_: pending.append("sum"))
print("ready", flush=True)
while True:
    while pending:
        if pending.pop(0) == "dirty":
            print("dirtied", dirty(), flush=True)
        else:
            print("checksum", hashlib.sha256(buf).hexdigest(), flush=True)
    time.sleep(0.02)
