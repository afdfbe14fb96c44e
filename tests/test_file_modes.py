"""Plan files and reports get the mode the user's umask gives any new file (0644 under 022), not
the temp file's private 0600; the write stays atomic."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import autopar
from autopar.html_report import write
from models import MLP


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_saved_plan_and_report_follow_the_umask(tmp_path, umask, mode):
    plan = autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100")
    old = os.umask(umask)
    try:
        plan.save(tmp_path / "plan.json")
        write(plan, str(tmp_path / "report.html"))
    finally:
        os.umask(old)
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in tmp_path.iterdir()} == {
        "plan.json": oct(mode), "report.html": oct(mode)}  # and no temp file left beside them
