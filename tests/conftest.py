import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (models, distributed) by name

import zoo  # noqa: E402,F401  declares torchvision's operators where its CUDA build cannot load (zoo.py)


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: spawns gloo processes (slow)")
