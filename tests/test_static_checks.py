"""Static checks the suite makes itself. ruff (`ruff check exporter drasim tests bench`) and
`mypy --strict` (`mypy`), both configured in pyproject.toml, run before the suite in CI (.ci/run),
not in it: they cost the suite minutes and say nothing about behaviour. Here: that CI runs them
first, and that every log event is one literal snake_case name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_lints_and_type_checks_before_the_suite() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()

    def first(command: str) -> int:
        hits = [n for n, line in enumerate(lines) if line.startswith(command)]
        assert hits, f".ci/run does not run {command}"
        return hits[0]

    suite = first("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest")
    assert first(".venv/bin/ruff check --output-format concise exporter drasim tests bench") < suite
    assert first(".venv/bin/mypy --no-incremental") < suite


# The structlog methods that take an event name first (structlog.typing.BindableLogger and the
# stdlib-style level methods of its bound loggers).
_LOG_METHODS = frozenset({"debug", "info", "msg", "warning", "warn", "error", "err", "exception", "critical", "fatal", "failure", "log"})
_LOGGER_NAMES = frozenset({"log", "_log", "logger"})  # this code base's names for a module's logger


def _is_logger_factory(node: ast.expr) -> bool:
    """``structlog.get_logger(...)``, ``structlog.getLogger(...)``, ``<logger>.bind(...)`` / ``.new(...)``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"get_logger", "getLogger", "bind", "new", "wrap_logger"}


def _name(node: ast.expr) -> str | None:
    """The name a reference ends in: ``log`` for ``log``, ``self.log`` and ``self._http.log``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _loggers(tree: ast.AST) -> set[str]:
    """Names bound to a structlog logger anywhere in a module, and the conventional ones."""
    names = set(_LOGGER_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_logger_factory(node.value):
            names.update(n for n in map(_name, node.targets) if n)
        elif isinstance(node, ast.AnnAssign) and node.value is not None and _is_logger_factory(node.value):
            names.update(n for n in [_name(node.target)] if n)
    return names


def _log_methods(func: ast.expr, loggers: set[str]) -> list[str]:
    """The logging methods a call's callee can be: ``log.info``, and both of
    ``(log.debug if quiet else log.warning)``."""
    if isinstance(func, ast.IfExp):
        return _log_methods(func.body, loggers) + _log_methods(func.orelse, loggers)
    if isinstance(func, ast.BoolOp):
        return [m for v in func.values for m in _log_methods(v, loggers)]
    if isinstance(func, ast.Attribute) and func.attr in _LOG_METHODS and (_name(func.value) in loggers or _is_logger_factory(func.value)):
        return [func.attr]
    return []


def _argument(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _literal_names(event: ast.expr | None) -> list[str] | None:
    """The event names an argument can be: a string literal, or a choice between literals
    (``"agent_starved" if starved else "agent_no_longer_starved"``: still fixed names one can
    grep for); None for anything built at run time."""
    if isinstance(event, ast.Constant) and isinstance(event.value, str):
        return [event.value]
    if isinstance(event, ast.IfExp):
        body, orelse = _literal_names(event.body), _literal_names(event.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def _log_calls(trees: dict[str, ast.AST]) -> list[tuple[str, ast.Call, ast.expr | None]]:
    """(file, call, event argument) of every call that logs an event: a logging method of a
    structlog logger, and a function of ours that passes its parameter on as the event (a
    forwarder, e.g. a rate-limited log: ``client_log("http_accept_failed", ...)``), which is
    checked at its callers instead. The event argument is None when the call has none."""
    loggers = {path: _loggers(tree) for path, tree in trees.items()}
    direct: list[tuple[str, ast.Call, ast.expr | None]] = []
    forwarders: dict[str, tuple[int, str]] = {}  # callable name -> (position, parameter name) of the event
    for path, tree in trees.items():
        classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
        owner = {id(f): c.name for c in classes for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for fn in [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            if id(fn) in owner and params and params[0] in ("self", "cls"):
                params = params[1:]
            for call in [c for c in ast.walk(fn) if isinstance(c, ast.Call)]:
                methods = _log_methods(call.func, loggers[path])
                if not methods:
                    continue
                event = _argument(call, 1, "event") if methods[0] == "log" else _argument(call, 0, "event")  # log(level, event, ...)
                if isinstance(event, ast.Name) and event.id in params:
                    # callers of this function (of its class's instances, for __call__) name the event
                    if fn.name == "__call__" and id(fn) in owner:
                        cls = owner[id(fn)]
                        for tree2 in trees.values():
                            for node in ast.walk(tree2):
                                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _name(node.value.func) == cls:
                                    forwarders.update({n: (params.index(event.id), event.id) for n in map(_name, node.targets) if n})
                    else:
                        forwarders[fn.name] = (params.index(event.id), event.id)
                    continue
                direct.append((path, call, event))
    # module-level calls (outside any function)
    for path, tree in trees.items():
        inside = {id(c) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for c in ast.walk(f)}
        for call in [c for c in ast.walk(tree) if isinstance(c, ast.Call) and id(c) not in inside]:
            methods = _log_methods(call.func, loggers[path])
            if methods:
                direct.append((path, call, _argument(call, 1, "event") if methods[0] == "log" else _argument(call, 0, "event")))
    forwarded = [
        (path, call, _argument(call, *forwarders[name]))
        for path, tree in trees.items()
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and (name := _name(call.func)) in forwarders
    ]
    return direct + forwarded


def test_every_log_event_is_one_literal_snake_case_name() -> None:
    """One log-event naming style (issues 11 and 25): ``log.info("kubelet_socket_missing", ...)``,
    never dotted or spaced names, and never a name built at run time (an f-string, a variable,
    a concatenation): what varies goes into a field (``kind=...``), so logs can be filtered and
    alerted on by one fixed event name. Read from the syntax tree, so no spelling of a call
    hides: a conditional callee, ``event=``, ``log.log(level, ...)``, a function that forwards
    its parameter as the event (checked at its callers)."""
    paths = sorted([*ROOT.glob("exporter/**/*.py"), *ROOT.glob("drasim/**/*.py")])
    trees: dict[str, ast.AST] = {str(p.relative_to(ROOT)): ast.parse(p.read_text(), filename=str(p)) for p in paths}
    calls = _log_calls(trees)
    bad = []
    for path, call, event in calls:
        where = f"{path}:{call.lineno}"
        names = _literal_names(event)
        if names is None:
            bad.append(f"{where}: event name is not a literal string: {ast.unparse(event) if event else '(none)'}")
        bad.extend(f"{where}: {name!r} is not snake_case" for name in names or () if not re.fullmatch(r"[a-z][a-z0-9_]*", name))
    assert not bad, "\n".join(bad)
    assert len(calls) >= 100, f"only {len(calls)} logging calls found: the walker no longer recognises the loggers"
