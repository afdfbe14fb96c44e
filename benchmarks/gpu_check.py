"""GPU check (issue 23): one short script for a machine with a GPU — about 5 minutes on one
H200 — whose table says whether autopar's CUDA path runs and how far its cost model is from
the GPU it runs on.

1. ``autopar profile --device gpu`` (this host's GPUs; with one GPU the links stay the
   catalog's) into ``benchmarks/results/gpu_profile.yaml``;
2. one device: the examples' GPT in bf16 without and with full activation checkpointing, the
   ResNet and the DLRM, each planned for one GPU twice — on the profile and on the catalog's
   datasheet figures — and lowered in a one-rank NCCL world: the training step (``pmodel.step``,
   median of 10 after 3 warm-ups, CUDA-synchronised) and the peak memory of a whole iteration
   (step and AdamW, ``torch.cuda.max_memory_allocated``) against each prediction;
3. two ranks sharing this GPU over gloo (gloo moves CUDA tensors): FSDP, Megatron-TP and a
   two-stage pipeline of a small GPT, a DLRM's tables and a mixture of experts — the loss and
   every gradient against one process on the same GPU.

Every case runs on its own: one that fails prints its error in the table and the rest go on.

    python benchmarks/gpu_check.py [--quick]     # writes benchmarks/results/gpu_check.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path[:0] = [os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopar  # noqa: E402

RESULTS = os.path.join(HERE, "results")
TWO_REGIONS = os.path.join(ROOT, "tests", "clusters", "two_cpu_regions.yaml")
# ``--rehearse`` runs every step on the CPU (gloo, no profile, no memory statistics): the
# script's own code checked on a machine without a GPU before device time is spent on it
DEVICE, BACKEND = "cuda", "nccl"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _set_device() -> None:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile(quick: bool) -> tuple[str, float]:
    """``autopar profile --device gpu`` into results/gpu_profile.yaml; the path and seconds."""
    path = os.path.join(RESULTS, "gpu_profile.yaml")
    start = time.perf_counter()
    command = [sys.executable, "-m", "autopar.cli", "profile", "--device", "gpu", "--out", path] + \
        (["--quick"] if quick else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"autopar profile failed: {done.stderr[-2000:]}")
    print(done.stdout.strip(), flush=True)
    return path, time.perf_counter() - start


def _gpt_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def single_device_cases(quick: bool) -> list[tuple]:
    """(name, build, loss, plan options): models built on the GPU, inputs and targets there."""
    import cnn
    import dlrm
    import gpt

    def gpt_case():
        shape = dict(layers=4, d=512, heads=8, seq=512, batch=8, vocab=8192) if quick else \
            dict(layers=12, d=1024, heads=16, seq=1024, batch=16, vocab=32000)
        model, (tokens,) = gpt.build(**shape, device=DEVICE)
        tokens = torch.randint(0, shape["vocab"], tokens.shape, device=DEVICE)
        return model, (tokens,), torch.randint(0, shape["vocab"], tokens.shape, device=DEVICE)

    def resnet_case():
        model, (images,) = cnn.build(batch=32 if quick else 64, device=DEVICE)
        return model, (torch.randn_like(images),), torch.randint(0, 1000, (images.shape[0],), device=DEVICE)

    def dlrm_case():
        model, (dense, sparse) = dlrm.build(batch=2048, device=DEVICE)
        ids = torch.stack([torch.randint(0, emb.num_embeddings, sparse.shape[1:], device=DEVICE)
                           for emb in model.embeddings])
        return model, (torch.randn_like(dense), ids), torch.rand(dense.shape[0], 1, device=DEVICE)

    return [("gpt bf16", gpt_case, _gpt_loss, {"mixed_precision": "bf16", "recompute": "none"}),
            ("gpt bf16 + full AC", gpt_case, _gpt_loss, {"mixed_precision": "bf16", "recompute": "full"}),
            ("resnet", resnet_case, F.cross_entropy, {}),
            ("dlrm", dlrm_case, lambda out, t: F.mse_loss(out.float(), t), {})]


def measure_one_device(profile_path: str, catalog: str, quick: bool) -> list[dict]:
    """Step time and peak memory of each single-device case against both predictions."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    _set_device()
    dist.init_process_group(BACKEND, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0) if DEVICE == "cuda" else None)
    rows = []
    try:
        for name, build, loss_fn, options in single_device_cases(quick):
            row = {"case": name}
            try:
                torch.manual_seed(0)
                model, inputs, target = build()
                datasheet = autopar.plan(model, inputs, cluster=f"1x{catalog}", **options) if catalog else None
                pmodel = autopar.parallelize(model, inputs, cluster=profile_path, loss_fn=loss_fn, **options)
                optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)

                def iteration():
                    pmodel.step(*inputs, target=target)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                for _ in range(3):
                    iteration()
                _sync()
                if DEVICE == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                iteration()
                _sync()
                peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else float("nan")
                times = []
                for _ in range(10 if DEVICE == "cuda" else 2):
                    _sync()
                    start = time.perf_counter()
                    pmodel.step(*inputs, target=target)
                    _sync()
                    times.append(time.perf_counter() - start)
                    optimizer.zero_grad(set_to_none=True)
                plan = pmodel.plan
                row.update(measured_ms=1e3 * statistics.median(times), predicted_ms=1e3 * plan.predicted_step_s,
                           datasheet_ms=1e3 * datasheet.predicted_step_s if datasheet else None,
                           measured_gib=peak / 2**30, predicted_gib=plan.memory.total_bytes / 2**30,
                           recompute=sorted(set(plan.recompute.values())) or ["none"])
                row["time_ratio"] = row["measured_ms"] / row["predicted_ms"]
                row["memory_ratio"] = row["measured_gib"] / row["predicted_gib"]
                pmodel = optimizer = model = None  # freed before the next case
            except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    return rows


