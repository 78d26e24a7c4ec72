"""An HTTP server that is idle between requests: GET / answers `hits N sum S`, N counting the
requests it served, S a checksum of the random heap it holds (computed afresh each time, so a
restored server shows its memory came back whole).

Usage: http_counter.py PORT [HOLD_MIB]   (default 16 MiB). Prints `ready` once it listens.
"""
import hashlib
import http.server
import os
import sys

PORT = int(sys.argv[1])
HOLD = bytearray(os.urandom(int(sys.argv[2]) << 20 if len(sys.argv) > 2 else 16 << 20))
hits = 0


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits
        hits += 1
        body = f"hits {hits} sum {hashlib.sha256(HOLD).hexdigest()[:16]}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.HTTPServer(("127.0.0.1", PORT), Handler)
print("ready", flush=True)
server.serve_forever()
