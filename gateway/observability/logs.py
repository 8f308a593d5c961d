"""Log output: one structlog pipeline for the gateway's own events and for stdlib loggers (hypercorn).

``configure_logging`` is called once, by ``__main__`` (the only place that touches structlog's global
configuration). Everything else just calls ``structlog.get_logger(...)``. The chain is kept short
because one canonical line is written per review: context variables, level, timestamp, exception
formatting, then a msgspec JSON renderer that produces bytes directly. The canonical line, already a
dict, skips structlog's generic call path while that chain is in force (``EventWriter``, same bytes).
Measured with ``benchmarks/bench_observability.py``: the canonical line costs about 6 µs for a
one-backend review and 9 µs for five (building its fields included), against about 19 and 27 µs
through structlog's stock ``JSONRenderer`` chain. Disabled levels cost a no-op method call
(``make_filtering_bound_logger``).

Where lines go: the serving processes (``serve``, the ``--workers`` supervisor and each worker) use
``configure_logging(..., background=True)``: lines are handed to a ``logsink.LineSink``, which never
blocks the caller on stdout, writes in batches from a thread of its own, and drops (and counts, and
says so) beyond a memory bound; the bytes are those written without it. The other commands write
each line to the stream at once.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import re
import sys
from collections.abc import Callable, MutableMapping
from typing import Any, BinaryIO, Final, Literal, TextIO

import msgspec
import structlog
from structlog.contextvars import get_contextvars, merge_contextvars
from structlog.processors import add_log_level, format_exc_info
from structlog.typing import EventDict, Processor, WrappedLogger

from gateway.observability.logsink import BATCH_BYTES, PIPE_BUF, LineSink

LogFormat = Literal["json", "console"]

LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_UTC: Final = datetime.UTC


def _encode_fallback(obj: object) -> object:
    """Anything msgspec cannot encode natively (exceptions, paths, custom objects) is logged as text."""
    return str(obj)


class MsgspecJSONRenderer:
    """Render the event dict as one JSON line (bytes) with msgspec.

    ``msgspec.Raw`` values (review bodies under ``--log-bodies``) are embedded as JSON, not re-encoded.
    """

    __slots__ = ("encode",)

    def __init__(self) -> None:
        self.encode: Final = msgspec.json.Encoder(enc_hook=_encode_fallback).encode

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> bytes:
        # Timestamp, level and event first: that is the order people scan a line in.
        line = {
            "timestamp": event_dict.pop("timestamp", None),
            "level": event_dict.pop("level", None),
            "event": event_dict.pop("event", None),
        }
        line.update(event_dict)
        return self.encode(line)


def _timestamp_utc(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    # A datetime object, not a string: msgspec writes RFC 3339 ("...Z") faster than isoformat().
    event_dict["timestamp"] = datetime.datetime.now(_UTC)
    return event_dict


def _raw_as_text(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """Console format: show embedded JSON bodies as text instead of ``<msgspec.Raw ...>``."""
    for key, value in event_dict.items():
        if isinstance(value, msgspec.Raw):
            event_dict[key] = bytes(value).decode("utf-8", "replace")
    return event_dict


_to_json = msgspec.json.Encoder(enc_hook=_encode_fallback).encode


class _AsJSON:
    """A value the console renderer shows as JSON text (it quotes strings, and reprs everything else)."""

    __slots__ = ("text",)

    def __init__(self, value: object) -> None:
        self.text = _to_json(value).decode()

    def __repr__(self) -> str:
        return self.text


def _containers_as_json(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """Console format: lists and mappings as JSON (``["a"]``), never a Python repr (``['a']``)."""
    for key, value in event_dict.items():
        if key != "exc_info" and isinstance(value, list | tuple | dict | set | frozenset):
            event_dict[key] = _AsJSON(sorted(value) if isinstance(value, set | frozenset) else value)
    return event_dict


def _processors(fmt: LogFormat, *, colors: bool) -> list[Processor]:
    common: list[Processor] = [merge_contextvars, add_log_level]
    if fmt == "json":
        # EventWriter recognises exactly this chain (and writes what it would write).
        return [*common, _timestamp_utc, format_exc_info, MsgspecJSONRenderer()]
    return [
        *common,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _raw_as_text,
        _containers_as_json,
        structlog.dev.ConsoleRenderer(colors=colors),
    ]


# The level names ``make_filtering_bound_logger``'s ``log`` passes on as method names.
_LEVEL_NAMES: Final = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warning",
    logging.ERROR: "error",
    logging.CRITICAL: "critical",
}


class EventWriter:
    """Writes an event whose fields are already a dict (the canonical lines) through a bound logger.

    ``bound.log(level, event, **fields)`` copies the fields twice (into keyword arguments, then into
    a new event dict) and hands that to each processor in turn. While ``bound`` runs exactly the JSON
    chain ``configure_logging`` installs (checked at every call: ``capture_logs`` and reconfiguration
    change the chain in place) and has no bound context, ``write`` instead builds the dict in the
    order the renderer puts it (timestamp, level, event, the fields, structlog context variables) and
    encodes it once with the renderer's encoder: the bytes written are those the chain writes
    (tests/test_observability_logs.py compares them). Anything else goes through ``bound.log``.

    ``write`` does not filter by level: call it for levels ``bound.is_enabled_for``.
    """

    __slots__ = ("_bound", "_chain", "_context", "_encode", "_logger", "_processors")

    def __init__(self, bound: Any) -> None:
        self._bound = bound
        # structlog's BoundLoggerBase attributes (documented as readable by custom wrapper classes).
        self._processors: Any = getattr(bound, "_processors", None)
        self._context: Any = getattr(bound, "_context", None)
        self._logger: Any = getattr(bound, "_logger", None)
        procs = self._processors
        renderer = procs[-1] if isinstance(procs, list) and procs else None
        if isinstance(renderer, MsgspecJSONRenderer) and isinstance(self._context, dict):
            self._chain: list[Any] | None = [
                merge_contextvars, add_log_level, _timestamp_utc, format_exc_info, renderer,
            ]  # fmt: skip
            self._encode: Callable[[Any], bytes] | None = renderer.encode
        else:
            self._chain = self._encode = None

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        """Write ``event`` with ``fields`` (not modified) at ``level`` (a ``logging`` level)."""
        encode = self._encode
        name = _LEVEL_NAMES.get(level)
        if (
            encode is None
            or name is None
            or self._processors != self._chain  # element by element, by identity first
            or self._context
            # keys the chain sets or consumes itself ("event" cannot even be a keyword of log())
            or "timestamp" in fields
            or "level" in fields
            or "event" in fields
            or "exc_info" in fields
        ):
            self._bound.log(level, event, **fields)
            return
        logger = self._logger
        # What the chain's processors produce, in the order the renderer writes it.
        line: dict[str, Any] = {"timestamp": datetime.datetime.now(_UTC), "level": name, "event": event}
        line.update(fields)
        merge_contextvars(logger, name, line)  # adds context variables not already present, in order
        if "exc_info" in line:  # only a context variable could bring one
            format_exc_info(logger, name, line)
        getattr(logger, name)(encode(line))


def configure_logging(
    level: str = "info",
    fmt: LogFormat = "json",
    *,
    stream: TextIO | None = None,
    background: bool = False,
    shared: bool = False,
) -> None:
    """Configure structlog and stdlib logging once (``__main__`` only).

    ``level`` is one of ``LEVELS``; ``fmt`` is ``json`` (one JSON object
    per line, the default) or ``console`` (human-readable). Output goes to ``stream`` (default stdout).
    Stdlib loggers (hypercorn's ``hypercorn.error``) are routed into the same pipeline.

    ``background``: lines go through a ``LineSink`` on the stream's file descriptor (the serving
    processes; see the module docstring), same bytes. It is flushed (waiting at most
    ``logsink.CLOSE_TIMEOUT`` seconds) at exit and when logging is configured again. ``shared``: other
    processes write to the same stdout (``--workers``): each write holds at most ``PIPE_BUF`` bytes,
    so that lines from different processes never interleave (``logsink``).
    """
    out = stream if stream is not None else sys.stdout
    min_level = LEVELS[level.lower()]
    processors = _processors(fmt, colors=fmt == "console" and _isatty(out))
    _close_sink()
    logger_factory: Any
    if background:
        out.flush()  # what was written to the stream before comes out before the sink's lines
        sink = LineSink(
            out.fileno(),
            notice=_dropped_notice(processors),
            context=get_contextvars,
            max_write=PIPE_BUF if shared else BATCH_BYTES,
        )
        _install_sink(sink)
        logger: _SinkBytesLogger | _SinkTextLogger
        if fmt == "json":
            logger = _SinkBytesLogger(sink)
        else:
            logger = _SinkTextLogger(sink, out.encoding or "utf-8", out.errors or "strict")
        logger_factory = _SinkLoggerFactory(logger)
    elif fmt == "json":
        # JSON lines are rendered as bytes and written to the binary buffer underneath the stream.
        logger_factory = structlog.BytesLoggerFactory(file=_binary(out))
    else:
        logger_factory = structlog.PrintLoggerFactory(file=out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        context_class=dict,
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, StructlogHandler):
            root.removeHandler(handler)
    root.addHandler(StructlogHandler())
    root.setLevel(min_level)


# --- background output (LineSink) ------------------------------------------------------------------

# The sink of this process: one, like stdout and structlog's configuration.
_sink: LineSink | None = None
_atexit_registered = False


def _install_sink(sink: LineSink) -> None:
    global _sink, _atexit_registered  # noqa: PLW0603 - one per process, as the stdout it writes to
    _sink = sink
    if not _atexit_registered:
        # Registered at start-up: atexit runs it after the handlers registered later (which may log).
        atexit.register(_close_sink)
        _atexit_registered = True


def _close_sink() -> None:
    """Write out what the sink holds (bounded wait) and stop its thread; nothing without a sink."""
    global _sink
    sink, _sink = _sink, None
    if sink is not None:
        sink.close()


def flush_logs(timeout: float | None = None) -> bool:
    """Wait (at most ``timeout`` s, default ``logsink.CLOSE_TIMEOUT``) until queued lines are written.

    True at once without a background sink (lines are written as they come).
    """
    sink = _sink
    if sink is None:
        return True
    return sink.flush() if timeout is None else sink.flush(timeout)


def count_dropped_lines(add: Callable[[int], object]) -> None:
    """``add(n)`` for lines the background sink drops (buffer full, write errors); those so far at once.

    The serving processes pass their ``webhook_gateway_log_lines_dropped_total`` counter's ``inc``. It
    is called from whichever thread logs, or the sink's writer thread, always under the sink's lock.
    """
    if _sink is not None:
        _sink.count_drops(add)


class _SinkBytesLogger:
    """structlog's ``BytesLogger`` interface: each JSON line (bytes) is handed to the sink.

    Every level method is the sink's ``write`` itself (no wrapper call on the hot path).
    """

    __slots__ = (
        "critical", "debug", "err", "error", "exception", "failure", "fatal", "info", "log", "msg",
        "warn", "warning",
    )  # fmt: skip
    critical: Callable[[bytes], None]
    debug: Callable[[bytes], None]
    err: Callable[[bytes], None]
    error: Callable[[bytes], None]
    exception: Callable[[bytes], None]
    failure: Callable[[bytes], None]
    fatal: Callable[[bytes], None]
    info: Callable[[bytes], None]
    log: Callable[[bytes], None]
    msg: Callable[[bytes], None]
    warn: Callable[[bytes], None]
    warning: Callable[[bytes], None]

    def __init__(self, sink: LineSink) -> None:
        for name in self.__slots__:
            setattr(self, name, sink.write)


class _SinkTextLogger:
    """structlog's ``PrintLogger`` interface: each console line (text) is encoded as the stream would."""

    __slots__ = ("_encoding", "_errors", "_write")

    def __init__(self, sink: LineSink, encoding: str, errors: str) -> None:
        self._write = sink.write
        self._encoding = encoding
        self._errors = errors

    def msg(self, message: str) -> None:
        self._write(message.encode(self._encoding, self._errors))

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _SinkLoggerFactory:
    __slots__ = ("_logger",)

    def __init__(self, logger: _SinkBytesLogger | _SinkTextLogger) -> None:
        self._logger = logger

    def __call__(self, *args: Any) -> _SinkBytesLogger | _SinkTextLogger:
        return self._logger


