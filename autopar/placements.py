"""Placements as values: how one tensor lies on one mesh dimension, and on a whole mesh.

The planner's vocabulary is DTensor's (``Replicate``, ``Shard(d)``, ``Partial(op)``) plus two
placements of its own that DTensor has no type for:

* ``Owned`` ("O"): on this mesh dim each expert weight of a ModuleList, or each table-wise
  embedding table, lives whole on one device, its owner (passes.stack_experts, passes.sparse);
* ``Dispatched`` ("D"): the ids of a gathered-experts layer, split by rows on this mesh dim and
  exchanged with their experts' owners (passes.expert_dispatch).

A placement *spec* is one placement per mesh dim, a tuple. Plan files and reports write specs
as short strings (``"S(0),R"``) so people can read and diff them; :func:`parse_spec` and
:func:`format_spec` are the only places those strings are read or written.

Values are interned (one object per distinct placement), so comparing them is as cheap as
comparing the strings they replace, copies stay the same object, and they order by their text,
which keeps every sorted candidate list — and so every plan — in the order it always had.
Comparing a placement with a string is a bug (it would always be unequal) and raises.

>>> parse_spec("S(0),R") == (Shard(0), R)
True
>>> format_spec((Partial(), Shard(1), O)), str(Partial("max"))
('P,S(1),O', 'P(max)')
>>> split_over(parse_spec("S(0),S(0)"), (2, 4), 0), divided_over(parse_spec("S(1),O"), (2, 4))
(8, 8)
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Optional

_SHARD = re.compile(r"^S\((\d+)\)$")
_PARTIAL = re.compile(r"^P\(([a-z_]+)\)$")


class Placement:
    """One mesh dim's placement; immutable and interned (build with the names below)."""

    __slots__ = ("_text",)
    _interned: dict[str, "Placement"] = {}

    def __new__(cls, *args):
        text = cls._format(*args)
        known = Placement._interned.get(text)
        if known is None:
            known = object.__new__(cls)
            object.__setattr__(known, "_text", text)
            cls._init(known, *args)
            Placement._interned[text] = known
        return known

    @staticmethod
    def _format(*args) -> str:
        raise NotImplementedError

    def _init(self, *args) -> None:
        pass

    def __setattr__(self, name, value):
        raise AttributeError(f"placements are immutable ({self._text})")

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return self._text

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            raise TypeError(f"comparing placement {self._text} with the string {other!r}: parse it first")
        return self is other

    def __hash__(self) -> int:  # the text's: sets iterate as they did over the strings
        return hash(self._text)

    def __lt__(self, other: "Placement") -> bool:  # by text: candidate lists keep their order
        return self._text < other._text

    def __le__(self, other: "Placement") -> bool:
        return self._text <= other._text

    def __gt__(self, other: "Placement") -> bool:
        return self._text > other._text

    def __ge__(self, other: "Placement") -> bool:
        return self._text >= other._text

    def __reduce__(self):
        return (parse, (self._text,))

    @property
    def is_shard(self) -> bool:
        return False

    @property
    def is_partial(self) -> bool:
        return False


class Replicate(Placement):
    """The whole tensor on every device of the mesh dim ("R")."""

    __slots__ = ()

    @staticmethod
    def _format() -> str:
        return "R"


class Shard(Placement):
    """Tensor dim ``dim`` split evenly over the mesh dim ("S(d)")."""

    __slots__ = ("dim",)

    @staticmethod
    def _format(dim: int) -> str:
        if not isinstance(dim, int) or dim < 0:
            raise ValueError(f"Shard needs a tensor dim >= 0, got {dim!r}")
        return f"S({dim})"

    def _init(self, dim: int) -> None:
        object.__setattr__(self, "dim", dim)

    @property
    def is_shard(self) -> bool:
        return True


class Partial(Placement):
    """Each device holds a partial result to be reduced with ``op`` ("P" for a sum, "P(op)")."""

    __slots__ = ("op",)

    @staticmethod
    def _format(op: str = "sum") -> str:
        return "P" if op == "sum" else f"P({op})"

    def _init(self, op: str = "sum") -> None:
        object.__setattr__(self, "op", op)

    @property
    def is_partial(self) -> bool:
        return True


class Owned(Placement):
    """Each tensor of a group whole on one device of the mesh dim, its owner ("O")."""

    __slots__ = ()

    @staticmethod
    def _format() -> str:
        return "O"


class Dispatched(Placement):
    """Rows split on the mesh dim and exchanged with their experts' owners ("D")."""

    __slots__ = ()

    @staticmethod
    def _format() -> str:
        return "D"


R = Replicate()
P = Partial()
O = Owned()  # noqa: E741 - the plan files' own letter
D = Dispatched()
Spec = tuple[Placement, ...]


def parse(text: str) -> Placement:
    """One placement from its text: ``R``, ``S(d)``, ``P``, ``P(op)``, ``O``, ``D``."""
    known = Placement._interned.get(text)
    if known is not None:
        return known
    if (m := _SHARD.match(text)) is not None:
        return Shard(int(m.group(1)))
    if (m := _PARTIAL.match(text)) is not None:
        return Partial(m.group(1))
    raise ValueError(f"unknown placement {text!r}: expected R, S(<dim>), P, P(<op>), O or D")


def parse_spec(text: str) -> Spec:
    """A mesh-wide placement from a plan's text: ``"S(0),R"`` -> ``(Shard(0), R)``."""
    return tuple(parse(part) for part in text.split(","))


def format_spec(spec: Optional[Iterable[Placement]]) -> Optional[str]:
    """A mesh-wide placement as plans write it (``"S(0),R"``); None stays None."""
    return None if spec is None else ",".join(p._text for p in spec)


def replicated(ndim: int) -> Spec:
    """Replicated on every one of ``ndim`` mesh dims."""
    return (R,) * ndim


def with_dim(spec: Spec, mesh_dim: int, placement: Placement) -> Spec:
    """``spec`` with mesh dim ``mesh_dim`` placed ``placement`` instead."""
    return spec[:mesh_dim] + (placement,) + spec[mesh_dim + 1:]


def is_replicated(spec: Iterable[Placement]) -> bool:
    return all(p is R for p in spec)


def sharded_dims(spec: Iterable[Placement]) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of every ``Shard`` in ``spec``, in mesh-dim order."""
    return [(k, p.dim) for k, p in enumerate(spec) if p.is_shard]


def split_over(spec: Iterable[Placement], mesh_shape: Iterable[int], tensor_dim: int) -> int:
    """How many devices ``spec`` splits tensor dim ``tensor_dim`` over."""
    return math.prod(size for size, p in zip(mesh_shape, spec) if p.is_shard and p.dim == tensor_dim)


def divides(placement: Placement) -> bool:
    """Whether a mesh dim placed so divides a tensor's bytes among its devices: ``Shard``,
    ``Owned`` (each tensor of the group on one of them) or ``Dispatched`` (rows split)."""
    return placement.is_shard or placement is O or placement is D


def divided_over(spec: Iterable[Placement], mesh_shape: Iterable[int]) -> int:
    """Devices a tensor's bytes are divided over (the product of the dims that divide it)."""
    return math.prod(size for p, size in zip(spec, mesh_shape) if divides(p))


def index_of(spec: Iterable[Placement], placement: Placement) -> Optional[int]:
    """The first mesh dim placed ``placement``, or None."""
    return next((k for k, p in enumerate(spec) if p is placement), None)


def owned_dim(spec: Iterable[Placement]) -> Optional[int]:
    """The mesh dim placed ``Owned``, or None."""
    return index_of(spec, O)
