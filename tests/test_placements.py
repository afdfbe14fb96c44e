"""Placements are values (autopar.placements): parsed and written only at the edges, and no
module outside that one reads placement text."""

from __future__ import annotations

import ast
import copy
import pickle
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import autopar
from autopar import placements as pl
from autopar.errors import AutoparError, ErrorKind

ROOT = Path(__file__).resolve().parent.parent
_ONE = st.one_of(st.just("R"), st.just("P"), st.just("O"), st.just("D"),
                 st.integers(0, 12).map(lambda d: f"S({d})"), st.sampled_from(["P(max)", "P(avg)", "P(mask)"]))


@given(st.lists(_ONE, min_size=1, max_size=4))
def test_text_round_trips_and_values_are_interned(parts):
    text = ",".join(parts)
    spec = pl.parse_spec(text)
    assert pl.format_spec(spec) == text
    assert all(a is b for a, b in zip(spec, pl.parse_spec(text)))  # one object per placement
    assert all(copy.deepcopy(p) is p and pickle.loads(pickle.dumps(p)) is p for p in spec)


@given(st.lists(_ONE, min_size=2, max_size=6))
def test_values_sort_as_their_text_did(parts):
    """Candidate lists are sorted; plans keep the order they had when placements were strings."""
    assert [str(p) for p in sorted(map(pl.parse, parts))] == sorted(parts)


def test_kinds_and_fields():
    assert pl.parse("S(3)").is_shard and pl.parse("S(3)").dim == 3 and pl.parse("S(3)") is pl.Shard(3)
    assert pl.parse("P") is pl.P and pl.P.op == "sum" and pl.parse("P(max)").op == "max"
    assert pl.parse("P(max)").is_partial and not pl.R.is_partial and not pl.O.is_shard
    assert pl.split_over(pl.parse_spec("S(0),R,S(0)"), (2, 3, 4), 0) == 8
    assert pl.divided_over(pl.parse_spec("D,S(1),R"), (2, 3, 4)) == 6
    assert pl.owned_dim(pl.parse_spec("R,O")) == 1 and pl.owned_dim(pl.parse_spec("R,R")) is None
    assert pl.with_dim(pl.replicated(2), 1, pl.Shard(0)) == (pl.R, pl.Shard(0))
    assert pl.sharded_dims(pl.parse_spec("S(2),R,S(0)")) == [(0, 2), (2, 0)]
    with pytest.raises(AttributeError):
        pl.Shard(0).dim = 1


@pytest.mark.parametrize("text", ["", "S", "S(-1)", "S(x)", "Q", "R,,R", "r", "P()"])
def test_bad_text_names_what_is_expected(text):
    with pytest.raises(ValueError, match="expected R, S"):
        pl.parse_spec(text)


def test_comparing_with_a_string_is_an_error_not_silently_false():
    with pytest.raises(TypeError, match="parse it first"):
        _ = pl.R == "R"
    with pytest.raises(TypeError):
        _ = "S(0)" in (pl.Shard(0),)


def test_a_hand_edited_placement_fails_at_load_naming_the_field(tmp_path):
    import torch
    from models import MLP

    plan = autopar.plan(MLP(8, 16, 8, 2), (torch.randn(8, 8),), cluster="2xcpu", mesh_shape=(2,))
    fqn = next(iter(plan.parameters))
    text = plan.to_json().replace(f'"placement": "{plan.parameters[fqn].placement}"', '"placement": "S(x)"', 1)
    with pytest.raises(AutoparError) as bad:
        autopar.Plan.from_json(text, source="edited.json")
    assert bad.value.kind is ErrorKind.BAD_PLAN and "edited.json" in str(bad.value) and "'S(x)'" in str(bad.value)
    wide = plan.to_json().replace(f'"placement": "{plan.parameters[fqn].placement}"', '"placement": "R,R"', 1)
    with pytest.raises(AutoparError, match="for 2 mesh dims, but the plan's mesh \\[2\\] has 1"):
        autopar.Plan.from_json(wide, source="edited.json")


_PLACEMENT_TEXT = re.compile(r"^(R|O|D|P|S\(\d*|P\(\w*\)?)(,.*)?$")


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants in code (docstrings left out) that look like placement text."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and _PLACEMENT_TEXT.match(node.value)]


def test_no_module_outside_the_placement_module_reads_or_writes_placement_text():
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
             for folder in ("autopar", "passes", "solvers") for path in sorted((ROOT / folder).rglob("*.py"))
             if path != ROOT / "autopar" / "placements.py" for line, text in _code_strings(path)]
    assert not found, found
