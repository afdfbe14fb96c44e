"""The model captured once for every family: :class:`ModelGraphs`.

Families need the graph at different batch sizes (one mesh: the whole batch; pipeline
stages: one micro-batch; replica groups: each group's share), each with its sparse lookups
and expert groups annotated. Capturing is the slowest step of planning a small model, so
each batch size is captured and annotated once here and every family reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError, ErrorKind
from autopar.passes.capture import Captured, capture, leading_batch, normalize_inputs
from autopar.passes.experts import annotate_experts
from autopar.passes.sparse import annotate_lookups
from autopar.passes.strategies import MEMO_KEY

log = logging.getLogger(__name__)


class ModelGraphs:
    """``model`` on ``example_inputs`` (the global batch), captured on demand at any number of
    leading rows. The full batch is captured at construction, so an untraceable model fails
    at once. ``sparsity``: access densities of sparse tables (see :func:`autopar.plan`);
    ``compute_dtype``: the dtype a mixed-precision policy computes in (None: the model's own)."""

    def __init__(self, model: nn.Module, example_inputs, sparsity: dict[str, float] | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.model, self.sparsity, self.compute_dtype = model, sparsity, compute_dtype
        self._at_rows: dict[int, Captured] = {}
        self._derived: dict[Any, Any] = {}
        start = time.perf_counter()
        self.full = self._capture(example_inputs)  # checks the model, then the inputs
        self.inputs = normalize_inputs(example_inputs)
        self.capture_s = time.perf_counter() - start

    def at_rows(self, rows: int) -> Captured:
        """The graph at the first ``rows`` rows of every input (a micro-batch, a group's share)."""
        if rows == self.rows:
            return self.full
        if rows not in self._at_rows:
            self._at_rows[rows] = self._capture(tuple(x[:rows] for x in self.inputs))
        return self._at_rows[rows]

    @property
    def rows(self) -> int | None:
        """The whole batch's rows (the first input's leading size; None for a scalar input)."""
        return self.inputs[0].shape[0] if self.inputs and self.inputs[0].dim() else None

    @property
    def model_name(self) -> str:
        return type(self.model).__name__

    def batch_rows(self, splitter: str) -> int:
        """The batch ``splitter`` (pipeline micro-batches, replicas) cuts into rows: every
        input's leading size (passes.capture.leading_batch). Refused where an input holds the
        ids of bags of varying size (passes.embedding_bag.id_indexed): its length is the
        batch's id count, so a cut by rows would split bags."""
        from autopar.passes.embedding_bag import id_indexed

        by_id = id_indexed(self.full.graph)
        jagged = sorted(spec.name for spec in self.full.inputs if spec.name in by_id)
        if jagged:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"{splitter} cut every input by rows, but {', '.join(jagged)} "
                               f"{'holds' if len(jagged) == 1 else 'hold'} the ids of bags of varying size (the "
                               "length is the batch's id count, not its bag count): a cut by rows would split bags; "
                               "plan this model on one mesh (pipeline=False, replicas=False), where each bag stays "
                               "whole")
        return leading_batch(self.inputs, splitter)

    def lookups_of(self, plan) -> bool:
        """Whether these graphs' sparse lookups are costed from the ids ``plan`` was made
        with: the graphs it was made from (another capture may have other example ids)."""
        return self is plan.graphs

    def captured_rows(self) -> dict[int, Captured]:
        """The graphs captured so far at other batch sizes than the whole batch, by rows."""
        return dict(self._at_rows)

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``key`` for these graphs (e.g. the one-mesh search's
        prepared problems, which the winner's baselines reuse)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def derived_so_far(self, key: Any) -> Any | None:
        """What :meth:`derived` made for ``key``, or None when nothing was (nothing is made)."""
        return self._derived.get(key)

    def _capture(self, inputs) -> Captured:
        captured = capture(self.model, inputs, self.compute_dtype, stack_traces=False)  # lowering keeps them
        annotate_lookups(captured, inputs, self.sparsity)
        annotate_experts(captured, inputs)
        for node in captured.graph.nodes:  # strategies depend on the mesh shape only: every search
            node.meta[MEMO_KEY] = {}  # of this graph (recompute modes, other clusters) reuses them
        return captured
