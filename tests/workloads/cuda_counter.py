"""A CUDA job in miniature, for the fake driver (tests/fake-cuda): it makes a context on GPU 0
and counts on stdout, one number every 100 ms, waiting for its GPU before each (the fake's
cuCtxSynchronize waits while the process is locked or checkpointed, as GPU calls would). Its
count is in its memory alone. Argument: the driver library's path."""

import ctypes
import sys
import time

cuda = ctypes.CDLL(sys.argv[1])
if cuda.cuInit(0) != 0:
    sys.exit("cuInit failed")
context = ctypes.c_void_p()
rc = cuda.cuCtxCreate_v2(ctypes.byref(context), 0, 0)
if rc != 0:
    sys.exit(f"cuCtxCreate_v2 failed: {rc}")
n = 0
while True:
    rc = cuda.cuCtxSynchronize()
    if rc != 0:
        sys.exit(f"cuCtxSynchronize failed: {rc}")
    n += 1
    print(n, flush=True)
    time.sleep(0.1)
