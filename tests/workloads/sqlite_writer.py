"""A SQLite writer holding its database's write lock: inserts ROWS rows of 1 KiB into table t
of DB inside one transaction (BEGIN IMMEDIATE: other connections may read the committed state
but not write) and keeps it open; the rows are in its page cache only. Prints `holding N`.
On SIGUSR1 it commits (`committed N`), then begins the next transaction with 100 more rows
and holds it (`holding N`).

Row i's value is its number in 8 digits, 128 times. Usage: sqlite_writer.py DB ROWS
"""
import signal
import sqlite3
import sys

db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA cache_size = -262144")  # 256 MiB: the open transaction is never spilled
db.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT)")
rows = 0


def hold(more):
    global rows
    db.execute("BEGIN IMMEDIATE")
    db.executemany("INSERT INTO t VALUES (?, ?)", ((i, f"{i:08d}" * 128) for i in range(rows, rows + more)))
    rows += more
    print(f"holding {rows}", flush=True)


def commit(*_):
    db.execute("COMMIT")
    print(f"committed {rows}", flush=True)
    hold(100)


hold(int(sys.argv[2]))
signal.signal(signal.SIGUSR1, commit)
while True:
    signal.pause()
