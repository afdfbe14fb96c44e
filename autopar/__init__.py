"""autopar: plan and apply tensor/data parallelism for a PyTorch model on a target cluster.

>>> import autopar
>>> plan = autopar.plan(model, (x,), cluster="4xA100-80GB")    # doctest: +SKIP
>>> pmodel = autopar.apply(model, plan)                         # doctest: +SKIP
"""

import os as _os

# In a source checkout autopar.passes and autopar.solvers are the folders passes/ and solvers/
# beside autopar/ (pyproject's package-dir installs them under autopar). When this very folder
# is imported (python or pytest run in the checkout's root), search the root after it: the
# package's own folder comes first, so nothing at the root can shadow one of its modules.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "passes")) and all(
        _os.path.isfile(_os.path.join(_root, sub, "__init__.py")) for sub in ("passes", "solvers")):
    __path__.append(_root)
del _os, _root

from autopar.errors import AutoparError, ErrorKind
from autopar.cluster import Cluster
from autopar.plan import Plan, load_plan

del plan  # the submodule autopar.plan; the name is the planning function below


def __getattr__(name: str):
    """``plan``, ``replan``, ``save_graphs``, ``apply``, ``parallelize``, ``reshard``, ``watch_links`` and
    ``ParallelModule``, imported on first use: they bring torch.distributed, DTensor, torch.export and the solver, which
    reading a plan (``autopar show``) does not need."""
    if name in ("plan", "replan", "save_graphs", "apply", "parallelize", "reshard", "watch_links"):
        from autopar import api

        return getattr(api, name)
    if name == "ParallelModule":
        from autopar.parallel import ParallelModule

        return ParallelModule
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


__all__ = ["AutoparError", "ErrorKind", "Cluster", "Plan", "load_plan", "plan", "replan", "save_graphs", "apply",
           "parallelize", "reshard", "watch_links", "ParallelModule"]
__version__ = "0.1.0"
