"""autopar: plan and apply tensor/data parallelism for a PyTorch model on a target cluster.

>>> import autopar
>>> plan = autopar.plan(model, (x,), cluster="4xA100-80GB")    # doctest: +SKIP
>>> pmodel = autopar.apply(model, plan)                         # doctest: +SKIP
"""

from autopar.errors import AutoparError, ErrorKind
from autopar.cluster import Cluster
from autopar.plan import Plan, load_plan
from autopar.api import apply, parallelize, plan
from autopar.parallel import ParallelModule

__all__ = ["AutoparError", "ErrorKind", "Cluster", "Plan", "load_plan", "plan", "apply", "parallelize",
           "ParallelModule"]
__version__ = "0.1.0"
