r"""The sharding ILP, written once (Alpa's intra-operator formulation over placement classes).

Plain numbers only: variables are indices into one flat list, each constraint family is a
method returning named :class:`Row`\ s. solvers/ilp.py emits them into CP-SAT (0/1
variables), solvers/relaxation.py into GLOP (the same rows over [0, 1]: the LP relaxation).

Variables (x first, in node order, then y in edge order)
    x[i,s] ∈ {0,1}          node i uses strategy s
    y[e,u,v] ∈ {0,1}        edge e carries producer class u into consumer class v (only for
                            allowed pairs, and only on edges with two or more classes on both
                            sides; classes group strategies that give the same placement on that
                            edge, so y is small)
    z[g,φ] ≥ 0              seconds: max(C_gφ, W_gφ) of overlap group g (a layer) in phase φ
                            (forward, backward), only where overlappable (parameter) communication
                            falls and some collective kind's η ≠ 0
    h ≥ 0                   bytes: the most gathered weights held at once (only where an edge
                            gathers a weight)
Objective (seconds of one training step)
    min Σ_i n_i Σ_s c[i,s]·x[i,s] + Σ_e n_e Σ_{u,v} R[e,u,v]·y[e,u,v]
        + Σ_{folded e} n_e Σ_v R[e,u₀,v]·Σ_{t ∈ v} x[dst(e),t]   (mirrored for a single consumer class)
        + Σ_{g,φ} (z[g,φ] − f_g·C_gφ − f_g·W_gφ)
    (n_i, n_e: how many identical graph nodes / edges of repeated layers the term stands for;
    the memory row is weighted the same way)
    C_gφ = Σ_{i ∈ g} n_i Σ_s c_φ[i,s]·x[i,s]   the group's compute in phase φ: forward is the op's
             forward time, backward the rest of c[i,s] less comm[i,s] (a node's own exchange —
             an expert dispatch, a sparse exchange — is critical-path communication)
    W_gφ = Σ_{e ∈ g} n_e Σ_k η_k·(e's phase-φ part of kind k, on the R terms as above)
             overlappable communication weighted by its collective kind's η (problem.weighted_parts):
             a parameter's gathers in forward (when prefetched; else they stay in the edge cost,
             exposed); the re-gather of a freed weight and its gradient's reduction in backward
    At the optimum z[g,φ] = max(C_gφ, W_gφ), so group g costs Σ_φ C_gφ + O_gφ − min(C_gφ, W_gφ):
    a compute stream and a communication stream per phase, each collective running the
    fraction η_k of its kind beside the layer's compute of the same phase and stalling it for
    the rest (issue 20; FSDP2 prefetches the next layer's gather and reduce-scatters during
    backward). η_k < 0 (overlap that slows both streams) needs nothing more: max stays convex.
    The epigraph keeps the model linear and its optimum exact. f_g (the share of the group's
    hiding that counts; z is then f_g·max) = 1, except (n − 1)/n for
    the n copies of the first layer the graph runs (problem.exposed_group): one copy's weights
    are gathered before any compute and its gradients reduced after the last, nothing beside.
Constraint families (one method each; a row's name says its family and node or edge)
    one_strategy[i]:      Σ_s x[i,s] = 1                                ∀ i
    edge_rows[e,u]:       Σ_v y[e,u,v] = Σ_{s ∈ u} x[src(e),s]          ∀ paired e, u
    edge_cols[e,v]:       Σ_u y[e,u,v] = Σ_{t ∈ v} x[dst(e),t]          ∀ paired e, v
    edge_forbidden[e,t]:  x[dst(e),t] = 0    folded e, R[e,u₀,class(t)] not allowed (mirrored)
    memory:               Σ_i n_i Σ_s m[i,s]·x[i,s] + h ≤ M             (bytes per device)
    held[w]:              h − Σ_{l ∈ w} H_l ≥ 0                         ∀ windows w (problem.held_windows)
    H_l = Σ_{e ∈ l} Σ_{u,v} held[e,u,v]·y[e,u,v]   (on the x of folded edges as above; once per
             copy of a layer the window names, not n_e): the weights layer l gathers for use.
             A window is the running layer and those prefetched with it (FSDP2 holds their
             unsharded weights together), so at the optimum h is the most any window holds.
    overlap_compute[g,φ]: z[g,φ] − f_g·C_gφ ≥ 0                         ∀ g, φ
    overlap_comm[g,φ]:    z[g,φ] − f_g·W_gφ ≥ 0                         ∀ g, φ
    fixed[i]:             x[i,s] = 1         problem.fixed (baselines pin parameters, inputs)
    excluded[i,s]:        x[i,s] = 0         problem.excluded

Rows and columns of y sum to one-hot vectors, so y is the outer product of the two choices
(the transportation polytope of two one-hot vectors has only that integer point). An edge
whose producer side has a single class u₀ is *folded*: its edge_rows row reads
Σ_v y = Σ_s x[src,s] = 1 (implied by one_strategy and edge_cols) and its edge_cols rows give
y[e,u₀,v] = Σ_{t ∈ v} x[dst,t] (0 where the pair is not allowed), so y is a linear function
of x — in the integer model and in its relaxation alike. Substituting it changes neither the
optimum nor the LP bound, and the edge needs no y (the same when the consumer side has one
class).

>>> from autopar.problem import Edge, ShardingProblem
>>> p = ShardingProblem(["a", "b"], [[1.0, 2.0], [1.0, 1.0]], [[0, 0], [0, 0]],
...                     [Edge(0, 1, [0, 1], [0, 0], [[0.0], [None]])], 1)
>>> f = Formulation(p)
>>> f.num_variables, f.objective_vars, f.objective_coeffs
(4, [0, 1, 2, 3], [1.0, 2.0, 1.0, 1.0])
>>> list(f.edge_consistency())
[Row(name='edge_forbidden[0,1]', vars=[1], coeffs=[1], lo=0, hi=0, exactly_one=False, unit=1.0, seconds=False)]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain

from autopar.problem import Edge, ShardingProblem


@dataclass(frozen=True, slots=True)
class Row:
    """``lo ≤ Σ_k coeffs[k]·var[vars[k]] ≤ hi``."""

    name: str  # family[index], e.g. "edge_rows[3,1]"
    vars: list[int]
    coeffs: list[float]
    lo: float
    hi: float
    exactly_one: bool = False  # a sum of 0/1 variables equal to 1 (CP-SAT has a constraint for that)
    unit: float = 1.0  # size of the row's unit (bytes: 2**30), for a floating-point backend to state it in
    # coefficients in seconds (an integer backend scales them as it scales the objective; a z
    # variable's coefficient is 1 and z itself is in the objective's units)
    seconds: bool = False


def summed(variables: list[int], coeffs: list) -> dict:
    """A row's terms with one coefficient per variable: a variable named twice (an overlap row
    takes an edge's forward and backward parts from the same variables) gets the sum of its
    coefficients, as CP-SAT's linear expressions do; zeros dropped. Both backends state rows
    this way (pywraplp's ``SetCoefficient`` kept only the last of a variable's coefficients)."""
    terms: dict = {}
    for v, c in zip(variables, coeffs):
        terms[v] = terms.get(v, 0) + c
    return {v: c for v, c in terms.items() if c}


class Formulation:
    """Variables, objective and constraint families of one problem. The families that depend
    on ``problem.fixed`` and ``problem.excluded`` take them as arguments, so one formulation
    serves the baselines (the same problem with other fixed placements).

    It keeps few Python objects: rows are made as a backend consumes them, with flat lists of
    numbers, and y are ranges of indices. Planning holds a large heap, and every object that
    outlives a garbage-collector pass makes full passes over that heap likelier (rows as lists
    of tuples, all made at once, made building the Llama-8B LPs ~60% slower)."""

    def __init__(self, problem: ShardingProblem) -> None:
        self.problem = problem
        self.x: list[list[int]] = []  # [i][s] -> variable
        self.num_x = 0
        for costs in problem.node_costs:
            self.x.append(list(range(self.num_x, self.num_x + len(costs))))
            self.num_x += len(costs)
        self.num_y = 0
        self.num_z = 0  # overlap z, counted once the edges' y are
        self.num_h = 0  # the held-weights peak h (bytes), after the z
        self._first_y: dict[int, int] = {}  # paired edge k -> its first y (its y are consecutive)
        # Σ objective_coeffs[k]·x[objective_vars[k]], in seconds; a variable may recur
        self.objective_vars: list[int] = []
        self.objective_coeffs: list[float] = []
        for i, costs in enumerate(problem.node_costs):
            self._cost(self.x[i], [problem.count(i) * c for c in costs])
        comm: dict[tuple[int, str], tuple[list[int], list[float]]] = {}  # (group, phase) -> weighted edge terms
        for k, e in enumerate(problem.edges):
            src_members, dst_members = e.members()
            weighted = _weighted(problem, e) if problem.overlaps and e.group >= 0 else None
            if _folded(src_members, dst_members):
                variables, costs = self._folded_costs(e, src_members, dst_members, e.cost)
                sides = [self._folded_costs(e, src_members, dst_members, w)[1] for w in weighted or ()]
            else:
                self._first_y[k] = self.num_variables
                pairs = self._pairs(k, e, src_members, dst_members)
                self.num_y += len(pairs)
                variables, costs = [y for _, _, y, _ in pairs], [e.count * cost for *_, cost in pairs]
                sides = [[e.count * w[u][v] for u, v, _, _ in pairs] for w in weighted or ()]
            self._cost(variables, costs)
            for phase, terms in zip(("forward", "backward"), sides):
                for var, c, w in zip(variables, costs, terms):
                    if c is not None:
                        _term(comm, (e.group, phase), var, w)
        # overlap: (group, phase, z, compute terms, weighted communication terms), each n·seconds
        self.overlap_groups: list[tuple[int, str, int, tuple[list[int], list[float]],
                                        tuple[list[int], list[float]]]] = []
        compute: dict[tuple[int, str], tuple[list[int], list[float]]] = {}
        for i, costs in enumerate(problem.node_costs):
            g = -1 if problem.node_group is None else problem.node_group[i]
            if (g, "forward") not in comm and (g, "backward") not in comm:
                continue
            own = problem.node_comm[i] if problem.node_comm is not None else [0.0] * len(costs)
            forward = problem.node_forward[i] if problem.node_forward is not None else [0.0] * len(costs)
            for var, c, o, f in zip(self.x[i], costs, own, forward):
                _term(compute, (g, "forward"), var, problem.count(i) * f)
                _term(compute, (g, "backward"), var, problem.count(i) * (c - o - f))
        for g, phase in sorted(comm):
            z = self.num_variables
            self.num_z += 1
            share = problem.hidden_share(g)  # f·max(C, W) = max(f·C, f·W): z stays a unit of the objective
            sides = tuple((variables, [share * c for c in costs])
                          for variables, costs in (compute.get((g, phase), ([], [])), comm[(g, phase)]))
            self.overlap_groups.append((g, phase, z, *sides))
            self._cost([z], [1.0])
            for variables, costs in sides:
                self._cost(variables, [-c for c in costs])
        # gathered weights: each layer's bytes on the x / y of its weights' edges, one copy of a
        # repeated layer (not n_e: its copies gather one after another)
        self.held_layers: dict[int, tuple[list[int], list[float]]] = {}
        for k, e in enumerate(problem.edges):
            if e.held is None or e.layer < 0:
                continue
            src_members, dst_members = e.members()
            if _folded(src_members, dst_members):
                variables, held = self._folded_costs(e, src_members, dst_members, _allowed(e.held, e.cost), count=1)
            else:
                pairs = self._pairs(k, e, src_members, dst_members)
                variables, held = [y for _, _, y, _ in pairs], [e.held[u][v] for u, v, _, _ in pairs]
            for var, b in zip(variables, held):
                if b:
                    _term(self.held_layers, e.layer, var, b)
        # held windows (problem.held_windows) whose layers gather something: each its layers' terms
        self.held_windows: list[tuple[tuple[int, ...], list[int], list[float]]] = []
        for window in problem.held_windows:
            variables, held = [], []
            for layer in window:
                found = self.held_layers.get(layer, ([], []))
                variables += found[0]
                held += found[1]
            if variables:
                self.held_windows.append((window, variables, held))
        self.h = None  # the most bytes a window holds (a variable only where one gathers)
        if self.held_windows:
            self.h = self.num_variables
            self.num_h = 1

    @property
    def num_variables(self) -> int:
        return self.num_x + self.num_y + self.num_z + self.num_h

    @property
    def num_binary(self) -> int:
        """x and y are 0/1; the z that follow them are continuous (seconds)."""
        return self.num_x + self.num_y

    def names(self) -> list[str]:
        """Every variable's name, in order."""
        names = [f"x[{n},{s}]" for n, row in zip(self.problem.node_names, self.x) for s in range(len(row))]
        for k in self._first_y:  # in index order
            e = self.problem.edges[k]
            names += [f"y[{k},{u},{v}]" for u, v, _, _ in self._pairs(k, e, *e.members())]
        return names + [f"z[{g},{phase}]" for g, phase, *_ in self.overlap_groups] + ["h"] * self.num_h

    def values(self, choice: list[int]) -> list[float]:
        """Every variable's value under ``choice`` (a strategy per node): x and y 0/1, each
        overlap z the larger of its group's compute and communication (seconds). A complete
        assignment: a solver hinted with it starts from a solution instead of completing one
        (CP-SAT on benchmarks/adapt.py's 10 Gbit/s problem: 0.9–2.2 s hinted whole against
        3.5–7.9 s hinted with x alone)."""
        values = [0.0] * self.num_variables
        for i, s in enumerate(choice):
            values[self.x[i][s]] = 1.0
        for k in self._first_y:
            e = self.problem.edges[k]
            chosen = (e.src_class[choice[e.src]], e.dst_class[choice[e.dst]])
            for u, v, y, _ in self._pairs(k, e, *e.members()):
                if (u, v) == chosen:
                    values[y] = 1.0
        for _g, _phase, z, *sides in self.overlap_groups:
            values[z] = max(sum(c for var, c in zip(*side) if values[var]) for side in sides)
        if self.h is not None:
            values[self.h] = max(sum(b for var, b in zip(variables, held) if values[var])
                                 for _, variables, held in self.held_windows)
        return values

    # -- constraint families -------------------------------------------------------------

    def one_strategy(self) -> Iterator[Row]:
        for name, row in zip(self.problem.node_names, self.x):
            yield Row(f"one_strategy[{name}]", row, [1] * len(row), 1, 1, exactly_one=True)

    def edge_consistency(self) -> Iterator[Row]:
        """edge_rows and edge_cols of paired edges; edge_forbidden of folded ones."""
        for k, e in enumerate(self.problem.edges):
            src_members, dst_members = e.members()
            if _folded(src_members, dst_members):
                node = e.dst if len(src_members) == 1 else e.src  # the side with several classes
                yield from (Row(f"edge_forbidden[{k},{var - self.x[node][0]}]", [var], [1], 0, 0)
                            for var, cost in zip(*self._folded_costs(e, src_members, dst_members, e.cost))
                            if cost is None)
                continue
            y_rows: dict[int, list[int]] = {u: [] for u in src_members}
            y_cols: dict[int, list[int]] = {v: [] for v in dst_members}
            for u, v, y, _ in self._pairs(k, e, src_members, dst_members):
                y_rows[u].append(y)
                y_cols[v].append(y)
            for name, ys, node, members in (("edge_rows", y_rows, e.src, src_members),
                                            ("edge_cols", y_cols, e.dst, dst_members)):
                for c, ss in members.items():
                    yield Row(f"{name}[{k},{c}]", ys[c] + [self.x[node][s] for s in ss],
                              [1] * len(ys[c]) + [-1] * len(ss), 0, 0)

    def memory(self) -> Iterator[Row]:
        """The memory row (none when no strategy holds memory)."""
        p = self.problem
        variables, coeffs = [], []
        for i, mems in enumerate(p.node_memory):
            variables += [var for var, m in zip(self.x[i], mems) if m]
            coeffs += [p.count(i) * m for m in mems if m]
        if self.h is not None:
            variables.append(self.h)
            coeffs.append(1)
        if variables:
            yield Row("memory", variables, coeffs, float("-inf"), p.memory_limit_bytes, unit=float(1 << 30))

    def overlap(self) -> Iterator[Row]:
        """overlap_compute[g,phase] and overlap_comm[g,phase]: z ≥ C and z ≥ W."""
        for g, phase, z, *sides in self.overlap_groups:
            for family, (variables, costs) in zip(("overlap_compute", "overlap_comm"), sides):
                yield Row(f"{family}[{g},{phase}]", [z, *variables], [1.0, *(-c for c in costs)], 0, float("inf"),
                          seconds=True)

    def held(self) -> Iterator[Row]:
        """held[w]: h ≥ the bytes window w's layers gather (bytes, as the memory row)."""
        for window, variables, held in self.held_windows:
            yield Row(f"held[{','.join(map(str, window))}]", [self.h, *variables], [1, *(-b for b in held)], 0,
                      float("inf"), unit=float(1 << 30))

    def fixed(self, fixed: dict[int, int]) -> Iterator[Row]:
        for i, s in fixed.items():
            yield Row(f"fixed[{self.problem.node_names[i]}]", [self.x[i][s]], [1], 1, 1)

    def excluded(self, excluded: frozenset[tuple[int, int]]) -> Iterator[Row]:
        for i, s in excluded:
            yield Row(f"excluded[{self.problem.node_names[i]},{s}]", [self.x[i][s]], [1], 0, 0)

    def rows(self, fixed: dict[int, int], excluded: frozenset[tuple[int, int]]) -> Iterator[Row]:
        """Every family, in order."""
        return chain(self.one_strategy(), self.edge_consistency(), self.memory(), self.held(), self.overlap(),
                     self.fixed(fixed), self.excluded(excluded))

    # -- edges ---------------------------------------------------------------------------

    def _folded_costs(self, e: Edge, src_members, dst_members, matrix, count: int | None = None
                      ) -> tuple[list[int], list[float | None]]:
        """A folded edge's cost (``matrix``: e.cost, or the part of it paid in forward) on the x
        of its other side: the variables, and n_e·R for each (None: not allowed; ``count``
        instead of n_e where given)."""
        if len(src_members) == 1:
            (u,) = src_members
            node, costs = e.dst, [matrix[u][v] for v, ts in dst_members.items() for _ in ts]
            order = [t for ts in dst_members.values() for t in ts]
        else:
            (v,) = dst_members
            node, costs = e.src, [matrix[u][v] for u, ss in src_members.items() for _ in ss]
            order = [s for ss in src_members.values() for s in ss]
        n = e.count if count is None else count
        return [self.x[node][s] for s in order], [None if c is None else n * c for c in costs]

    def _pairs(self, k: int, e: Edge, src_members, dst_members) -> list[tuple[int, int, int, float]]:
        """(u, v, y, R) for each allowed class pair of paired edge k."""
        allowed = [(u, v, e.cost[u][v]) for u in src_members for v in dst_members if e.cost[u][v] is not None]
        return [(u, v, self._first_y[k] + j, cost) for j, (u, v, cost) in enumerate(allowed)]

    def _cost(self, variables: list[int], costs: list[float | None]) -> None:
        """Objective terms (zero and forbidden ones left out)."""
        for var, c in zip(variables, costs):
            if c:
                self.objective_vars.append(var)
                self.objective_coeffs.append(c)


