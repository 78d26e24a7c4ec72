"""A PyTorch training loop fed by DataLoader worker processes (a multi-process GPU tree).

--start-method fork|spawn picks how workers start. Prints `step N loss=...` with fixed seeds.
"""
import argparse
import time

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset


class Synthetic(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(64, generator=g)
        return x, x.sum().unsqueeze(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--start-method", default="spawn")
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--sleep", type=float, default=0.05)
    a = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(Synthetic(), batch_size=32, num_workers=2, shuffle=False,
                        multiprocessing_context=mp.get_context(a.start_method), persistent_workers=True)
    for step, (x, y) in enumerate(loader, 1):
        loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss={loss.item():.8f}", flush=True)
        if step >= a.steps:
            break
        time.sleep(a.sleep)


if __name__ == "__main__":
    main()
