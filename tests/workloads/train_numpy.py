"""A training loop whose whole state is in its memory: least-squares regression by minibatch
SGD with numpy, seeded. Prints `step N loss L` (L exactly, as repr) each step, sleeping
`--pause` seconds between steps; with --steps it stops after that many. An uninterrupted run
and a run checkpointed and restored anywhere in between print the same lines."""
import argparse
import sys
import time

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=0)
parser.add_argument("--pause", type=float, default=0.05)
args = parser.parse_args()

rng = np.random.default_rng(20261123)
features, samples, batch = 64, 4096, 128
true_w = rng.normal(size=features)
x = rng.normal(size=(samples, features))
y = x @ true_w + 0.1 * rng.normal(size=samples)
w = np.zeros(features)
velocity = np.zeros(features)
step = 0
while args.steps == 0 or step < args.steps:
    step += 1
    idx = rng.integers(0, samples, size=batch)
    err = x[idx] @ w - y[idx]
    velocity = 0.9 * velocity + (x[idx].T @ err) / batch
    w -= 0.01 * velocity
    loss = float(np.mean(err * err))
    print(f"step {step} loss {loss!r}", flush=True)
    if args.pause:
        time.sleep(args.pause)
sys.exit(0)
