"""A stand-in for a long job: it counts, keeps a running sum in memory, and prints both."""
import time

count, total = 0, 0
while True:
    count += 1
    total += count
    print(f"step {count:5d}  running sum {total}", flush=True)
    time.sleep(0.2)
