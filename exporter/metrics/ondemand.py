"""Render on demand: the sampler publishes each cycle's :class:`RenderState`; its bytes are made
when something asks for them, at most once per cycle.

Why: a cycle's state is cheap to publish (immutable parts the sources made anyway), its
rendering is not (about half of a dense node's cycle, since the billing counters move every
cycle), and with a usual 15-30 s scrape interval and a 1-5 s cycle most renders were never read.

How it works:

* :meth:`OnDemand.publish` (the sampler) stores the state, numbered. Nothing is rendered, unless
  scrapes are frequent: when each of the last ``EAGER_AFTER`` states was asked for before the
  next came, the sampler renders the new one itself *before* publishing it (and makes the forms
  asked for last time). That is the pre-on-demand behaviour, kept where every render is read
  anyway: scrapes arriving meanwhile get the previous cycle's bytes at once instead of waiting
  for the render, so a scraper faster than the cycle sees no render in its latency.
* :meth:`OnDemand.request` (the HTTP handler, on the event loop) returns a future of the
  exposition of the newest published state, with the asked-for form (body, OpenMetrics, either
  gzipped) made. If it is made already the future is done; otherwise one job on the ``render``
  thread renders what is newest and makes the form, off the event loop, so other connections
  are served meanwhile. Requests for the same state and form share one job.
* One render at a time: the :class:`Renderer` keeps per-series caches from one render to the
  next and is not thread-safe. Renders run on two threads (the sampler when eager, ``render``
  when asked), always under ``_render_lock``, which also orders the caches' writes between the
  two threads. Their input is safe to read from another thread: every part of a RenderState is
  immutable or a copy the sampler made for it (Snapshot, Usage and RemediationReport are frozen;
  the health counters, collector status and HTTP counters are copied at publish).
* A render that fails (a bug, for one state) is logged once per state and not retried until the
  next state: the previous exposition is served (its ``dra_gpu_exporter_last_collection_timestamp_seconds``
  says how old it is) and ``error`` says why for /readyz; with no previous one, ``None``, which
  the handler answers with 500. The renderer's caches are only replaced at the end of a render,
  so a failed one leaves them as the last good render left them.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from ..text import one_line
from .render import Exposition, Form, Renderer, RenderState

log = structlog.get_logger(__name__)


def _done(exp: Exposition | None) -> Future[Exposition | None]:
    fut: Future[Exposition | None] = Future()
    fut.set_result(exp)
    return fut


class Fixed:
    """An exposition that never changes (tests, the benchmark's baseline): the same interface."""

    published = True

    def __init__(self, exposition: Exposition) -> None:
        self.exposition = exposition

    def request(self, form: Form | None = None) -> Future[Exposition | None]:
        if form is not None:
            self.exposition.get(form)
        return _done(self.exposition)


class OnDemand:
    """The newest published state and its exposition, rendered when asked (see the module doc)."""

    # Render eagerly (on the sampler) once this many states in a row were each asked for before
    # the next one came: scrapes at least as often as cycles. One state asked for, then one not
    # (a 15 s scrape of a 5 s cycle) stays on demand.
    EAGER_AFTER = 2

    def __init__(self, renderer: Renderer) -> None:
        self._renderer = renderer
        self._render_lock = threading.Lock()  # one render at a time (see the module doc)
        # Guards the fields below; held briefly, never across a render, and never while waiting
        # for the render lock (always taken second): no order to deadlock on.
        self._lock = threading.Lock()
        self._state: RenderState | None = None
        self._seq = 0  # states published so far; the newest is number _seq
        self._rendered: tuple[int, Exposition] | None = None  # the newest good render and its state's number
        self._failed = 0  # the number of the newest state whose render failed (not retried)
        self._jobs: dict[Form | None, tuple[int, Future[Exposition | None]]] = {}  # render-thread jobs per form
        self._asked = 0  # the newest state's number something asked for
        self._asked_forms: set[Form] = set()  # forms asked for since the last publish
        self._streak = 0  # states in a row asked for before the next came
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")
        self.renders = 0  # renders run (each a state)
        self.eager_renders = 0  # of them, on the sampler
        self.failures = 0
        self.error: str | None = None  # why the newest state could not be rendered; None if it could

    # -- the sampler ----------------------------------------------------------------------------
    @property
    def published(self) -> bool:
        """Whether there is a state to serve (its bytes are made on the first request)."""
        return self._state is not None

    @property
    def state(self) -> RenderState | None:
        """The newest published state (benchmarks render it with a renderer of their own)."""
        return self._state

    @property
    def rendered(self) -> bool:
        """Whether any state was rendered successfully (/readyz: a failing first render)."""
        return self._rendered is not None

    def publish(self, state: RenderState) -> None:
        """The newest state (the sampler's, once per cycle). Renders it first if scrapes are frequent."""
        with self._lock:
            asked = self._seq > 0 and self._asked == self._seq
            self._streak = self._streak + 1 if asked else 0
            eager = self._streak >= self.EAGER_AFTER
            forms, self._asked_forms = self._asked_forms, set()
        if not eager:
            with self._lock:
                self._seq += 1
                self._state = state
            return
        with self._render_lock:
            with self._lock:
                seq = self._seq + 1
            exp = self._render(seq, state)
            if exp is not None:
                for form in sorted(forms):
                    exp.get(form)  # what the scrapers asked for last time, made here, not on the event loop
            with self._lock:  # published once made: meanwhile scrapes get the previous cycle's bytes
                self._seq, self._state = seq, state
                self.eager_renders += exp is not None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- whoever needs the bytes ----------------------------------------------------------------
    def request(self, form: Form | None = None) -> Future[Exposition | None]:
        """A future of the newest state's exposition with ``form`` made (None: only rendered);
        done at once when there is nothing to do. Its result is None when nothing could be
        rendered yet (no state, or every render failed). Raises RuntimeError once closed."""
        with self._lock:
            seq = self._seq
            self._asked = seq
            if form is not None:
                self._asked_forms.add(form)
            if self._state is None:
                return _done(None)
            last = self._rendered
            current = last is not None and last[0] >= seq  # (an eager render is made before it is published)
            if (current or self._failed == seq) and (last is None or form is None or last[1].ready(form)):
                return _done(last[1] if last is not None else None)
            job = self._jobs.get(form)
            if job is not None and job[0] == seq:
                return job[1]  # the same state and form: share the job in flight
            fut = self._pool.submit(self._job, form)
            self._jobs[form] = (seq, fut)
        fut.add_done_callback(lambda f: self._forget(form, f))  # (it holds an exposition)
        return fut

    def current(self, timeout: float | None = None) -> Exposition | None:
        """The newest state's exposition, rendered now if it is not (blocks: tests, benchmarks,
        never the event loop)."""
        return self.request().result(timeout)

    def _forget(self, form: Form | None, fut: Future[Exposition | None]) -> None:
        with self._lock:
            job = self._jobs.get(form)
            if job is not None and job[1] is fut:
                del self._jobs[form]

    def _job(self, form: Form | None) -> Exposition | None:
        """On the render thread: bring the exposition up to the newest state, make ``form``."""
        with self._render_lock:
            with self._lock:
                seq, state, last, failed = self._seq, self._state, self._rendered, self._failed
            if state is not None and (last is None or last[0] < seq) and failed != seq:
                self._render(seq, state)
            with self._lock:
                last = self._rendered
        exp = last[1] if last is not None else None
        if exp is not None and form is not None:
            exp.get(form)  # joined or gzipped here, off the event loop (outside the render lock)
        return exp

    def _render(self, seq: int, state: RenderState) -> Exposition | None:
        """Render state number ``seq`` (the caller holds the render lock)."""
        try:
            exp = self._renderer.render(state)
        except Exception as e:  # a bug for one state must not take the endpoint down
            log.exception("metrics_render_failed", state=seq, serving="the previous cycle's metrics" if self._rendered else "HTTP 500")
            with self._lock:
                self.failures += 1
                self._failed = seq
                self.error = f"metrics render failed: {type(e).__name__}: {one_line(e, 200)}"
            return None
        with self._lock:
            self.renders += 1
            if self._rendered is None or self._rendered[0] < seq:
                self._rendered = (seq, exp)
                self.error = None
        return exp


__all__ = ["Fixed", "OnDemand"]
