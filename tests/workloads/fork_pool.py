"""A multiprocessing fork pool over memory its parent built before forking: the parent fills
argv[1] MiB with random bytes, digests it (`built <sha256>`), then starts a pool of argv[2]
workers with the fork start method, which read that memory, shared copy-on-write, without
writing it. On SIGUSR1 every worker digests the whole of it, and the parent prints
`sums N <digest> ...` (one per worker, N counting the rounds)."""
import hashlib
import multiprocessing
import os
import signal
import sys
import time

DATA = os.urandom(int(sys.argv[1]) << 20)
print(f"built {hashlib.sha256(DATA).hexdigest()}", flush=True)


def digest(_):
    time.sleep(0.05)  # each task to its own worker
    return os.getpid(), hashlib.sha256(DATA).hexdigest()


if __name__ == "__main__":
    workers = int(sys.argv[2])
    pool = multiprocessing.get_context("fork").Pool(workers)
    asked = []
    signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
    print("ready", flush=True)
    rounds = 0
    while True:
        while asked:
            asked.pop()
            rounds += 1
            sums = pool.map(digest, range(workers), chunksize=1)
            print(f"sums {rounds} " + " ".join(d for _, d in sums), flush=True)
        time.sleep(0.05)
