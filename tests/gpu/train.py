#!/usr/bin/env python3
"""A small deterministic PyTorch training loop, the GPU workload of stasis's tests.

An MLP learns a fixed random "teacher" network from synthetic data, all generated on the GPU
from fixed seeds. Every step prints `step N loss=<8 decimals>` (flushed) and sleeps
`--sleep` seconds. With deterministic algorithms and a fixed cuBLAS workspace, two runs print
the same loss sequence, so a run that is checkpointed and restored part-way must print the
same sequence as an uninterrupted one.

Usage: train.py [--steps N] [--sleep SECONDS] [--batch N] [--width N]
"""

import argparse
import os
import sys
import time

# Must be set before CUDA initialises: makes cuBLAS reductions deterministic.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100000, help="steps to run (default 100000)")
    p.add_argument("--sleep", type=float, default=0.05, help="seconds to sleep per step (default 0.05)")
    p.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--width", type=int, default=512, help="hidden width (default 512)")
    p.add_argument("--samples", type=int, default=16384, help="size of the synthetic data set")
    return p.parse_args()


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("train.py: no CUDA device", file=sys.stderr)
        return 1

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    dev = torch.device("cuda")
    data_gen = torch.Generator(device=dev)
    data_gen.manual_seed(1234)
    n_in, n_out = 64, 8

    # Synthetic data set: inputs and the outputs of a fixed random teacher network.
    x_all = torch.randn(args.samples, n_in, device=dev, generator=data_gen)
    teacher = [
        torch.randn(n_in, 128, device=dev, generator=data_gen) / n_in**0.5,
        torch.randn(128, n_out, device=dev, generator=data_gen) / 128**0.5,
    ]
    y_all = torch.tanh(x_all @ teacher[0]) @ teacher[1]

    model = torch.nn.Sequential(
        torch.nn.Linear(n_in, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, n_out),
    ).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()

    batch_gen = torch.Generator(device=dev)
    batch_gen.manual_seed(99)
    say(f"train ready pid={os.getpid()} device={torch.cuda.get_device_name(dev)}")
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, args.samples, (args.batch,), device=dev, generator=batch_gen)
        xb, yb = x_all[idx], y_all[idx]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        say(f"step {step} loss={loss.item():.8f}")
        if args.sleep > 0:
            time.sleep(args.sleep)
    say("train done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
