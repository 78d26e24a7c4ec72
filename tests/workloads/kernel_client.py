"""A Jupyter client, the way JupyterLab talks to a kernel: jupyter_client's BlockingKernelClient
on a connection file (ZeroMQ over TCP). Not a workload: tests/tests/jupyter_kernel.rs runs it
outside the checkpointed tree, one process per client connection (a browser tab). (Named so as
not to shadow the jupyter_client package.)

Usage: kernel_client.py CONNECTION_FILE

Connects, waits for the kernel to answer kernel_info (and its iopub to deliver), prints
`{"ready": true}`, then answers requests read from stdin, one JSON object a line, with one
JSON object a line on stdout:

  {"op": "info"}                 -> {"status": "ok", "implementation": ..., ...}
  {"op": "execute", "code": C}   -> {"status": "ok"|"error", "execution_count": N,
                                     "stdout": what C printed, "error": "ename: evalue"}

Every request waits at most TIMEOUT seconds (a `timeout` field overrides it); a request that
times out or fails answers {"status": "failed", "error": ...}. Exits at the end of stdin.
"""
import json
import sys

from jupyter_client import BlockingKernelClient

TIMEOUT = 20.0


def execute(kc, code, timeout):
    out = []

    def on_output(msg):
        if msg["msg_type"] == "stream" and msg["content"].get("name") == "stdout":
            out.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=on_output, allow_stdin=False)
    content = reply["content"]
    error = f"{content['ename']}: {content['evalue']}" if content["status"] == "error" else ""
    return {
        "status": content["status"],
        "execution_count": content.get("execution_count"),
        "stdout": "".join(out),
        "error": error,
    }


def answer(kc, request):
    timeout = float(request.get("timeout", TIMEOUT))
    if request["op"] == "info":
        content = kc.kernel_info(reply=True, timeout=timeout)["content"]
        return {key: content.get(key) for key in ("status", "implementation", "language_info")}
    if request["op"] == "execute":
        return execute(kc, request["code"], timeout)
    return {"status": "failed", "error": f"unknown op {request['op']!r}"}


def main():
    kc = BlockingKernelClient(connection_file=sys.argv[1])
    kc.load_connection_file()
    # As Jupyter Server connects a browser's kernel websocket: shell, iopub, stdin and control,
    # no heartbeat channel. (jupyter_client's heartbeat pings the kernel every second, which
    # is a request like any other to stasisd: a kernel pinged so is woken as soon as it is
    # reclaimed, and its reclaim backs off whenever a ping lands in the dump.)
    kc.start_channels(hb=False)
    try:
        kc.wait_for_ready(timeout=TIMEOUT)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            try:
                reply = answer(kc, json.loads(line))
            except Exception as e:  # a timeout (TimeoutError, queue.Empty) or a broken reply
                reply = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply), flush=True)
    except RuntimeError as e:
        print(json.dumps({"ready": False, "error": str(e)}), flush=True)
    finally:
        kc.stop_channels()


if __name__ == "__main__":
    main()
