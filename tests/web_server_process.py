"""The metrics endpoint alone in a process of its own, so a test can read its memory from /proc.

    python tests/web_server_process.py WEB_CONFIG_FILE

Starts a MetricsServer on a free loopback port with the given --web-config-file, publishes an
exposition with the server's own counters (re-rendered every 0.2 s, as the agent's cycle would),
prints ``port <n>`` on stdout, and runs until stdin is closed.
"""

from __future__ import annotations

import sys
import threading

from kit_helpers import publish

from exporter.logs import configure
from exporter.metrics.render import RenderState
from exporter.metrics.server import MetricsServer
from exporter.metrics.webconfig import load_web_config


def main() -> None:
    configure("json", "warning")
    server = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"), web_config=load_web_config(sys.argv[1]))
    cache = publish(server, RenderState(cycles=1, http=server.stats()))
    server.start()
    done = threading.Event()

    def cycles() -> None:
        n = 1
        while not done.wait(0.2):
            n += 1
            cache.publish(RenderState(cycles=n, http=server.stats()))

    threading.Thread(target=cycles, daemon=True).start()
    print(f"port {server.port}", flush=True)
    sys.stdin.read()
    done.set()
    server.stop()


if __name__ == "__main__":
    main()
