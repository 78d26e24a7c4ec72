"""A workload holding one socket of every kind stasis must checkpoint, checking each every tick.

Options (any combination):
  --inner        start a child (this script with --child) and talk to it every tick over a
                 loopback TCP connection (to a dual-stack listener, so one end is
                 IPv4-mapped IPv6), a Unix stream connection to a listening Unix socket,
                 a socketpair and UDP; print `tick N ok` when all four answered `N`.
  --http PORT    serve HTTP on 127.0.0.1:PORT from a thread; GET / answers `tick N`.
  --peer PORT    connect to 127.0.0.1:PORT (outside the tree) and send `N` every tick, reading
                 the peer's echo: print `echo N`. When the connection fails, print
                 `peer lost <why>` once and go on without it.
  --vsock        also hold an AF_VSOCK socket (a kind CRIU cannot checkpoint).
  --hold-mib N   keep N MiB of random heap (default 8); `tick N ok SUM` lines carry its
                 checksum, computed afresh every tick, so a restored process shows its memory
                 came back whole.

Ticks come every 50 ms and are numbered without gaps, so a test sees where a restored process
carries on. The first lines are `child PID` (with --inner) and `ready`.
"""
import argparse
import hashlib
import http.server
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time

TICK = 0.05
state = {"tick": 0}


def child(tcp_port, unix_path, pair_fd, udp_port):
    """Echoes every message on each of its four sockets."""
    sel = selectors.DefaultSelector()
    tcp = socket.create_connection(("127.0.0.1", tcp_port))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.connect(unix_path)
    pair = socket.socket(fileno=pair_fd)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", udp_port))
    for s in (tcp, unix, pair, udp):
        sel.register(s, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is udp:
                data, addr = s.recvfrom(64)
                s.sendto(data, addr)
                continue
            data = s.recv(64)
            if not data:
                return
            s.sendall(data)


class Inner:
    """The parent's ends of the four channels to the child."""

    def __init__(self):
        # Dual-stack: the loopback connection from the child arrives as IPv4-mapped IPv6.
        listener = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        tmp = tempfile.mkdtemp(prefix="stasis-net-")
        unix_path = os.path.join(tmp, "echo.sock")
        unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix_listener.bind(unix_path)
        unix_listener.listen()
        self.pair, theirs = socket.socketpair()
        udp_port = free_udp_port()
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--child", str(listener.getsockname()[1]), unix_path,
             str(theirs.fileno()), str(udp_port)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        print(f"child {self.child.pid}", flush=True)
        self.tcp, _ = listener.accept()
        self.unix, _ = unix_listener.accept()
        # The listeners stay open: they are part of what gets checkpointed.
        self.listeners = (listener, unix_listener)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.connect(("127.0.0.1", udp_port))

    def round_trip(self, n):
        msg = f"{n:08d}".encode()
        for s in (self.tcp, self.unix, self.pair):
            s.sendall(msg)
            got = recv_exact(s, len(msg))
            if got != msg:
                return f"{s.family.name}/{s.type.name} answered {got!r} to {msg!r}"
        for _ in range(20):
            self.udp.send(msg)
            self.udp.settimeout(0.5)
            try:
                if self.udp.recv(64) == msg:
                    return None
            except TimeoutError:
                continue
        return "udp: no answer"


def free_udp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_exact(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"tick {state['tick']}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inner", action="store_true")
    p.add_argument("--http", type=int)
    p.add_argument("--peer", type=int)
    p.add_argument("--vsock", action="store_true")
    p.add_argument("--hold-mib", type=int, default=8)
    args = p.parse_args()

    held = bytearray(os.urandom(args.hold_mib << 20))
    inner = Inner() if args.inner else None
    if args.http:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.http), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    peer = None
    if args.peer:
        peer = socket.create_connection(("127.0.0.1", args.peer)).makefile("rwb")
    if args.vsock:
        vsock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)  # noqa: F841 (held open)
    print("ready", flush=True)

    n = 0
    while True:
        n += 1
        state["tick"] = n
        if inner:
            failure = inner.round_trip(n)
            if failure:
                sys.exit(f"tick {n} failed: {failure}")
        print(f"tick {n} ok {hashlib.sha256(held).hexdigest()[:16]}", flush=True)
        if peer:
            try:
                peer.write(f"{n}\n".encode())
                peer.flush()
                reply = peer.readline()
                if not reply:
                    raise ConnectionError("end of stream")
                print(f"echo {reply.decode().strip()}", flush=True)
            except OSError as e:
                print(f"peer lost {e!r}", flush=True)
                peer = None
        time.sleep(TICK)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
