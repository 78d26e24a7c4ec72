"""Counts: prints `count N` (N = 1, 2, 3, ...) every 50 ms."""
import time

n = 0
while True:
    n += 1
    print(f"count {n}", flush=True)
    time.sleep(0.05)
