"""Watching the links at run time (issue 24, item 2): the watcher's decisions on scripted
readings, and a bandwidth drop on a real gloo link (a sleep in the lane) detected, re-planned
and handed to the hook."""

from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar import AutoparError
from autopar.cluster import Cluster
from autopar.planning.watch import LinkWatcher
from distributed import run_world

HERE = os.path.dirname(__file__)
TWO_REGIONS = os.path.join(HERE, "clusters", "two_cpu_regions.yaml")  # a-b: 1 GB/s, 1 ms


def _pipeline_plan():
    from models import tiny_gpt

    model, inputs = tiny_gpt()
    return autopar.plan(model, inputs, cluster=TWO_REGIONS, pipeline=True), model, inputs


def _scripted(times):
    """A probe returning the given one-way seconds, one check after another."""
    queue = list(times)
    return lambda pairs, nbytes: [queue.pop(0)] * len(pairs)


def test_a_link_off_for_patience_checks_calls_the_hook_once_with_the_measured_bandwidth():
    plan, _, _ = _pipeline_plan()
    cluster = Cluster.from_spec(TWO_REGIONS)
    nbytes = 1 << 20
    on_time = 1e-3 + nbytes / 1e9  # latency + bytes at the planned 1 GB/s
    ten_times_slower = 1e-3 + 10 * nbytes / 1e9
    calls, replans = [], []

    def replan(old, changed):
        replans.append(changed)
        return "answer"

    watcher = LinkWatcher(plan, cluster, lambda c, a: calls.append((c, a)), replan, every=2, threshold=0.5,
                          patience=2, probe_bytes=nbytes,
                          probe=_scripted([on_time, ten_times_slower, on_time, ten_times_slower, ten_times_slower,
                                           ten_times_slower]))
    answers = [watcher.after_step() for _ in range(12)]
    assert answers == [None] * 9 + ["answer", None, None]  # checks at steps 2, 4 … 12; off at 4, 8, 10
    assert len(calls) == 1 and calls[0][1] == "answer"
    measured = calls[0][0].wan_link("a", "b").bandwidth_Bps
    assert measured == pytest.approx(1e8, rel=1e-6)  # the drifted link at what it measured, 100 MB/s
    assert watcher.cluster is calls[0][0]  # later checks compare with the new figure: the slow link is on time
    assert [r.slowdown for r in watcher.readings[-1]] == [pytest.approx(1.0)]
    assert [round(r.slowdown) for checks in watcher.readings for r in checks] == [1, 10, 1, 10, 10, 1]


def test_which_links_a_plan_crosses():
    """Pipeline and replica plans: between consecutive groups; one mesh: between regions, or
    between hosts of one region; nothing on one host."""
    from autopar.planning.watch import _hops

    staged, _, _ = _pipeline_plan()
    assert _hops(staged, Cluster.from_spec(TWO_REGIONS)) == [((0, 1), "a-b")]
    four = os.path.join(HERE, "clusters", "four_cpu_regions.yaml")  # two regions of two
    one_mesh = autopar.plan(torch.nn.Linear(4, 4), (torch.randn(4, 4),), cluster=four)
    assert one_mesh.family == "one_mesh" and _hops(one_mesh, Cluster.from_spec(four)) == [((0, 2), "a-b")]
    hosts = autopar.plan(torch.nn.Linear(4, 4), (torch.randn(4, 4),), cluster="2x2xcpu")
    assert _hops(hosts, Cluster.from_spec("2x2xcpu")) == [((0, 2), "inter_node")]


def test_the_watcher_refuses_a_plan_on_one_host_and_bad_settings():
    plan = autopar.plan(torch.nn.Linear(4, 4), (torch.randn(2, 4),), cluster="2xcpu")
    with pytest.raises(AutoparError, match="this plan runs on one host of 2xcpu"):
        LinkWatcher(plan, Cluster.from_spec("2xcpu"), print, print)
    staged, _, _ = _pipeline_plan()
    with pytest.raises(AutoparError, match="patience must be a whole number of 1 or more"):
        LinkWatcher(staged, Cluster.from_spec(TWO_REGIONS), print, print, patience=0)
    with pytest.raises(AutoparError, match="threshold is the relative drift"):
        LinkWatcher(staged, Cluster.from_spec(TWO_REGIONS), print, print, threshold=float("nan"))


def _train_through_a_slowdown() -> dict:
    """Rank side: a pipeline plan over two regions trains 4 steps with a watcher checking
    every step; from step 3 every message on the lane waits 0.3 s first (the link got
    slower). Returns what the hook saw."""
    import time

    import torch.distributed as dist

    from models import tiny_gpt

    torch.manual_seed(0)
    model, inputs = tiny_gpt()
    plan = autopar.plan(model, inputs, cluster=TWO_REGIONS, pipeline=True)
    pmodel = autopar.apply(model, plan, loss_fn=lambda out, t: torch.nn.functional.mse_loss(out, t))
    # the cluster as `autopar profile` would give it: the link at what it measures here, unloaded
    from autopar.passes.link_probe import probe_hops

    nbytes = 16 << 20
    one_way = min(min(probe_hops([(0, 1)], nbytes)) for _ in range(3))
    profiled = Cluster.from_spec(TWO_REGIONS).with_link("a-b", nbytes / one_way, latency_s=0.0)
    seen = []
    watcher = autopar.watch_links(pmodel, profiled, model, inputs, lambda c, a: seen.append((c, a)),
                                  every=1, threshold=4.0, patience=2, probe_bytes=nbytes)
    target = torch.zeros_like(model(*inputs))
    send = dist.send
    for step in range(4):
        if step == 2:
            def slow_send(tensor, dst=None, *args, **kwargs):
                time.sleep(0.3)
                return send(tensor, dst, *args, **kwargs)
            dist.send = slow_send
        pmodel.step(*inputs, target=target)
    dist.send = send
    slowdowns = [round(r.slowdown, 1) for checks in watcher.readings for r in checks]
    if not seen:
        return {"calls": 0, "slowdowns": slowdowns}
    cluster, answer = seen[0]
    return {"calls": len(seen), "slowdowns": slowdowns, "bandwidth": cluster.wan_link("a", "b").bandwidth_Bps,
            "profiled": profiled.wan_link("a", "b").bandwidth_Bps,
            "changed": _changed(plan, answer.plan), "switch": answer.switch, "reason": answer.reason}


