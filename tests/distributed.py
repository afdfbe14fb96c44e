"""Run a function in N gloo processes on CPU and collect what rank 0 returns.

Workers import the function by module path, so test helpers stay plain functions.

Starting N processes costs more than most runs (a fresh interpreter importing torch, and
torch's first export and first DTensor op in it: about 2.7 s for two ranks, 5.5 s for four,
on this 2-core machine). So the processes of the usual world sizes (2 and 4) are kept
between runs, as a pool: each run is a fresh process group (a new rendezvous port) on the
same processes, destroyed after it. A run that fails in any rank ends the pool's processes
(the others may be waiting in a collective) and the next run starts new ones. Other world
sizes get processes of their own, ended after the run.
"""

from __future__ import annotations

import ast
import faulthandler
import itertools
import os
import queue
import resource
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

POOLED_WORLDS = (2, 4)
# a pool whose largest process grew past this much resident memory is replaced after its run
# (what earlier runs left behind: caches, the process groups kept below)
RECYCLE_RSS_BYTES = 3 << 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _serve(rank: int, world: int, tasks, results) -> None:
    """A pool process: run each task ``(task id, port, fn, args)`` in a process group of its
    own, report ``(task id, rank, ok, rank 0's result repr or the traceback, resident
    bytes)``; leave at ``None``, or after a task failed here."""
    faulthandler.enable()  # a worker that crashes (SIGSEGV, SIGABRT) prints where, every thread's stack
    os.environ.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    # every process group a run made (device meshes make several), kept alive: destroy_process_group
    # drops c10d's references only, and freeing a gloo group whose worker threads may own finished
    # work aborts the process now and then ("terminate called without an active exception",
    # SIGABRT; see pytorch/pytorch#179291)
    kept: list = []
    for task in iter(tasks.get, None):
        task_id, port, fn, args = task
        os.environ["MASTER_PORT"] = str(port)
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world)
            result = fn(*args)
            results.put((task_id, rank, True, repr(result) if rank == 0 else None, _rss_bytes()))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc(), 0))
            results.close()
            results.join_thread()  # the report is written before the process leaves
            _leave(1)  # the other ranks may be waiting for this one in a collective: the pool is done
        kept.extend(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()
        _forget_meshes()
    _leave(0)


def _forget_meshes() -> None:
    """Empty DTensor's caches keyed by device mesh. A mesh equals another of the same shape,
    ranks and names whatever its process groups (``DeviceMesh.__eq__``), and group names start
    over at each process group (``group_count``): the next run's meshes would be handed results
    that name this run's groups, now gone ("Could not resolve the process group registered
    under the name 17")."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


def _leave(code: int) -> None:
    """Exit without finalising the interpreter (it would free the kept process groups)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Pool:
    """``world`` processes serving runs (:func:`_serve`)."""

    _ids = itertools.count()

    def __init__(self, world: int) -> None:
        context = mp.get_context("spawn")
        self.world = world
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(world)]
        self.processes = [context.Process(target=_serve, args=(rank, world, self.tasks[rank], self.results),
                                          daemon=True) for rank in range(world)]
        for process in self.processes:
            process.start()
        self.largest_rss = 0

    def run(self, fn, args: tuple):
        """Rank 0's result of ``fn(*args)`` on every rank; AssertionError with every failing
        rank's traceback (the pool is then ended)."""
        task_id, port = next(self._ids), _free_port()
        for rank_tasks in self.tasks:
            rank_tasks.put((task_id, port, fn, args))
        done: dict[int, tuple[bool, str | None]] = {}
        while len(done) < self.world:
            try:
                got_id, rank, ok, payload, rss = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [rank for rank, p in enumerate(self.processes) if not p.is_alive() and rank not in done]
                if dead and not any(not ok for ok, _ in done.values()):
                    # a rank died without a word (a crash): what the others report no longer matters
                    self.close()
                    codes = {rank: self.processes[rank].exitcode for rank in dead}
                    raise AssertionError(f"distributed run failed: ranks {dead} died (exit codes {codes}); "
                                         "their stderr above says where")
                if any(not ok for ok, _ in done.values()):
                    break  # a rank failed; the others may wait for it forever
                continue
            if got_id == task_id:
                done[rank] = (ok, payload)
                self.largest_rss = max(self.largest_rss, rss)
        failures = [f"rank {rank}:\n{payload}" for rank, (ok, payload) in sorted(done.items()) if not ok]
        if failures:
            self.close()
            raise AssertionError("distributed run failed:\n" + "\n".join(failures))
        return ast.literal_eval(done[0][1])

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        for q in (self.results, *self.tasks):
            q.close()
            q.cancel_join_thread()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)


_pools: dict[int, _Pool] = {}


def run_world(world: int, fn, *args):
    """Run ``fn(*args)`` on ``world`` gloo ranks; returns rank 0's result (a literal)."""
    pool = _pools.pop(world, None)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close()
        pool = _Pool(world)
    result = pool.run(fn, args)  # a failure ends the pool (close) and propagates
    if world in POOLED_WORLDS and pool.largest_rss < RECYCLE_RSS_BYTES:
        _pools[world] = pool
    else:
        pool.close()
    return result