def _shared_gpu_case(name: str):
    """(model, inputs, target, loss, options) of one two-ranks-on-one-GPU case, on the GPU."""
    from models import DLRM, GPT, MoEGPT, dlrm_inputs

    torch.manual_seed(0)
    mse = lambda out, t: F.mse_loss(out.float(), t)  # noqa: E731
    if name in ("fsdp", "megatron_tp", "pipeline"):
        model, tokens = GPT(vocab=64, d=32, layers=4, heads=4, max_len=16).to(DEVICE), torch.randint(0, 64, (8, 16))
        options = {"configuration": name} if name != "pipeline" else {"cluster": TWO_REGIONS, "pipeline": True}
        return model, (tokens.to(DEVICE),), torch.randint(0, 64, (8, 16)).to(DEVICE), _gpt_loss, options
    if name == "dlrm tables":
        model = DLRM().to(DEVICE)
        inputs = tuple(x.to(DEVICE) for x in dlrm_inputs(model))
        return model, inputs, torch.zeros(inputs[0].shape[0], 1, device=DEVICE), mse, {}
    if name == "moe":
        model, tokens = MoEGPT().to(DEVICE), torch.randint(0, 64, (8, 16))
        return model, (tokens.to(DEVICE),), torch.randint(0, 64, (8, 16)).to(DEVICE), _gpt_loss, {}
    raise ValueError(name)


SHARED_GPU_CASES = ("fsdp", "megatron_tp", "pipeline", "dlrm tables", "moe")