def _changed(old, new) -> list[str]:
    """What differs between two plans of one model: family, stage cuts, micro-batches and
    schedule, placements (on these one-device stages ties, which the solver may settle either way)."""
    changes = [what for what, differs in (
        ("family", old.family != new.family),
        ("stages", [st.layers for st in old.stages] != [st.layers for st in new.stages]),
        ("micro-batches", (old.micro_batches, old.schedule) != (new.micro_batches, new.schedule)),
        ("placements", {k: p.placement for k, p in old.parameters.items()}
         != {k: p.placement for k, p in new.parameters.items()}),
        ("node placements", {k: n.outputs for k, n in old.nodes.items()} != {k: n.outputs for k, n in new.nodes.items()}))
        if differs]
    return changes


def test_a_slower_link_is_detected_and_its_replan_reaches_the_hook():
    seen = run_world(2, _train_through_a_slowdown)
    assert seen["calls"] == 1, seen
    assert all(s < 5 for s in seen["slowdowns"][:2]) and all(s > 5 for s in seen["slowdowns"][2:]), seen
    assert seen["bandwidth"] < seen["profiled"] / 5  # what it measured once the link slowed
    # over the slow link the old plan's sends cost more: the answer is another plan, worth switching to
    assert seen["changed"] and seen["switch"], seen


def _replicas_through_a_slowdown() -> dict:
    """Rank side: a replica plan over two regions (a ResidualMLP of width 256: 1 MiB of
    gradients all-reduced between the groups each step), its link profiled by that all-reduce
    itself; 4 steps with a watcher checking every step, which must never probe; from step 3
    every all-reduce waits 0.5 s first. Returns what the hook saw."""
    import time

    import torch.distributed as dist

    from test_overlap import ResidualMLP

    torch.manual_seed(0)
    model, x = ResidualMLP(256, 2), torch.randn(16, 256)
    target = torch.zeros_like(x)
    plan = autopar.plan(model, (x,), cluster=TWO_REGIONS, replicas=True)
    pmodel = autopar.apply(model, plan, loss_fn=torch.nn.functional.mse_loss)
    timed = []
    for _ in range(3):  # the link as its own all-reduce sees it, unloaded: the fastest of three
        pmodel.runtime.time_sync = True
        pmodel.step(x, target=target)
        timed.append(pmodel.runtime.timed_sync)
    nbytes, seconds = min(timed, key=lambda t: t[1])
    slowest = [None] * dist.get_world_size()
    dist.all_gather_object(slowest, seconds)
    profiled = Cluster.from_spec(TWO_REGIONS).with_link("a-b", nbytes / max(slowest), latency_s=0.0)
    seen = []
    watcher = autopar.watch_links(pmodel, profiled, model, (x,), lambda c, a: seen.append((c, a)),
                                  every=1, threshold=4.0, patience=2)

    def no_probe(pairs, nbytes):
        raise AssertionError("two replica groups are timed by their own all-reduce, not probed")

    watcher.probe = no_probe
    all_reduce = dist.all_reduce
    for step in range(4):
        if step == 2:
            def slow_all_reduce(*args, **kwargs):
                time.sleep(0.5)
                return all_reduce(*args, **kwargs)
            dist.all_reduce = slow_all_reduce
        pmodel.step(x, target=target)
    dist.all_reduce = all_reduce
    slowdowns = [round(r.slowdown, 1) for checks in watcher.readings for r in checks]
    result = {"calls": len(seen), "slowdowns": slowdowns, "gradient_bytes": nbytes,
              "profiled": profiled.wan_link("a", "b").bandwidth_Bps, "family": plan.family}
    if seen:
        result["bandwidth"] = seen[0][0].wan_link("a", "b").bandwidth_Bps
    return result


def test_replica_groups_are_watched_through_their_own_gradient_all_reduce():
    """Two replica groups: the watcher reads the all-reduce the step makes anyway (no probe);
    a 0.5 s wait on every all-reduce from the third step is two slow checks, one hook call with
    the link at the bandwidth the slow all-reduce showed."""
    seen = run_world(2, _replicas_through_a_slowdown)
    assert seen["family"] == "replicas" and seen["gradient_bytes"] >= 1 << 20, seen
    assert seen["calls"] == 1, seen
    assert all(s < 5 for s in seen["slowdowns"][:2]) and all(s > 5 for s in seen["slowdowns"][2:]), seen
    assert seen["bandwidth"] < seen["profiled"] / 5, seen
