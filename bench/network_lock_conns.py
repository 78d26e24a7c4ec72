"""Processes for bench/network_lock.sh: `peer PORT` echoes on every connection it accepts;
`client PORT N` opens N connections to it and sends a byte on each every 100 ms."""
import socket
import sys
import threading
import time


def echo(conn):
    while data := conn.recv(64):
        conn.sendall(data)


def peer(port):
    server = socket.create_server(("127.0.0.1", port), backlog=1024)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def client(port, n):
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    print("ready", flush=True)
    while True:
        for conn in conns:
            conn.sendall(b"x")
            conn.recv(1)
        time.sleep(0.1)


if __name__ == "__main__":
    if sys.argv[1] == "peer":
        peer(int(sys.argv[2]))
    else:
        client(int(sys.argv[2]), int(sys.argv[3]))
