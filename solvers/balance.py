"""Experts in an order whose contiguous blocks carry even loads (expert parallelism).

Expert parallelism gives device d the experts ``order[d·k … (d+1)·k − 1]``, ``k = E / n``
(DTensor's ``Shard(0)`` of the stacked experts). With the tokens each expert receives,
``w_e``, the order is a bin packing with equal bin counts, solved by CP-SAT:

    variables    x[e, d] ∈ {0, 1}        expert e on device d
                 busiest, lightest ∈ ℤ   the most and least tokens on one device
    minimise     busiest · (Σ_e w_e + 1) − lightest    (the busiest first, then the spread)
    each expert  Σ_d x[e, d] = 1
    each device  Σ_e x[e, d] = k,   lightest ≤ Σ_e w_e · x[e, d] ≤ busiest

warm-started from longest-processing-time first (the greedy assignment is also the answer
when the solver finds nothing within its time limit). Fractional loads are scaled by 1000 to
integers. One worker: the same order every run. Plain numbers in and out.

>>> balanced_order((4, 3, 1, 0), 2)
[0, 3, 1, 2]
>>> device_loads((4, 3, 1, 0), [0, 3, 1, 2], 2)
[4, 4]
"""

from __future__ import annotations


def device_loads(load: tuple[float, ...], order: list[int], devices: int) -> list[float]:
    """Tokens each device processes when the experts, in ``order``, are cut into ``devices``
    contiguous blocks (DTensor's ``Shard(0)``)."""
    per = len(order) // devices
    return [sum(load[e] for e in order[d * per:(d + 1) * per]) for d in range(devices)]


def imbalance(loads: list[float]) -> float:
    """max / mean load; 1.0 is perfect balance."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def balanced_order(load: tuple[float, ...], devices: int, time_limit_s: float = 2.0) -> list[int]:
    """An order of the experts whose contiguous blocks of ``len(load) / devices`` experts carry
    the most even load: the best of the solver's, the greedy and the model's own order (the
    experts keep their order when that is as even). ``len(load)`` must be a multiple of
    ``devices``."""
    experts = len(load)
    per = experts // devices
    identity = list(range(experts))
    if devices <= 1 or len(set(load)) <= 1:
        return identity
    greedy = _longest_first(load, devices, per)
    solved = _solve_bins(load, devices, per, greedy, time_limit_s)
    orders = [[e for b in bins for e in sorted(b)] for bins in (solved, greedy)]
    return min([identity, *orders], key=lambda o: (imbalance(device_loads(load, o, devices)), o != identity))


def _longest_first(load, devices: int, per: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(devices)]
    totals = [0.0] * devices
    for e in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        d = min((d for d in range(devices) if len(bins[d]) < per), key=lambda d: (totals[d], d))
        bins[d].append(e)
        totals[d] += load[e]
    return bins


def _solve_bins(load, devices: int, per: int, hint: list[list[int]], time_limit_s: float) -> list[list[int]]:
    from ortools.sat.python import cp_model

    scale = 1 if all(float(x).is_integer() for x in load) else 1000
    weights = [int(round(x * scale)) for x in load]
    model = cp_model.CpModel()
    x = {(e, d): model.NewBoolVar(f"x{e}_{d}") for e in range(len(load)) for d in range(devices)}
    busiest = model.NewIntVar(0, sum(weights), "busiest")
    lightest = model.NewIntVar(0, sum(weights), "lightest")
    for e in range(len(load)):
        model.AddExactlyOne(x[e, d] for d in range(devices))
    for d in range(devices):
        model.Add(sum(x[e, d] for e in range(len(load))) == per)
        model.Add(sum(weights[e] * x[e, d] for e in range(len(load))) <= busiest)
        model.Add(sum(weights[e] * x[e, d] for e in range(len(load))) >= lightest)
    model.Minimize(busiest * (sum(weights) + 1) - lightest)
    owner = {e: d for d, b in enumerate(hint) for e in b}
    for (e, d), var in x.items():
        model.AddHint(var, owner[e] == d)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1  # deterministic
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint
    return [[e for e in range(len(load)) if solver.Value(x[e, d])] for d in range(devices)]
