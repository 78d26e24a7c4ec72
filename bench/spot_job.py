"""A stand-in for a training job on a spot VM, for bench/notice_to_durable.sh: holds MIB
(argv[1], default 1024) of random memory, and runs on three threads the way such a job does:
one rewrites 1 MiB blocks of that memory (RATE MiB/s, argv[2], default 4: a training step's
changed tensors), one churns the heap (allocates and frees objects of odd sizes), and one
serves its step counter over HTTP on a loopback port (a metrics endpoint). Prints `ready`
once the memory is filled and the server listens."""
import http.server
import os
import random
import sys
import threading
import time

MIB = 1 << 20
size = (int(sys.argv[1]) if len(sys.argv) > 1 else 1024) * MIB
rate = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
buf = bytearray(size)
urandom = open("/dev/urandom", "rb", buffering=0)
view = memoryview(buf)
done = 0
while done < size:
    done += urandom.readinto(view[done:done + 64 * MIB])
steps = 0


def train():
    global steps
    rng = random.Random(1)
    while True:
        start = time.monotonic()
        for _ in range(max(1, int(rate))):
            at = rng.randrange(size // MIB) * MIB
            urandom.readinto(view[at:at + MIB])
        steps += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - start)))


def churn():
    rng = random.Random(2)
    live = []
    while True:
        live.append(bytearray(rng.choice([72, 4096 * 3 + 40, 200_000, 1_100_000])))
        if len(live) > 64:
            del live[rng.randrange(len(live))]
        time.sleep(0.005)


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"steps {steps}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
for target in (train, churn, server.serve_forever):
    threading.Thread(target=target, daemon=True).start()
print("ready", server.server_address[1], flush=True)
while True:
    time.sleep(3600)
