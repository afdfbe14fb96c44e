"""The captured graphs of a plan, saved beside it: what ``autopar replan`` re-plans from
without the model (issue 24: a changed cluster needs no new trace).

One zip file (:func:`graphs_path`: ``plan.json`` → ``plan.graphs.zip``) holds each graph the
search captured — the whole batch, and the micro-batches or replica shares the families over
device groups used — as torch.export's own format (``torch.export.save``), with the facts
capture found beside the program (parameter names, tied weights, master dtypes) in a JSON
manifest. The weights are not saved: each is a stand-in of its shape and dtype, one element
of storage (a plan never reads a weight's values).

The ids each embedding lookup read in the example inputs (what its access density is costed
from, passes.sparse) are saved too, when the inputs had values. What it cannot hold, and then
the plan is saved without it (a re-plan takes the model): models with expert layers (their
routing is measured on the example inputs and modules batched at capture), and graphs torch's
serializer refuses. A re-plan that needs a graph at another number of rows (other device
groups after a host was lost) says that it needs the model.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import warnings
import zipfile

import torch

from autopar.errors import AutoparError, ErrorKind
from autopar.files import atomic_write_text, output_problem
from autopar.plan import TensorSpec
from autopar.passes.capture import Captured, fingerprint
from autopar.passes.experts import EXPERTS_KEY
from autopar.passes.sparse import LOOKUP_KEY
from autopar.passes.stack_experts import STACKED_KEY
from autopar.planning.graphs import ModelGraphs

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "autopar-graphs.json"
SUFFIX = ".graphs.zip"


def graphs_path(plan_path: str | os.PathLike) -> str:
    """Where the graphs of the plan saved at ``plan_path`` go: ``plan.json`` → ``plan.graphs.zip``."""
    path = os.fspath(plan_path)
    return (path[:-len(".json")] if path.endswith(".json") else path) + SUFFIX


def save_graphs(graphs: ModelGraphs, path: str | os.PathLike) -> str | None:
    """Write ``graphs`` (every batch size captured) to ``path``, whole or not at all; None
    when written, else why they cannot be (nothing is written then)."""
    reason = _unsavable(graphs)
    if reason is not None:
        return reason
    problem = output_problem(path)
    if problem:
        raise AutoparError(ErrorKind.BAD_INPUT, problem)
    captured_at = {graphs.rows: graphs.full, **graphs.captured_rows()}
    entries, programs = [], {}
    for rows, captured in sorted(captured_at.items()):
        name = f"rows-{rows}.pt2"
        try:
            programs[name] = _program_bytes(captured)
        except Exception as exc:  # torch's serializer raises many types; the plan stays usable without it
            return f"torch.export could not save the graph at {rows} rows ({type(exc).__name__}: {exc})"
        entries.append({"rows": rows, "file": name, "fingerprint": captured.fingerprint,
                        "inputs": [spec.to_json() for spec in captured.inputs],
                        "parameter_of": captured.parameter_of, "buffer_of": captured.buffer_of,
                        "aliases": {k: list(v) for k, v in captured.aliases.items()},
                        "master_itemsize": captured.master_itemsize, "frozen": sorted(captured.frozen)})
        ids = {}  # each lookup's ids, and where its bags start (bags of varying size) under "<name>/bags"
        for node in captured.graph.nodes:
            lookup = node.meta.get(LOOKUP_KEY)
            if lookup is not None and lookup.indices is not None:
                ids[node.name] = lookup.indices
                if lookup.bag_starts is not None:
                    ids[f"{node.name}/bags"] = lookup.bag_starts
        if ids:
            entries[-1]["lookup_ids"] = f"rows-{rows}-ids.pt"
            programs[entries[-1]["lookup_ids"]] = _tensors_bytes(ids)
    manifest = {"format": FORMAT_VERSION, "torch": torch.__version__, "model": graphs.model_name,
                "compute_dtype": _dtype_name(graphs.compute_dtype), "sparsity": graphs.sparsity,
                "example_inputs": [TensorSpec.of(f"input_{i}", x).to_json() for i, x in enumerate(graphs.inputs)],
                "graphs": entries}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for name, data in programs.items():
            archive.writestr(name, data)  # already compressed (a pt2 archive is a zip)
    atomic_write_text(path, buffer.getvalue())
    return None


def load_graphs(path: str | os.PathLike) -> "SavedGraphs":
    """The graphs saved at ``path`` (:func:`save_graphs`), each checked against the
    fingerprint it was saved with."""
    try:
        with zipfile.ZipFile(path) as archive:
            manifest = json.loads(archive.read(MANIFEST))
            if manifest.get("format") != FORMAT_VERSION:
                raise AutoparError(ErrorKind.BAD_PLAN, f"{os.fspath(path)} holds graphs of format "
                                   f"{manifest.get('format')!r}; this autopar reads format {FORMAT_VERSION}: "
                                   "re-plan with the model")
            captured = {entry["rows"]: _captured(archive.read(entry["file"]), entry, manifest, path)
                        for entry in manifest["graphs"]}
            ids = {entry["rows"]: torch.load(io.BytesIO(archive.read(entry["lookup_ids"])), weights_only=True)
                   for entry in manifest["graphs"] if "lookup_ids" in entry}
    except (OSError, zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise AutoparError(ErrorKind.BAD_PLAN, f"cannot read the saved graphs {os.fspath(path)!r} "
                           f"({type(exc).__name__}: {exc}); re-plan with the model instead") from exc
    return SavedGraphs(manifest, captured, ids, os.fspath(path))


class SavedGraphs(ModelGraphs):
    """:class:`ModelGraphs` read from a file: the batch sizes saved, and no model to capture
    another one (:meth:`at_rows` then says so)."""

    def __init__(self, manifest: dict, captured: dict[int, Captured], ids: dict[int, dict[str, torch.Tensor]],
                 path: str) -> None:
        self.model, self.path = None, path
        self.sparsity = manifest["sparsity"]
        self.compute_dtype = getattr(torch, manifest["compute_dtype"]) if manifest["compute_dtype"] else None
        self.inputs = tuple(torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device="meta")
                            for spec in manifest["example_inputs"])
        self.saved_model_name = manifest["model"]
        rows = self.inputs[0].shape[0] if self.inputs and self.inputs[0].dim() else None
        annotated = {r: _annotated(c, self.sparsity, ids.get(r, {})) for r, c in captured.items()}
        self.full = annotated.pop(rows)
        self._at_rows = annotated
        self._derived = {}
        self.capture_s = 0.0

    @property
    def model_name(self) -> str:
        return self.saved_model_name

    def lookups_of(self, plan) -> bool:
        """The file saved beside ``plan`` holds the ids it was made with (each graph's
        fingerprint is checked against the plan's by the re-plan). A file of the same model
        saved from other example ids would be taken for it: the files are written in pairs."""
        return self.full.fingerprint == plan.fingerprint or any(
            c.fingerprint == plan.fingerprint for c in self._at_rows.values())

    def _capture(self, inputs) -> Captured:
        rows = inputs[0].shape[0] if inputs and inputs[0].dim() else None
        saved = sorted({self.rows, *self._at_rows})
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"this re-plan needs the graph at {rows} rows, and {self.path} holds it at {saved} rows "
                           "(those the first search used; another cluster may cut the batch otherwise): pass the "
                           "model and its example inputs, e.g. autopar replan plan.json MODEL --cluster ...")


def _annotated(captured: Captured, sparsity, ids: dict[str, torch.Tensor]) -> Captured:
    """``captured`` annotated as ModelGraphs annotates a capture, each lookup with the ids it
    read in the example inputs (``ids``: by lookup node)."""
    from autopar.passes.sparse import annotate_lookups
    from autopar.passes.strategies import MEMO_KEY

    annotate_lookups(captured, None, sparsity)
    for node in captured.graph.nodes:
        if node.name in ids:
            node.meta[LOOKUP_KEY].indices = ids[node.name]
            node.meta[LOOKUP_KEY].bag_starts = ids.get(f"{node.name}/bags")
        node.meta[MEMO_KEY] = {}
    return captured


def _tensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    data = io.BytesIO()
    torch.save(tensors, data)
    return data.getvalue()


def _unsavable(graphs: ModelGraphs) -> str | None:
    """Why ``graphs`` cannot be saved, or None."""
    for captured in (graphs.full, *graphs.captured_rows().values()):
        for node in captured.graph.nodes:
            if EXPERTS_KEY in node.meta or STACKED_KEY in node.meta:
                return f"{graphs.model_name} has expert layers, whose routing comes from the example inputs (not saved)"
    return None


def _program_bytes(captured: Captured) -> bytes:
    """``captured.program`` as torch.export.save writes it, the weights as stand-ins. The
    program itself is not changed: a shallow copy gets the signature (capture's passes renamed
    outputs the signature still names) and the stand-ins."""
    program = captured.program
    outputs = torch.utils._pytree.tree_flatten(program.graph.output_node().args)[0]
    signature = copy.deepcopy(program.graph_signature)
    if len(outputs) != len(signature.output_specs):
        raise ValueError(f"{len(outputs)} graph outputs, {len(signature.output_specs)} in the signature")
    for spec, node in zip(signature.output_specs, outputs):
        if isinstance(node, torch.fx.Node) and isinstance(spec.arg, torch.export.graph_signature.TensorArgument):
            spec.arg = torch.export.graph_signature.TensorArgument(name=node.name)
    saved = copy.copy(program)
    saved._graph_signature = signature
    saved._state_dict = {name: _stand_in(value) for name, value in program.state_dict.items()}
    saved._constants = {name: _stand_in(value) if isinstance(value, torch.Tensor) else value
                        for name, value in program.constants.items()}
    saved._example_inputs = None
    data = io.BytesIO()
    with warnings.catch_warnings():  # the stand-ins share no storage with a "complete" tensor: torch says so
        warnings.filterwarnings("ignore", message="No complete tensor found")
        torch.export.save(saved, data)
    return data.getvalue()


def _stand_in(value: torch.Tensor) -> torch.Tensor:
    """A tensor of ``value``'s shape and dtype on one element of CPU storage."""
    stand_in = torch.zeros((), dtype=value.dtype, device="cpu").expand(value.shape)  # a file holds no device
    return torch.nn.Parameter(stand_in, requires_grad=value.requires_grad) \
        if isinstance(value, torch.nn.Parameter) else stand_in


def _captured(data: bytes, entry: dict, manifest: dict, path) -> Captured:
    """One saved graph as capture made it (checked by its fingerprint)."""
    try:
        program = torch.export.load(io.BytesIO(data))
    except Exception as exc:  # torch's deserializer raises many types
        raise AutoparError(ErrorKind.BAD_PLAN, f"{os.fspath(path)}: torch.export cannot read the graph at "
                           f"{entry['rows']} rows ({type(exc).__name__}: {exc}; torch {manifest['torch']} saved it, "
                           f"this is {torch.__version__}): re-plan with the model") from exc
    graph = program.graph
    graph.eliminate_dead_code()  # the loader adds a getitem for each unused output of a multi-output op
    for node in graph.nodes:  # and gives tuples where an op returns a list (split_with_sizes)
        if node.op == "call_function" and isinstance(node.meta.get("val"), tuple) and _returns_list(node.target):
            node.meta["val"] = list(node.meta["val"])
    graph.output_node().meta.pop("val", None)
    program.graph_module.recompile()
    found = fingerprint(graph)
    if found != entry["fingerprint"]:
        raise AutoparError(ErrorKind.BAD_PLAN, f"{os.fspath(path)}: the graph at {entry['rows']} rows reads back as "
                           f"another graph (fingerprint {found}, saved {entry['fingerprint']}; torch "
                           f"{manifest['torch']} saved it, this is {torch.__version__}): re-plan with the model")
    captured = Captured(program, [TensorSpec.from_json(spec) for spec in entry["inputs"]], entry["parameter_of"],
                        entry["buffer_of"], found, {k: tuple(v) for k, v in entry["aliases"].items()})
    captured.master_itemsize = entry["master_itemsize"]
    captured.frozen = frozenset(entry.get("frozen", ()))  # files saved before frozen parameters: none
    captured.compute_dtype = getattr(torch, manifest["compute_dtype"]) if manifest["compute_dtype"] else None
    return captured


def _returns_list(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and len(schema.returns) == 1 and str(schema.returns[0].type).startswith("List")


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
