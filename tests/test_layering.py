"""Import directions from DESIGN.md: solvers never import torch; passes never import solvers
or the face; the types layer never imports passes or solvers."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(folder: str) -> dict[str, set[str]]:
    found = {}
    for path in (ROOT / folder).glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[path.name] = names
    return found


def test_solvers_see_plain_problems_only():
    for name, mods in _imports("solvers").items():
        assert not any(m == "torch" or m.startswith("torch.") for m in mods), name
        assert not any(m.startswith("autopar.passes") for m in mods), name


def test_passes_do_not_import_solvers_or_the_face():
    face = {"autopar.api", "autopar.cli", "autopar.planner", "autopar.report"}
    for name, mods in _imports("passes").items():
        assert not any(m.startswith("autopar.solvers") for m in mods), name
        assert not mods & face, name


def test_types_layer_does_not_import_passes_or_solvers():
    types = {"errors.py", "devices.py", "cluster.py", "plan.py", "problem.py", "mesh.py", "comm.py", "units.py"}
    for name, mods in _imports("autopar").items():
        if name in types:
            assert not any(m.startswith(("autopar.passes", "autopar.solvers", "torch")) for m in mods), name
