"""Reads a file line by line through a buffered file object and copies what it reads.

Usage: reader.py DATAFILE OUTFILE. Every 50 ms reads one line of DATAFILE (lines
`line 00001`, `line 00002`, ...), prints `read <line> at <offset after the line>`, and appends
the line to OUTFILE (opened once, in append mode).
"""
import sys
import time

data = open(sys.argv[1], "rb")
out = open(sys.argv[2], "a")
while True:
    raw = data.readline()
    if not raw:
        print("eof", flush=True)
        break
    line = raw.decode().rstrip("\n")
    print(f"read {line} at {data.tell()}", flush=True)
    out.write(line + "\n")
    out.flush()
    time.sleep(0.05)
time.sleep(3600)
