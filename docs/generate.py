"""Regenerate the example outputs shown in README.md and docs/*.md, so they cannot go stale.

    python docs/generate.py            # run the commands, rewrite the marked blocks
    python docs/generate.py --check    # run them, compare only; exit 1 naming each stale block

A block is marked in the Markdown by an HTML comment right above a ``text`` fence:

    <!-- output: gpt-example -->
    ```text
    (written by this script)
    ```

and ``OUTPUTS`` below says which commands make it. Each output's commands run in order, in
bash, in a scratch directory of their own holding links to the repository's ``examples/``
and ``tests/`` (so ``python examples/gpt.py`` and ``examples.gpt:build`` work as written and
the plans they save land in the scratch directory, not in the working tree), with this
script's Python first on PATH. A block shows each command as ``$ command`` and the standard
output of the ones it names; figures that depend on the machine's speed (planning seconds)
are masked, so the check is deterministic.

A Python block marked ``<!-- source: NAME -->`` (the README's quick start) is written to
NAME in every scratch directory, so an output can run the code the reader sees.

It lives in docs/ beside what it writes (benchmarks/ measure and print tables; this checks
that the docs match the program). tests/test_docs.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import difflib
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINKED = ("examples", "tests")  # repository folders the commands name by relative path


@dataclasses.dataclass(frozen=True)
class Output:
    commands: tuple[str, ...]   # bash command lines, run in order in one scratch directory
    shown: tuple[int, ...] = (-1,)  # the commands whose standard output the block shows
    prompts: bool = True        # show each command as "$ command" above its output
    until: str | None = None    # an excerpt: cut before the first line containing this ("…" marks the cut)


OUTPUTS = {
    # README.md
    "quickstart": Output(("python quickstart.py",), prompts=False),
    "show-2x8": Output(("autopar plan examples.gpt:build --cluster 2x8xH100 -o plan.json", "autopar show plan.json"),
                       until="parameter placements per layer"),
    # docs/examples.md
    "gpt-example": Output(("python examples/gpt.py --cluster 4xH100 --layers 2 --out gpt-plan.json",)),
    "cnn-example": Output(("python examples/cnn.py --cluster 8xH100 --out cnn-plan.json",)),
    "dlrm-example": Output(("python examples/dlrm.py --cluster 8xH100 --out dlrm-plan.json",)),
    # docs/clusters.md
    "devices": Output(("autopar devices",)),
    # docs/pipelines-and-regions.md
    "pipeline-plan": Output(("autopar plan examples.gpt:build --cluster tests/clusters/four_cpu_regions.yaml "
                             "--pipeline on --micro-batches 8 -o pipeline-plan.json",),
                            until="parameter placements per layer"),
}

# (pattern, replacement): figures that change with the machine's speed or load
MASKS = ((re.compile(r"planned in \d+(\.\d+)? s"), "planned in <seconds> s"),)

MARKER = re.compile(r"<!-- output: (?P<id>[\w.-]+) -->\n```text\n(?P<body>.*?)^```$", re.S | re.M)
SOURCE = re.compile(r"<!-- source: (?P<name>[\w.-]+) -->\n```python\n(?P<code>.*?)^```$", re.S | re.M)


def doc_files() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def run(output_id: str, spec: Output, sources: dict[str, str]) -> str:
    """The text of ``spec``'s block: its commands run in a fresh scratch directory."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               OMP_NUM_THREADS="1", COLUMNS="124", PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory(prefix=f"autopar-docs-{output_id}-") as scratch:
        for name in LINKED:
            os.symlink(os.path.join(ROOT, name), os.path.join(scratch, name))
        for name, code in sources.items():
            with open(os.path.join(scratch, name), "w") as f:
                f.write(code)
        shown = {i % len(spec.commands) for i in spec.shown}
        parts = []
        for i, command in enumerate(spec.commands):
            done = subprocess.run(["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"output {output_id!r}: `{command}` exited {done.returncode}:\n"
                                   f"{done.stderr[-3000:]}")
            if spec.prompts:
                parts.append(f"$ {command}\n")
            if i in shown:
                parts.append(done.stdout)
    text = "".join(parts)
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    lines = [line.rstrip() for line in text.splitlines()]
    if spec.until is not None:
        cut = next((k for k, line in enumerate(lines) if spec.until in line), None)
        if cut is None:
            raise RuntimeError(f"output {output_id!r}: no line contains {spec.until!r} to cut the excerpt at")
        lines = [*lines[:cut], "…"]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 naming each stale block")
    parser.add_argument("--jobs", type=int, default=2, help="outputs produced at once (default 2)")
    parser.add_argument("ids", nargs="*", help="only these outputs (default: all)")
    args = parser.parse_args()

    docs = {path: open(path).read() for path in doc_files()}
    sources = {m["name"]: m["code"] for text in docs.values() for m in SOURCE.finditer(text)}
    used = {m["id"]: os.path.relpath(path, ROOT) for path, text in docs.items() for m in MARKER.finditer(text)}
    problems = [f"{where}: block {i!r} is not an output docs/generate.py knows" for i, where in used.items()
                if i not in OUTPUTS]
    problems += [f"output {i!r} is shown in no document" for i in OUTPUTS if i not in used]
    wanted = args.ids or list(OUTPUTS)
    problems += [f"unknown output {i!r}" for i in wanted if i not in OUTPUTS]
    if problems:
        print("\n".join(problems))
        return 1

    start = time.perf_counter()
    seconds: dict[str, float] = {}

    def timed(output_id: str) -> str:
        begun = time.perf_counter()
        text = run(output_id, OUTPUTS[output_id], sources)
        seconds[output_id] = time.perf_counter() - begun
        return text

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {i: pool.submit(timed, i) for i in wanted}
        failed = [str(f.exception()) for f in futures.values() if f.exception() is not None]
    if failed:
        print("\n".join(failed))
        return 1
    made = {i: f.result() for i, f in futures.items()}
    stale = []
    for path, text in docs.items():
        def replace(m: re.Match) -> str:
            if m["id"] not in made or m["body"] == made[m["id"]]:
                return m[0]
            stale.append((os.path.relpath(path, ROOT), m["id"], m["body"], made[m["id"]]))
            return m[0][:m.start("body") - m.start()] + made[m["id"]] + "```"
        new = MARKER.sub(replace, text)
        if new != text and not args.check:
            with open(path, "w") as f:
                f.write(new)
    for where, i, old, new in stale:
        print(f"{'stale' if args.check else 'updated'}: {where}, block {i!r}")
        if args.check:
            diff = difflib.unified_diff(old.splitlines(), new.splitlines(), "in the document", "the program prints",
                                        lineterm="", n=1)
            print("\n".join(list(diff)[:40]))
    print("seconds per output: " + ", ".join(f"{i} {seconds[i]:.1f}" for i in wanted))
    print(f"{len(made)} outputs, {len(stale)} {'stale' if args.check else 'updated'}, "
          f"{time.perf_counter() - start:.1f} s" + ("; run python docs/generate.py to update" if args.check and stale
                                                      else ""))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
