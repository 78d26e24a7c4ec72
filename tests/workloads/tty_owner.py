"""A session leader whose controlling terminal is a pseudo-terminal it holds both sides of, with
/dev/tty open, and a child that inherited all three (a terminal program and its job): each
prints `tty <who> N` (N = 1, 2, ...) every 50 ms, and the parent also writes N through the
master and reads it back from the slave."""
import fcntl
import os
import termios
import time

try:
    os.setsid()
except PermissionError:
    pass  # a session leader already
master, slave = os.openpty()
fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
tty = os.open("/dev/tty", os.O_RDWR)
who = "child" if os.fork() == 0 else "parent"
n = 0
while True:
    n += 1
    if who == "parent":
        os.write(master, f"{n}\n".encode())
        os.read(slave, 64)
    print(f"tty {who} {n}", flush=True)
    time.sleep(0.05)
