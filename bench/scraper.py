"""A Prometheus-like scraper, in a process of its own (its CPU is not the agent's).

    python bench/scraper.py URL --every 15 --start-at EPOCH --until EPOCH

GETs ``URL`` (the agent's /metrics) with the headers Prometheus 2.x sends (OpenMetrics first,
gzip), one request at a time on a fresh connection, at a fixed rate: the first at
``start-at + every/2`` (half a period into the measured window, so a window of whole periods
holds exactly window/every scrapes, away from its edges), then every ``every`` seconds until
``until``. Prints one JSON line: the number of scrapes, their statuses, and each one's latency.
"""

from __future__ import annotations

import argparse
import http.client
import json
import time
from urllib.parse import urlparse

# Prometheus 2.x's scrape request (scrape/scrape.go: the OpenMetrics-first Accept header).
ACCEPT = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
HEADERS = {"Accept": ACCEPT, "Accept-Encoding": "gzip", "User-Agent": "Prometheus/2.x (bench/scraper.py)"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--every", type=float, required=True, help="seconds between scrapes")
    ap.add_argument("--start-at", type=float, required=True, help="wall-clock (epoch) start of the window")
    ap.add_argument("--until", type=float, required=True, help="wall-clock (epoch) end of the window")
    a = ap.parse_args()
    u = urlparse(a.url)
    latencies, statuses = [], []
    at = a.start_at + a.every / 2
    while at < a.until:
        time.sleep(max(0.0, at - time.time()))
        t0 = time.perf_counter()
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            c.request("GET", u.path or "/metrics", headers=HEADERS)
            r = c.getresponse()
            r.read()
            statuses.append(r.status)
        finally:
            c.close()
        latencies.append(time.perf_counter() - t0)
        at += a.every
    print(json.dumps({"scrapes": len(latencies), "statuses": sorted(set(statuses)), "latencies_s": latencies}))


if __name__ == "__main__":
    main()