DROPPED_EVENT: Final = "log lines dropped"


def _dropped_notice(processors: list[Processor]) -> Callable[[int, dict[str, Any]], bytes]:
    """The sink's notice: a warning line rendered by the chain in force (JSON or console)."""

    def notice(count: int, context: dict[str, Any]) -> bytes:
        # The fields, then the logging context where the lines were dropped (as merge_contextvars adds it).
        event: Any = {"event": DROPPED_EVENT, "dropped": count}
        for key, value in context.items():
            event.setdefault(key, value)
        for processor in processors[1:]:  # not merge_contextvars: the context is given
            event = processor(None, "warning", event)
        return event if isinstance(event, bytes) else str(event).encode("utf-8", "replace")

    return notice


def _binary(stream: TextIO) -> BinaryIO:
    buffer = getattr(stream, "buffer", None)
    if buffer is None:
        raise TypeError("JSON log output needs a stream with a binary .buffer (e.g. sys.stdout)")
    return buffer  # type: ignore[no-any-return]


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


_HYPERCORN_LISTENING: Final = re.compile(r"Running on (\S+) \(CTRL \+ C to quit\)")


class StructlogHandler(logging.Handler):
    """Routes stdlib log records (hypercorn, libraries) through the structlog pipeline.

    The record's logger name is kept as ``logger``; exceptions are rendered by the same chain.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            listening = _HYPERCORN_LISTENING.match(message) if record.name == "hypercorn.error" else None
            if listening is not None:  # the server's own start-up line, in the gateway's words
                structlog.get_logger().info("listening", url=listening.group(1))
                return
            fields: MutableMapping[str, Any] = {"logger": record.name}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            structlog.get_logger().log(record.levelno, message, **fields)
        except Exception:  # noqa: BLE001 - logging must never take the server down
            self.handleError(record)
