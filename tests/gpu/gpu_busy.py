"""A CUDA job that keeps the GPU busy while its CPU sleeps, then goes quiet, then works again:
idle reclaim must see the GPU work (through NVML), not only CPU time.

Prints `ready SUM` (SUM: a checksum of a tensor it keeps on the GPU), then `burst N` for each
burst of matrix products it queued before sleeping while they run, `quiet` when it stops for
QUIET seconds, then `burst N` again, each later line with `SUM` checked afresh (`sum ok` or
`sum BAD`). Usage: gpu_busy.py [BUSY_SECS=12] [QUIET_SECS=40]
"""
import sys
import time

import torch

busy, quiet = (float(a) for a in (sys.argv[1:] + ["12", "40"])[:2])
dev = torch.device("cuda")
torch.manual_seed(7)
keep = torch.rand(64 << 20, device=dev)
expect = float(keep.sum().item())
a = torch.rand(8192, 8192, device=dev)
print(f"ready {expect:.3f}", flush=True)


def burst(n):
    # Queue about two seconds of GPU work, then sleep while it runs: the CPU stays idle.
    for _ in range(100):
        torch.mm(a, a, out=a.new_empty(a.shape))
    time.sleep(2.0)
    torch.cuda.synchronize()
    ok = abs(float(keep.sum().item()) - expect) < 1e-3 * abs(expect)
    print(f"burst {n} sum {'ok' if ok else 'BAD'}", flush=True)


n = 0
start = time.monotonic()
while time.monotonic() - start < busy:
    n += 1
    burst(n)
print("quiet", flush=True)
time.sleep(quiet)
while True:
    n += 1
    burst(n)
