"""Reading a plan file's JSON before it becomes a :class:`autopar.plan.Plan`: the document
checks that name what is wrong (invalid JSON, a key given twice, no or another schema
version), the upgrade of version-1 plans, and the check that every stored placement reads as
one placement per mesh dim. Kept apart from the plan's dataclasses so that they read as the
schema they are.

>>> read_plan_document('{"schema_version": 2}', "p.json", 2)
{'schema_version': 2}
"""

from __future__ import annotations

import json
from typing import Any

from autopar import placements as pl
from autopar.errors import AutoparError, ErrorKind

_RECREATE = "re-create the plan with `autopar.plan(...).save(path)`"


def read_plan_document(text: str, source: str, version_read: int) -> dict:
    """The JSON object of a plan file at schema ``version_read`` (a version-1 file upgraded;
    its ``schema_version`` then reads ``version_read``), or BAD_PLAN saying what is wrong."""
    try:
        d = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise AutoparError(ErrorKind.BAD_PLAN,
                           f"{source} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
                           f"(byte {exc.pos}); re-create it with `autopar.plan(...).save(path)`") from exc
    except _DuplicateKey as exc:
        raise AutoparError(ErrorKind.BAD_PLAN,
                           f"{source}: key {exc.args[0]!r} appears twice in one object (JSON readers keep only "
                           f"one, silently); {_RECREATE}") from exc
    if not isinstance(d, dict):
        raise AutoparError(ErrorKind.BAD_PLAN, f"{source} holds a JSON {type(d).__name__}, not a plan object")
    if "schema_version" not in d:
        raise AutoparError(ErrorKind.BAD_PLAN, f"{source} has no schema_version: it is not an autopar plan file, "
                           "or a damaged one; re-create it with `autopar.plan(...).save(path)`")
    version = d["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise AutoparError(ErrorKind.BAD_PLAN, f"{source}: field schema_version should be an integer, not "
                           f"{version!r}; {_RECREATE}")
    if version == 1 and version_read == 2:
        return {**_from_version_1(d), "schema_version": version_read}
    if version != version_read:
        hint = "upgrade autopar" if version > version_read else "re-plan the model"
        raise AutoparError(ErrorKind.BAD_PLAN,
                           f"{source} has plan schema version {version!r}; this autopar reads version "
                           f"{version_read}: {hint}")
    return d


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    found = {}
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(key)
        found[key] = value
    return found


def check_placements(plan: Any, source: str) -> None:
    """Every placement ``plan`` (an autopar.plan.Plan; this module comes before it) holds reads as one placement per mesh dim (a hand-edited file
    fails here, naming the field, not deep inside lowering)."""
    where = [(f"parameter {fqn}", p.placement) for fqn, p in plan.parameters.items()]
    where += [(f"parameter {fqn} optimizer_state", p.optimizer_state) for fqn, p in plan.parameters.items()
              if p.optimizer_state is not None]
    where += [(f"buffer {name}", text) for name, text in plan.buffers.items()]
    where += [(f"output {k}", text) for k, text in enumerate(plan.outputs)]
    for name, node in plan.nodes.items():
        where += [(f"node {name} output {k}", text) for k, text in enumerate(node.outputs) if text is not None]
        where += [(f"node {name} input {k}", text) for k, text in enumerate(node.inputs)]
    for what, text in where:
        try:
            spec = pl.parse_spec(text)
        except (ValueError, AttributeError) as exc:
            raise AutoparError(ErrorKind.BAD_PLAN, f"{source}: {what} has placement {text!r}: {exc}; "
                               f"{_RECREATE}") from exc
        if plan.stages == () and plan.replicas == () and len(spec) != len(plan.mesh_shape):
            raise AutoparError(ErrorKind.BAD_PLAN, f"{source}: {what} has placement {text!r} for {len(spec)} mesh "
                               f"dims, but the plan's mesh {list(plan.mesh_shape)} has {len(plan.mesh_shape)}")


_FAMILIES_V1 = {"uniform_mesh": "one_mesh", "pipeline": "pipeline", "replicas": "replicas"}


def _from_version_1(d: dict) -> dict:
    """A version-1 plan as version 2: its family from the fields it sets, the planner's own
    families moved out of its baselines (version 1 listed them there as uniform_mesh,
    pipeline, replicas)."""
    baselines = d.get("baselines")
    if not isinstance(baselines, dict):
        return d  # malformed: reported by the field checks that follow
    family = "pipeline" if d.get("stages") else "replicas" if d.get("replicas") else "one_mesh"
    stage_fields = ("group", "device", "ranks", "mesh_shape", "mesh_dim_names", "memory")
    stages = [{k: v for k, v in st.items() if k not in ("batch", "fingerprint")} for st in d.get("stages", ())]
    replicas = [{**{k: r[k] for k in (*stage_fields, "batch", "fingerprint")}, "step_s": r["compute_s"],
                 "sync_s": r["send_s"]} for r in d.get("replicas", ())]  # version 1 held them as stages
    return {**d, "family": family, "stages": stages, "replicas": replicas,
            "baselines": {k: v for k, v in baselines.items() if k not in _FAMILIES_V1},
            "families": {_FAMILIES_V1[k]: v for k, v in baselines.items() if k in _FAMILIES_V1}}