def _term(terms: dict, key, var: int, coeff: float) -> None:
    """Add ``coeff·var`` to ``terms[key]`` (zero terms left out)."""
    if coeff:
        variables, coeffs = terms.setdefault(key, ([], []))
        variables.append(var)
        coeffs.append(coeff)


def _weighted(problem: ShardingProblem, e: Edge) -> tuple[list[list[float | None]], list[list[float | None]]]:
    """Edge ``e``'s η-weighted overlappable seconds per class pair, forward and backward
    (ShardingProblem.weighted_parts; None where the pair is forbidden)."""
    rows = range(len(e.cost))
    parts = [[None if c is None else problem.weighted_parts(e, u, v)[2:] for v, c in enumerate(e.cost[u])]
             for u in rows]
    return tuple([[None if p is None else p[phase] for p in parts[u]] for u in rows] for phase in (0, 1))


def _allowed(matrix: list[list], cost: list[list]) -> list[list]:
    """``matrix`` where ``cost`` allows the pair, None elsewhere."""
    return [[None if c is None else m for m, c in zip(row, costs)] for row, costs in zip(matrix, cost)]


def _folded(src_members: dict, dst_members: dict) -> bool:
    """An edge with one class on a side needs no y."""
    return len(src_members) == 1 or len(dst_members) == 1
