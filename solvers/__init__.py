"""Optimizers behind one interface: ``solve(problem, hint=None) -> Solution``; chosen by name."""

from __future__ import annotations

from autopar.errors import AutoparError, ErrorKind


def get_solver(name: str, *, time_limit_s: float = 60.0, seed: int = 0):
    """Return a solver object by registry name (``"cpsat"``)."""
    from autopar.solvers.ilp import CpSatSolver

    registry = {"cpsat": CpSatSolver}
    if name not in registry:
        raise AutoparError(ErrorKind.BAD_INPUT, f"unknown solver {name!r}; available: {', '.join(registry)}")
    if not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise AutoparError(ErrorKind.BAD_INPUT, f"time_limit_s must be a positive number of seconds, got "
                           f"{time_limit_s!r}; the best plan found within it is returned with its gap")
    return registry[name](time_limit_s=time_limit_s, seed=seed)
