"""A two-process tree talking over pipes.

The parent starts a child (this script with --child) connected by its stdin and stdout; the
child echoes each line back upper-cased. Every 50 ms the parent sends `ping N`, reads the reply
and prints `roundtrip N <reply>` (so `roundtrip N PING N` when all is well). The parent
prints `child <pid>` first.
"""
import subprocess
import sys
import time


def child():
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        sys.stdout.write(line.upper())
        sys.stdout.flush()


def parent():
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    print(f"child {proc.pid}", flush=True)
    n = 0
    while True:
        n += 1
        proc.stdin.write(f"ping {n}\n")
        proc.stdin.flush()
        reply = proc.stdout.readline()
        if not reply:
            sys.exit(f"child closed its stdout after ping {n}")
        print(f"roundtrip {n} {reply.strip()}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else parent()