def _shared_gpu_worker(rank: int, port: int, out: str, device: str) -> None:
    global DEVICE
    DEVICE = device  # a spawned process starts from the module's defaults
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _set_device()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    found = {}
    for name in SHARED_GPU_CASES:
        try:
            model, inputs, target, loss_fn, options = _shared_gpu_case(name)
            single = copy.deepcopy(model)  # one process's model, on the same GPU
            loss = loss_fn(single(*inputs), target)
            loss.backward()
            options = dict(options)
            cluster = options.pop("cluster", None)
            pmodel = autopar.parallelize(model, inputs, cluster=cluster, loss_fn=loss_fn, **options)
            got = pmodel.step(*inputs, target=target)
            expected = dict(single.named_parameters())
            worst, compared = 0.0, 0
            for pname, param in pmodel.named_parameters():
                grad = param.grad
                if grad is None or pname not in expected:
                    continue
                grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                if grad.shape != expected[pname].grad.shape:
                    continue
                scale = float(expected[pname].grad.abs().max()) or 1.0
                worst = max(worst, float((grad - expected[pname].grad).abs().max()) / scale)
                compared += 1
            found[name] = {"family": pmodel.plan.family, "device": str(pmodel.device),
                           "loss_error": abs(float(got) - float(loss.detach())), "gradient_error": worst,
                           "gradients_compared": compared}
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
            found[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            traceback.print_exc()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


def shared_gpu_equivalence() -> dict:
    """The two-ranks-on-one-GPU cases (rank 0's view)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "shared.json")
        mp.spawn(_shared_gpu_worker, args=(_free_port(), out, DEVICE), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller models and measurements")
    parser.add_argument("--rehearse", action="store_true",
                        help="run every step on the CPU (gloo, no profile): check the script without a GPU")
    args = parser.parse_args()
    global DEVICE, BACKEND
    if args.rehearse:
        DEVICE, BACKEND = "cpu", "gloo"
    elif not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a GPU (torch.cuda.is_available() is False); --rehearse runs it on the CPU")
    os.makedirs(RESULTS, exist_ok=True)
    from autopar.devices import device_for_gpu_name

    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (rehearsal)"
    catalog = device_for_gpu_name(gpu)
    started = time.perf_counter()
    report = {"gpu": gpu, "catalog": catalog.name if catalog else None, "torch": torch.__version__,
              "cuda": torch.version.cuda}
    try:
        if args.rehearse:
            raise RuntimeError("rehearsal: no GPU to profile")
        path, seconds = profile(args.quick)
        report["profile_s"] = seconds
    except Exception as exc:  # noqa: BLE001 - without a profile, the catalog still predicts
        report["profile_error"] = str(exc)[:500]
        path = f"1x{catalog.name}" if catalog else ("1xcpu" if args.rehearse else "1xH100")
    report["one_device"] = measure_one_device(path, catalog.name if catalog else None, args.quick)
    report["shared_gpu"] = shared_gpu_equivalence()
    report["total_s"] = time.perf_counter() - started
    with open(os.path.join(RESULTS, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{gpu} (catalog: {report['catalog']}), torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"profile {report.get('profile_s', float('nan')):.0f} s, total {report['total_s']:.0f} s")
    print(f"{'case':22} {'measured ms':>11} {'profile ms':>10} {'datasheet ms':>12} {'ratio':>6} "
          f"{'peak GiB':>8} {'predicted':>9} {'ratio':>6}  recompute / error")
    for r in report["one_device"]:
        if "error" in r:
            print(f"{r['case']:22} {r['error']}")
            continue
        datasheet = f"{r['datasheet_ms']:12.2f}" if r["datasheet_ms"] is not None else f"{'-':>12}"
        print(f"{r['case']:22} {r['measured_ms']:11.2f} {r['predicted_ms']:10.2f} {datasheet} {r['time_ratio']:6.2f} "
              f"{r['measured_gib']:8.2f} {r['predicted_gib']:9.2f} {r['memory_ratio']:6.2f}  {','.join(r['recompute'])}")
    print(f"\n{'2 ranks on one GPU':22} {'family':>9} {'loss err':>10} {'grad err':>10} {'grads':>6}  device / error")
    for name, r in report["shared_gpu"].items():
        if "error" in r:
            print(f"{name:22} {r['error']}")
            continue
        print(f"{name:22} {r['family']:>9} {r['loss_error']:10.2e} {r['gradient_error']:10.2e} "
              f"{r['gradients_compared']:6d}  {r['device']}")


if __name__ == "__main__":
    main()
