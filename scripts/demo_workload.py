"""A stand-in for a long job: it counts, keeps a running sum in memory, and prints both. Like a
training job with a metrics endpoint, it also answers HTTP on 127.0.0.1:PORT (its first
argument) with its current step."""
import http.server
import sys
import threading
import time

count, total = 0, 0


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"step {count} running sum {total}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Metrics)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    count += 1
    total += count
    print(f"step {count:5d}  running sum {total}", flush=True)
    time.sleep(0.2)
