"""Holds memory from memfd_secret (which no other process can read, CRIU included) and counts
like counter.py; prints `memfd_secret failed: errno N` instead when the kernel refuses it."""
import ctypes
import mmap
import os
import time

SYS_MEMFD_SECRET = 447  # x86_64 and aarch64

libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(SYS_MEMFD_SECRET, 0)
if fd < 0:
    raise SystemExit(f"memfd_secret failed: errno {ctypes.get_errno()}")
os.ftruncate(fd, 1 << 16)
secret = mmap.mmap(fd, 1 << 16)
secret[:6] = b"hidden"
n = 0
while True:
    n += 1
    print(f"count {n}", flush=True)
    time.sleep(0.05)
