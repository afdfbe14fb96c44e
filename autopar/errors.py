"""One exception type for everything a user can get wrong, with a machine-readable kind.

Tests and the CLI match on ``kind``; humans read the message, which always says what
happened, the numbers involved, and what to do about it.

>>> str(AutoparError(ErrorKind.BAD_INPUT, "cluster '' names no devices"))
"[BAD_INPUT] cluster '' names no devices"
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import traceback


class ErrorKind(str, enum.Enum):
    UNTRACEABLE = "UNTRACEABLE"
    INFEASIBLE_MEMORY = "INFEASIBLE_MEMORY"
    UNSUPPORTED_OP = "UNSUPPORTED_OP"
    BAD_INPUT = "BAD_INPUT"
    BAD_CLUSTER = "BAD_CLUSTER"
    BAD_PLAN = "BAD_PLAN"
    WORLD_MISMATCH = "WORLD_MISMATCH"
    SOLVER_FAILED = "SOLVER_FAILED"


class AutoparError(Exception):
    """An error the user can act on; ``kind`` says which family it belongs to."""

    def __init__(self, kind: ErrorKind, message: str, needed_bytes: int | None = None) -> None:
        self.kind = ErrorKind(kind)
        self.message = message
        self.needed_bytes = needed_bytes  # INFEASIBLE_MEMORY: least bytes per device any plan needs
        super().__init__(f"[{self.kind.value}] {message}")

    def __reduce__(self):  # picklable, so rank 0 can broadcast a planning error to every rank
        return (type(self), (self.kind, self.message, self.needed_bytes))


# Short aliases so callers can write ``AutoparError.UNTRACEABLE`` like an enum member.
for _kind in ErrorKind:
    setattr(AutoparError, _kind.value, _kind)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters): what a one-line
    error quotes of someone else's exception."""
    return (str(exc).strip().splitlines() or [""])[0][:300]


def raised_at(exc: BaseException, skip: tuple[str, ...] = ()) -> str:
    """``file:line: `source``` of the innermost frame of ``exc``'s traceback outside the
    folders in ``skip`` (libraries: the user's own line), or "unknown location"."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not skip or not os.path.realpath(f.filename).startswith(skip)]
    if not frames:
        return "unknown location"
    code = (frames[-1].line or "").strip()
    return f"{frames[-1].filename}:{frames[-1].lineno}" + (f": `{code}`" if code else "")


@contextlib.contextmanager
def quiet_logs(*names: str):
    """Keep the loggers ``names`` quiet while inside; yields the records they held back. Torch
    logs a whole traceback for some failures (a fake kernel refusing a shape, an archive it
    cannot read) right before raising; autopar's own one-line message says it once, quoting
    the held-back record's cause where torch's exception does not carry it."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    loggers = [logging.getLogger(name) for name in names]
    for lg in loggers:
        lg.addFilter(hold)
    try:
        yield held
    finally:
        for lg in loggers:
            lg.removeFilter(hold)


def held_cause(records: list[logging.LogRecord]) -> str:
    """``Type: first line`` of the exception the last of ``records`` logged, or ""."""
    for record in reversed(records):
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            return f"{type(exc).__name__}: {first_line(exc)}"
    return ""
