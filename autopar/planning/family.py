"""The interface every candidate family implements, and the registry of families.

A family is one way to spread a training step over a cluster: one mesh over every device,
pipeline stages over device groups, data-parallel replicas on the groups — and whatever a
later issue adds (one module implementing :class:`Family`, registered in
``autopar.planning.FAMILIES``). The chooser (``autopar.planning.choose``) asks each family
whether it can serve the cluster, plans the ones that can, and keeps the fastest; lowering
dispatches on ``plan.family``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import nn

    from autopar.cluster import Cluster
    from autopar.parallel import ParallelModule
    from autopar.passes.capture import Captured
    from autopar.plan import Plan
    from autopar.planning.graphs import ModelGraphs
    from autopar.planning.options import PlanOptions


class Family(Protocol):
    name: str  # what plan.family records, e.g. "one_mesh"

    def unavailable(self, cluster: "Cluster", options: "PlanOptions") -> str | None:
        """Why this family cannot serve ``cluster`` under ``options`` (None when it can)."""

    def plan(self, graphs: "ModelGraphs", cluster: "Cluster", options: "PlanOptions") -> "Plan":
        """The family's best plan; raises AutoparError (INFEASIBLE_MEMORY when nothing fits,
        BAD_INPUT when the model does not suit it: too few layers, an unsplittable batch …)."""

    def lower(self, plan: "Plan", model: "nn.Module", loss_fn: Callable | None,
              captured: "Captured | None" = None) -> "ParallelModule":
        """The plan on ``model`` in the current process group (``captured``: the model's
        graph at the plan's inputs, when the caller already has it)."""
