"""One exception type for everything a user can get wrong, with a machine-readable kind.

Tests and the CLI match on ``kind``; humans read the message, which always says what
happened, the numbers involved, and what to do about it.

>>> str(AutoparError(ErrorKind.BAD_INPUT, "cluster '' names no devices"))
"[BAD_INPUT] cluster '' names no devices"
"""

from __future__ import annotations

import enum


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
