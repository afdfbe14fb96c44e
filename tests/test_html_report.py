"""The HTML report: self-contained, expected sections and figures, loads in a real browser."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch

import autopar
from autopar.html_report import render, write
from models import GPT, tiny_gpt

ARTIFACTS = os.path.join(os.path.dirname(__file__), "artifacts")


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.headings, self.sources, self._in_h = [], [], False

    def handle_starttag(self, tag, attrs):
        self._in_h = tag in ("h1", "h2")
        self.sources += [v for k, v in attrs if k in ("src", "href")]

    def handle_data(self, data):
        if self._in_h:
            self.headings.append(data.strip())

    def handle_endtag(self, tag):
        self._in_h = False


@pytest.fixture(scope="module")
def plan():
    return autopar.plan(GPT(layers=2), (torch.randint(0, 64, (4, 8)),), cluster="2xH100")


@pytest.fixture(scope="module")
def pipeline_plan():
    model, inputs = tiny_gpt()
    cluster = os.path.join(os.path.dirname(__file__), "clusters", "four_cpu_regions.yaml")
    return autopar.plan(model, inputs, cluster=cluster, pipeline=True)


def test_report_draws_the_pipeline_schedule(pipeline_plan):
    page = render(pipeline_plan)
    parser = _Collect()
    parser.feed(page)
    assert parser.sources == []
    assert "Pipeline schedule" in parser.headings
    stages, micro_batches = len(pipeline_plan.stages), pipeline_plan.micro_batches
    assert stages == 2 and page.count('class="mb"') == 2 * stages * micro_batches  # a forward and a backward each
    assert "imbalance (max/mean over devices)" in page
    for st in pipeline_plan.stages:  # every stage's devices are listed with that stage's memory (one row each)
        label = f"device {st.ranks[0]}" if len(st.ranks) == 1 else f"devices {st.ranks[0]}–{st.ranks[-1]}"
        assert f"<td>{label}" in page and f"({st.group})</td>" in page


def test_report_collapses_identical_devices_and_scales_small_models(plan):
    """One row for the mesh's identical devices, with their count; a model using a sliver of
    an H100 gets bars spanning its own size (the limit would leave them a pixel wide); the
    sparse and expert tables are HTML tables, not preformatted text."""
    page = render(plan)
    assert page.count("<td>devices 0–1 (×2)</td>") == 1
    assert "bars span the fullest device" in page
    assert "<pre" not in page


def test_report_is_self_contained_with_expected_sections(plan):
    page = render(plan)
    parser = _Collect()
    parser.feed(page)
    assert parser.sources == []  # nothing fetched from anywhere
    for heading in ("Memory per device", "Time per step", "Baselines", "Parameter placements by layer",
                    "Graph (ops in order, coloured by output placement)"):
        assert heading in parser.headings, heading
    assert "(2 identical)" in page  # the two GPT blocks are shown once
    assert "ddp" in page and "fsdp" in page
    from autopar.report import throughput
    rates = throughput(plan)  # the practitioners' figures, as `show` and --json give them
    assert f"predicted {rates['tokens_per_s_per_device']:,.0f} tokens/s per device, MFU " \
           f"{100 * rates['predicted_mfu']:.1f}%" in page


def test_report_in_headless_chromium(plan, pipeline_plan, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian chromium is not installed (.ci/run installs it where apt-get is available)")
    path = tmp_path / "report.html"
    write(plan, str(path))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run([browser, *flags, "--dump-dom", f"file://{path}"], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Memory per device" in dom.stdout and "Parameter placements by layer" in dom.stdout
    assert "Uncaught" not in dom.stderr and "CONSOLE" not in dom.stderr
    piped = tmp_path / "pipeline.html"
    write(pipeline_plan, str(piped))
    dom = subprocess.run([browser, *flags, "--dump-dom", f"file://{piped}"], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0 and "Pipeline schedule" in dom.stdout and "bubble" in dom.stdout, dom.stderr[-2000:]
    assert "Uncaught" not in dom.stderr and "CONSOLE" not in dom.stderr
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "report.png")
    done = subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1200,1600", f"file://{path}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and os.path.getsize(shot) > 10_000, done.stderr[-2000:]
    shot = os.path.join(ARTIFACTS, "pipeline_report.png")
    done = subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1200,1600", f"file://{piped}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and os.path.getsize(shot) > 10_000, done.stderr[-2000:]


def test_sparse_tables_are_html_tables():
    from models import DLRM, dlrm_inputs

    model = DLRM()
    plan = autopar.plan(model, dlrm_inputs(model, 16), cluster="2xH100")
    assert plan.sparse
    page = render(plan)
    section = page[page.index("<h2>Sparse tables</h2>"):]
    assert section.startswith("<h2>Sparse tables</h2><table><caption>")
    for fqn in plan.sparse:
        assert f"<td>{fqn}</td>" in section
