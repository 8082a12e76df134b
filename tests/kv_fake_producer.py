"""A fake KV producer for tests/test_kv_transfer.py, run as its own process.

It says hello with the transfer meta it is given (so the consumer accepts it), then, by
mode, answers each fetch with a uuid it never offers ("never": the pull is issued and never
completes) or does not answer at all ("silent"). It prints its side channel's port, then
one line per fetch. The test kills it, which closes its transfer connections (a process
that exits with a pull pending aborts, so the fake must go first).
"""

import json
import socket
import sys
import threading
from multiprocessing.connection import Connection

import jax
from jax.experimental import transfer


def main() -> None:
    with open(sys.argv[1]) as f:
        meta = json.load(f)
    mode = sys.argv[2]
    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)

    def answer(conn: Connection) -> None:
        while True:
            try:
                message = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if message["op"] == "hello":
                conn.send_bytes(json.dumps({"ok": True, "meta": meta, "transfer_address": server.address()}).encode())
            elif message["op"] == "fetch":
                print("fetch", flush=True)
                if mode == "never":
                    chunks = [{"uuid": 12345, "num_blocks": len(message["blocks"])}]
                    conn.send_bytes(json.dumps({"ok": True, "chunks": chunks}).encode())

    while True:
        sock, _ = listener.accept()
        threading.Thread(target=answer, args=(Connection(sock.detach()),), daemon=True).start()


if __name__ == "__main__":
    main()
