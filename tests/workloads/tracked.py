"""Memory that changes between checkpoints, for dirty-page tracking (kernel-matrix case `tracked`).

Holds three anonymous private mappings of 8 MiB (mmap through libc, so that they can be
mremapped), filled from a seeded generator: the first two madvised MADV_NOHUGEPAGE, so that the
kernel tracks their writes page by page, the third left to transparent huge pages where the
kernel uses them (Debian's do, always), whose soft-dirty bit covers 2 MiB; and prints `ready sum S`, then `tick N` every 0.2 s.
S is a BLAKE2b checksum over every mapping it holds (address order of creation, with each
mapping's size) and, once it has a child, the child's checksum of its own memory, asked over a
pipe. Each SIGUSR1 runs the next step, then prints `phase N sum S`:

  1. rewrites about 10% of the pages of every mapping, at random offsets;
  2. forks a child that maps 4 MiB of its own, fills it, and rewrites some pages of a mapping
     it inherited (copy-on-write: those pages become its own); the child answers `sum` and
     `write` requests on a pipe and exits when the pipe closes;
  3. mremaps the first mapping to 12 MiB at an address reserved for it (MREMAP_FIXED: it
     moves), fills the new 4 MiB, munmaps the second mapping and punches a 1 MiB hole into the
     third (splitting it in two); the child rewrites some of its pages;
  4. rewrites about 5% of the pages again, in the parent and in the child.

Further SIGUSR1s repeat step 4. SIGUSR2 prints `verify sum S` without changing anything.
Only the Python standard library is used (ctypes for mmap, mremap and munmap)."""
import ctypes
import hashlib
import os
import random
import signal
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
PROT_NONE, PROT_RW = 0, 3
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
MADV_NOHUGEPAGE = 15
MAP_FAILED = ctypes.c_void_p(-1).value

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def check(result, what):
    if result is None or result == MAP_FAILED or result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def anon(size, prot=PROT_RW):
    return check(libc.mmap(None, size, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), f"mmap {size}")


def fill(rng, addr, size):
    ctypes.memmove(addr, rng.randbytes(size), size)


def rewrite(rng, maps, share):
    """Rewrites `share` of the pages of every mapping, each page at a random place."""
    for addr, size in maps:
        pages = size // PAGE
        for page in rng.sample(range(pages), max(1, int(pages * share))):
            ctypes.memmove(addr + page * PAGE, rng.randbytes(PAGE), PAGE)


def digest(maps):
    h = hashlib.blake2b(digest_size=16)
    for addr, size in maps:
        h.update(size.to_bytes(8, "little"))
        h.update((ctypes.c_char * size).from_address(addr))
    return h


def child_main(requests, answers, rng, inherited):
    """The forked child: its own 4 MiB and the (copy-on-write) mappings it inherited."""
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    own = (anon(4 * MIB), 4 * MIB)
    fill(rng, *own)
    rewrite(rng, inherited[:1], 0.05)
    maps = [own] + inherited
    with os.fdopen(requests, "r") as inp, os.fdopen(answers, "w") as out:
        for line in inp:
            if line.strip() == "write":
                rewrite(rng, maps, 0.05)
                out.write("ok\n")
            else:
                out.write(digest(maps).hexdigest() + "\n")
            out.flush()
    os._exit(0)


class Parent:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.maps = []
        for i in range(3):
            addr = anon(8 * MIB)
            if i < 2:
                check(libc.madvise(addr, 8 * MIB, MADV_NOHUGEPAGE), "madvise")
            fill(self.rng, addr, 8 * MIB)
            self.maps.append((addr, 8 * MIB))
        self.child = None  # (pid, request file, answer file)
        self.phase = 0

    def ask(self, request):
        _, req, ans = self.child
        req.write(request + "\n")
        req.flush()
        answer = ans.readline().strip()
        if not answer:
            raise RuntimeError(f"the child gave no answer to '{request}'")
        return answer

    def sum(self):
        h = digest(self.maps)
        if self.child:
            h.update(bytes.fromhex(self.ask("sum")))
        return h.hexdigest()

    def fork(self):
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        child_rng = random.Random(self.rng.getrandbits(64))
        pid = os.fork()
        if pid == 0:
            os.close(req_w)
            os.close(ans_r)
            try:
                child_main(req_r, ans_w, child_rng, list(self.maps))
            finally:
                os._exit(1)
        os.close(req_r)
        os.close(ans_w)
        self.child = (pid, os.fdopen(req_w, "w"), os.fdopen(ans_r, "r"))

    def move_and_unmap(self):
        addr, size = self.maps[0]
        bigger = size + 4 * MIB
        target = anon(bigger, PROT_NONE)  # a place of its own, replaced by the move
        moved = check(libc.mremap(addr, size, bigger, MREMAP_MAYMOVE | MREMAP_FIXED, target), "mremap")
        if moved == addr:
            raise RuntimeError("mremap did not move the mapping")
        fill(self.rng, moved + size, bigger - size)
        second, second_size = self.maps[1]
        check(libc.munmap(second, second_size), "munmap")
        third, third_size = self.maps[2]
        hole = third_size // 2
        check(libc.munmap(third + hole, MIB), "munmap (hole)")
        self.maps = [(moved, bigger), (third, hole), (third + hole + MIB, third_size - hole - MIB)]
        print(f"moved {addr:#x} -> {moved:#x} ({bigger // MIB} MiB), unmapped {second:#x}, hole at {third + hole:#x}",
              flush=True)

    def step(self):
        self.phase += 1
        if self.phase == 1:
            rewrite(self.rng, self.maps, 0.10)
        elif self.phase == 2:
            self.fork()
        elif self.phase == 3:
            self.move_and_unmap()
            self.ask("write")
        else:
            rewrite(self.rng, self.maps, 0.05)
            if self.child:
                self.ask("write")
        print(f"phase {self.phase} sum {self.sum()}", flush=True)


def main():
    parent = Parent(int(os.environ.get("TRACKED_SEED", "26")))
    pending = []
    signal.signal(signal.SIGUSR1, lambda *_: pending.append("step"))
    signal.signal(signal.SIGUSR2, lambda *_: pending.append("verify"))
    print(f"ready sum {parent.sum()}", flush=True)
    tick = 0
    while True:
        while pending:
            if pending.pop(0) == "step":
                parent.step()
            else:
                print(f"verify sum {parent.sum()}", flush=True)
        tick += 1
        print(f"tick {tick}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
