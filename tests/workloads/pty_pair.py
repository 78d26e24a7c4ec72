"""Holds both sides of a pseudo-terminal, as tmux, screen or expect do: a child runs on the
slave as its controlling terminal and echoes each line it reads; the parent, on the master,
sends `N` and waits for `echo N`, printing `pty N` (N = 1, 2, ...) every 50 ms."""
import os
import pty
import sys
import time

pid, master = pty.fork()
if pid == 0:
    os.system("stty -echo")
    for line in sys.stdin:
        print(f"echo {line.strip()}", flush=True)
    sys.exit(0)

pending = b""
n = 0
while True:
    n += 1
    os.write(master, f"{n}\n".encode())
    want = f"echo {n}".encode()
    while want not in pending:
        pending += os.read(master, 4096)
    pending = pending.split(want, 1)[1]
    print(f"pty {n}", flush=True)
    time.sleep(0.05)
