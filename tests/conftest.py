import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (models, distributed) by name


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: spawns gloo processes (slow)")
