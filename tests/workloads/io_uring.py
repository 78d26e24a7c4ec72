"""Holds an io_uring instance and counts like counter.py.

CRIU 4.1 cannot dump io_uring: its parasite fails to send the io_uring file descriptor
("send_fds failed", "Can't retrieve FDs from socket", "Dumping FAILED") after the tree has
been frozen and infected, so a checkpoint of this process fails in the middle of CRIU's dump.
Prints `io_uring fd <fd>`, then `count N` every 50 ms.
"""
import ctypes
import time

SYS_IO_URING_SETUP = 425  # x86_64 and aarch64

libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
fd = libc.syscall(SYS_IO_URING_SETUP, 8, ctypes.byref(params))
if fd < 0:
    raise SystemExit(f"io_uring_setup failed: errno {ctypes.get_errno()}")
print(f"io_uring fd {fd}", flush=True)

n = 0
while True:
    n += 1
    print(f"count {n}", flush=True)
    time.sleep(0.05)
