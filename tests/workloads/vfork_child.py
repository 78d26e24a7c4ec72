"""A vfork()ed child that never calls exec: it sleeps in the parent's address space (pause),
holding the parent suspended in vfork, as a shell's or a spawn helper's child can for a while.
Prints `vforked` from the child first."""
import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
if libc.vfork() == 0:
    os.write(1, b"vforked\n")
    while True:
        libc.pause()
