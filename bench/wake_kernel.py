"""Client side of bench/wake_latency.sh, with jupyter_client.

  wake_kernel.py fill CONNECTION MIB   run a cell that makes the kernel hold MIB of random
                                       memory (in 64 MiB blocks), then disconnect
  wake_kernel.py probe CONNECTION      connect a new client and time from the start of the
                                       connection to the first answer (kernel_info); print ms
"""
import sys
import time

from jupyter_client import BlockingKernelClient


def client(connection):
    kc = BlockingKernelClient(connection_file=connection)
    kc.load_connection_file()
    kc.start_channels()
    return kc


def main():
    mode, connection = sys.argv[1], sys.argv[2]
    if mode == "fill":
        kc = client(connection)
        kc.wait_for_ready(timeout=60)
        cell = f"import os\nblocks = [os.urandom(64 << 20) for _ in range({int(sys.argv[3])} // 64)]"
        reply = kc.execute_interactive(cell, timeout=600)
        assert reply["content"]["status"] == "ok", reply
        kc.stop_channels()
        return
    started = time.monotonic()
    kc = client(connection)
    kc.kernel_info(reply=True, timeout=60)
    print(round((time.monotonic() - started) * 1000))
    kc.stop_channels()


main()
