"""Run a function in N gloo processes on CPU and collect what rank 0 returns.

Workers import the function by module path, so test helpers stay plain functions.
Start-up dominates small runs, so a test passes several cases to one world.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, result_path: str) -> None:
    faulthandler.enable()  # a worker that crashes (SIGSEGV, SIGABRT) prints where, every thread's stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
        if rank == 0:
            with open(result_path, "w") as f:
                f.write(repr(result))
    except BaseException:
        with open(f"{result_path}.err{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # destroy_process_group drops c10d's references only; device meshes still hold gloo groups whose
    # worker threads may own finished work. Freeing those while the interpreter finalises aborts the
    # process now and then ("terminate called without an active exception", SIGABRT; see
    # pytorch/pytorch#179291). The run is over and its result written: leave without finalising.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(world: int, fn, *args):
    """Run ``fn(*args)`` on ``world`` gloo ranks; returns rank 0's result (a literal)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result")
        try:
            mp.spawn(_worker, args=(world, _free_port(), fn, args, path), nprocs=world, join=True)
        except Exception as exc:
            errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if ".err" in f]
            raise AssertionError("distributed run failed:\n" + "\n".join(errors)) from exc
        with open(path) as f:
            import ast
            return ast.literal_eval(f.read())
