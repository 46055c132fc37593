#!/usr/bin/env python3
"""Where the agent's CPU goes, every thread included: the real agent under yappi's CPU clock.

Usage (from the repository root; needs ``pip install yappi``, which the product does not):

    python bench/profile_agent.py --seconds 30 --out prof.txt -- --backend nvml --interval 1 ...

Everything after ``--`` is the agent's own command line. The agent runs in this process for
``--warmup`` plus ``--seconds`` (start-up is left out), then gets SIGTERM and shuts down as in a pod; the report lists CPU per thread and
the functions with the most CPU (own and cumulative). cProfile sees only the main thread, and
the agent's work happens in its collector, event and HTTP threads, hence yappi.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import threading
from pathlib import Path

import yappi

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exporter.cli import main as agent_main


def report(top: int) -> str:
    """yappi's CPU per thread and the ``top`` functions by own and by cumulative CPU."""
    buf = io.StringIO()
    threads = yappi.get_thread_stats()
    threads.sort("ttot")
    buf.write("== CPU per thread\n")
    threads.print_all(out=buf)
    funcs = yappi.get_func_stats()
    for key in ("tsub", "ttot"):
        funcs.sort(key)
        buf.write(f"\n== top {top} functions by {key}\n")
        for st in list(funcs)[:top]:
            buf.write(f"{st.ttot:9.4f} ttot {st.tsub:9.4f} tsub {st.ncall:>8} calls  {st.module}:{st.lineno} {st.name}\n")
    return buf.getvalue()


def main() -> int:
    argv = sys.argv[1:]
    agent_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of start-up left out of the profile")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    yappi.set_clock_type("cpu")
    yappi.start(builtins=True)
    threading.Timer(a.warmup, yappi.clear_stats).start()
    threading.Timer(a.warmup + a.seconds, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    rc = agent_main(agent_argv)
    yappi.stop()

    text = f"agent exit status {rc}; {a.seconds:.0f} s profiled\n\n" + report(a.top)
    a.out.write_text(text)
    print(text[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
