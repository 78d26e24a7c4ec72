"""Holds an open-file-description lock (F_OFD_SETLK, which /proc/locks shows with pid -1) on
argv[1] and counts like counter.py: prints `locked`, then `count N` every 50 ms."""
import fcntl
import os
import struct
import sys
import time

fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
# struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks); the whole file.
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
print("locked", flush=True)
n = 0
while True:
    n += 1
    print(f"count {n}", flush=True)
    time.sleep(0.05)
