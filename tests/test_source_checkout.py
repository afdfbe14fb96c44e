"""Python run in the checkout's root imports the source folder autopar/ (the working directory
comes first on sys.path), whose subpackages passes/ and solvers/ sit beside it: they resolve."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# without an editable install's import hook, as after `pip install .` (CI) or with nothing installed
SCRIPT = """
import sys
sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in repr(finder)]
import autopar.passes.capture, autopar.solvers.ilp
for line in (autopar.__file__, autopar.passes.__file__, autopar.passes.capture.__name__,
             autopar.solvers.ilp.__file__):
    print(line)
"""


def test_checkout_root_imports_passes_and_solvers():
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [os.path.join(ROOT, "autopar", "__init__.py"),
                                       os.path.join(ROOT, "passes", "__init__.py"), "autopar.passes.capture",
                                       os.path.join(ROOT, "solvers", "ilp.py")]
