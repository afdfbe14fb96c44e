"""One frozen value for every planning option, checked once where it is made.

The families read what concerns them (the pipeline its micro-batches and schedule, the
replicas their batch split); nothing is threaded through keyword arguments any more.

>>> PlanOptions(optimizer="sgd").optimizer
'sgd'
>>> PlanOptions(schedule="zigzag")
Traceback (most recent call last):
...
autopar.errors.AutoparError: [BAD_INPUT] unknown schedule 'zigzag'; choose one of auto, 1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopar.devices import MAX_DEVICES
from autopar.errors import AutoparError, ErrorKind
from autopar.planning.precision import Precision
from autopar.plan_types import PIPELINE_SCHEDULES
from autopar.passes.layer_recompute import is_recompute_mode
from autopar.passes.node_memory import OPTIMIZER_STATES
from autopar.solvers.baselines import CONFIGURATIONS

SCHEDULES = ("auto", *PIPELINE_SCHEDULES)  # auto: 1F1B or an interleaved schedule, the fastest
MAX_TIME_LIMIT_S = 7 * 24 * 3600.0  # a solver budget beyond a week is a typo (OR-Tools holds it in int64 ms)
RECOMPUTE = ("auto", "none", "selective", "full", "full:N", "block:K")  # every N-th layer (N ≥ 2); the first K
# hand-written configurations a person would write: costed beside every plan


@dataclass(frozen=True)
class PlanOptions:
    """What :func:`autopar.plan` was asked for (see its docstring for each option)."""

    optimizer: str = "adamw"
    solver: str = "cpsat"
    time_limit_s: float = 60.0
    mesh_shape: tuple[int, ...] | None = None
    # the most dims a searched mesh has: 1, 2 (the default: 1-D and 2-D meshes), or 3 (also
    # DP × (FSDP × TP) refinements of the best 2-D mesh; autopar.mesh.three_dim_refinements)
    mesh_dims: int = 2
    cluster_layers: bool = True
    pipeline: bool | None = None
    micro_batches: int | None = None
    schedule: str = "auto"
    replicas: bool | None = None
    batch_split: tuple[int, ...] | None = None
    configuration: str | None = None
    sparsity: dict[str, float] | None = field(default=None, hash=False)
    symbolic: bool = False
    mixed_precision: Precision | None = None  # checked by Precision.of where the user's value comes in
    # "none"; "selective" (every layer's cheap ops recomputed, matmuls and attention kept);
    # "full" (every layer recomputed whole); "full:N" (every N-th layer recomputed whole);
    # "block:K" (the first K layers recomputed whole); "auto": none where a plan fits, else
    # the faster of selective and full cut to block:K (planning.recompute_cut)
    recompute: str = "auto"
    # communication overlapped with compute where the device can (DeviceSpec.overlap_efficiency):
    # parameters' gathers and gradient reductions hide behind each layer's compute (issue 20)
    overlap: bool = True
    # the lowered program's gradient buckets (DistributedDataParallel's bucket_cap_mb, in MiB):
    # each is all-reduced asynchronously as soon as it is full
    bucket_cap_mb: float = 25.0
    # how many layers ahead the lowered program gathers a sharded weight (FSDP2 prefetches the
    # next layer's: 1); 0 gathers each where it is read, and the cost model exposes those gathers
    prefetch_layers: int = 1
    # cost the hand-written configurations (DDP, FSDP, Megatron …) beside the plan; a re-plan
    # skips them: it is asked for the new plan and what switching costs, fast
    baselines: bool = True
    # a plan of the same model to start from (autopar.replan): its mesh solved first, its
    # placements the solver's first incumbent there (not part of the options' identity)
    warm_start: Any = field(default=None, hash=False, compare=False)
    # lower bounds on some meshes' best step known before their problems are built (a re-plan
    # for links that changed speed: :class:`MeshBounds`); not part of the options' identity
    mesh_bounds: "MeshBounds | None" = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise AutoparError(ErrorKind.BAD_INPUT, f"unknown optimizer {self.optimizer!r}; choose one of "
                               f"{', '.join(OPTIMIZER_STATES)}")
        if self.configuration is not None and self.configuration not in CONFIGURATIONS:
            raise AutoparError(ErrorKind.BAD_INPUT, f"unknown configuration {self.configuration!r}; choose one of "
                               f"{', '.join(CONFIGURATIONS)}")
        if self.schedule not in SCHEDULES:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, Precision):
            raise AutoparError(ErrorKind.BAD_INPUT, "PlanOptions.mixed_precision takes a Precision; convert the "
                               "user's policy with Precision.of(policy)")
        if self.recompute != "auto" and not is_recompute_mode(self.recompute):
            raise AutoparError(ErrorKind.BAD_INPUT, f"unknown recompute {self.recompute!r}; choose one of "
                               f"{', '.join(RECOMPUTE)}")
        if not (isinstance(self.bucket_cap_mb, (int, float)) and 0 < self.bucket_cap_mb < float("inf")):
            raise AutoparError(ErrorKind.BAD_INPUT, f"bucket_cap_mb must be a positive number of MiB, got "
                               f"{self.bucket_cap_mb!r}")
        if not (isinstance(self.prefetch_layers, int) and not isinstance(self.prefetch_layers, bool)
                and self.prefetch_layers >= 0):
            raise AutoparError(ErrorKind.BAD_INPUT, f"prefetch_layers must be a whole number of layers (0 or more), "
                               f"got {self.prefetch_layers!r}")
        self._check_counts()
        if self.pipeline and self.replicas:
            raise AutoparError(ErrorKind.BAD_INPUT, "pipeline=True and replicas=True exclude each other; force one")

    def _check_counts(self) -> None:
        """The numeric options: a solver budget that OR-Tools can hold, whole positive counts."""
        limit = self.time_limit_s
        if not (_is_number(limit) and 0 < limit <= MAX_TIME_LIMIT_S):
            raise AutoparError(ErrorKind.BAD_INPUT, f"time_limit_s must be a number of seconds in (0, "
                               f"{MAX_TIME_LIMIT_S:,.0f}] (a week), got {limit!r}")
        if self.micro_batches is not None and not (_is_count(self.micro_batches) and self.micro_batches >= 1):
            raise AutoparError(ErrorKind.BAD_INPUT, f"micro_batches must be a whole number of 1 or more (or None: "
                               f"searched), got {self.micro_batches!r}")
        for name in ("mesh_shape", "batch_split"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (tuple, list)) or not value or not all(_is_count(v) and v >= 1 for v in value):
                example = "(2, 4)" if name == "mesh_shape" else "(6, 2)"
                raise AutoparError(ErrorKind.BAD_INPUT, f"{name} must be a tuple of whole numbers of 1 or more, e.g. "
                                   f"{example}; got {value!r}")
            object.__setattr__(self, name, tuple(value))  # a list works too; the options stay hashable
        if self.mesh_dims not in (1, 2, 3) or isinstance(self.mesh_dims, bool):
            raise AutoparError(ErrorKind.BAD_INPUT, f"mesh_dims must be 1, 2 or 3 (the most dims a searched mesh "
                               f"has), got {self.mesh_dims!r}")
        if self.mesh_shape is not None and math.prod(self.mesh_shape) > MAX_DEVICES:
            raise AutoparError(ErrorKind.BAD_INPUT, f"mesh_shape {self.mesh_shape} spans more than {MAX_DEVICES:,} "
                               "devices")

    @property
    def optimizer_states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]

    def forced(self, family: str) -> bool | None:
        """True when the caller forces ``family``, False when they rule it out, else None."""
        return {"pipeline": self.pipeline, "replicas": self.replicas}.get(family)

    @property
    def compute_dtype(self):
        """The dtype the model computes in under the policy; None: its own dtypes."""
        return None if self.mixed_precision is None else self.mixed_precision.compute_dtype

    def recorded(self) -> dict[str, Any]:
        """The options a plan records (``plan.options``); lowering reads the precision back."""
        recorded: dict[str, Any] = {"optimizer": self.optimizer}
        if self.mixed_precision is not None:
            recorded["mixed_precision"] = self.mixed_precision.to_plan()
        if not self.overlap:
            recorded["overlap"] = False
        if self.bucket_cap_mb != PlanOptions.bucket_cap_mb:
            recorded["bucket_cap_mb"] = self.bucket_cap_mb
        if self.prefetch_layers != PlanOptions.prefetch_layers:
            recorded["prefetch_layers"] = self.prefetch_layers
        if self.mesh_dims != PlanOptions.mesh_dims:  # a re-plan searches as many mesh dims
            recorded["mesh_dims"] = self.mesh_dims
        if self.configuration is not None:  # a pinned hand-written plan (a re-plan searches freely)
            recorded["configuration"] = self.configuration
        if self.micro_batches is not None:  # pinned by the user: a re-plan keeps the training setup
            recorded["micro_batches"] = self.micro_batches
        if self.schedule != PlanOptions.schedule:
            recorded["schedule"] = self.schedule
        return recorded

    @classmethod
    def of_plan(cls, plan, **overrides) -> "PlanOptions":
        """The options ``plan`` was made with, as far as it records them (optimizer, precision,
        overlap knobs, searched mesh dims, a pinned micro-batch count or pipeline schedule: what
        re-costing or re-planning it needs), and ``overrides``."""
        recorded = {"optimizer": plan.options.get("optimizer", cls.optimizer),
                    "overlap": plan.options.get("overlap", True),
                    "mixed_precision": Precision.from_plan(plan.options.get("mixed_precision")),
                    **{k: plan.options[k] for k in ("bucket_cap_mb", "prefetch_layers", "mesh_dims",
                                                    "micro_batches", "schedule") if k in plan.options}}
        return cls(**{**recorded, **overrides})

    def problem_overlap(self, device) -> dict[str, Any]:
        """passes.build_problem's overlap arguments on ``device``: its η (per collective kind
        where measured; none with overlap off), whether gathers are prefetched, the buckets,
        and how many layers' gathered weights are held at once (the running one and those
        prefetched: passes.prefetch and passes.reshard prefetch only where the plan overlaps)."""
        return {"overlap_efficiency": device.overlap_efficiency if self.overlap else 0.0,
                "collective_overlap": device.collective_overlap if self.overlap else (),
                "prefetch": self.prefetch_layers > 0, "bucket_bytes": int(self.bucket_cap_mb * 2**20),
                "held_layers": 1 + (self.prefetch_layers if self.overlap else 0)}


@dataclass(frozen=True)
class MeshBounds:
    """Lower bounds on the one-mesh search's step per mesh shape, valid on the cluster being
    planned before any problem is built there (autopar.planning.replan.known_bounds: an old
    search's bounds on a cluster whose links alone changed speed). They bound the searches of
    recompute mode ``recompute`` only: another mode is another problem. The search prunes a
    mesh whose bound is no better than its incumbent without building that mesh's problem.

    >>> MeshBounds("none", (((2, 8), 0.05),)).of("none"), MeshBounds("none", ()).of("full")
    ({(2, 8): 0.05}, {})
    """

    recompute: str
    bounds: tuple[tuple[tuple[int, ...], float], ...]

    def of(self, recompute: str) -> dict[tuple[int, ...], float]:
        """The bounds by mesh shape for a search of mode ``recompute`` (none for another mode)."""
        return dict(self.bounds) if recompute == self.recompute else {}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
