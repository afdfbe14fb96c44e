"""How the CLI reads its arguments: value types with messages that say the unit and give an
example, values that start with '-', and misspelt options.

argparse takes ``--memory-limit -inf`` for two options ("expected one argument") and reports
``--clustr 4xcpu`` as "--cluster is required" without naming the typo; the helpers here make
both say what happened.

>>> memory_bytes("80GB"), memory_bytes("1.5GiB"), memory_bytes("8e9")
(80000000000.0, 1610612736.0, 8000000000.0)
>>> attach_dash_values(["plan", "m:f", "--memory-limit", "-1"], {"--memory-limit"})
['plan', 'm:f', '--memory-limit=-1']
"""

from __future__ import annotations

import argparse
import difflib
import re

from autopar.passes.layer_recompute import is_recompute_mode

_BYTE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
               "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_WITH_UNIT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan)\s*([A-Za-z]*)\s*$")


def memory_bytes(text: str) -> float:
    """``--memory-limit``: bytes per device, as a number (8e9) or with a unit (80GB, 80GiB).
    The value's range is checked where every memory limit is (autopar.cluster)."""
    match = _WITH_UNIT.match(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not an amount of memory: give bytes per device, as a number "
                                         "(8e9) or with a unit (80GB, 80GiB, 512MiB)")
    return float(match.group(1)) * _BYTE_UNITS[unit]


def _whole_numbers(text: str, what: str, example: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers, or a usage error naming ``what`` it should be."""
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}, e.g. {example}")


def batch_sizes(text: str) -> list[int]:
    """``--batch-size 8,16,32``."""
    sizes = list(_whole_numbers(text, "batch sizes", "8,16,32"))
    if any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def rows_per_region(text: str) -> tuple[int, ...]:
    """``--batch-split 6,2``: rows of the batch per region (their count and sum are checked
    against the cluster and the batch by the planner)."""
    rows = _whole_numbers(text, "row counts, one per region,", "6,2")
    if any(b < 1 for b in rows):
        raise argparse.ArgumentTypeError(f"every region needs at least one row, got {text!r}")
    return rows


def mesh_shape(text: str) -> tuple[int, ...]:
    """``--mesh-shape 2,4,8``: the device mesh, outer dim first (its product is checked against
    the cluster by the planner)."""
    shape = _whole_numbers(text, "mesh dims", "2,8 or 2,4,8")
    if any(d < 1 for d in shape) or len(shape) > 3:
        raise argparse.ArgumentTypeError(f"a mesh has 1 to 3 dims of 1 or more devices each, got {text!r}")
    return shape


def recompute_mode(text: str) -> str:
    """``--recompute``: auto, none, selective, full, full:N (every N-th layer, N ≥ 2) or
    block:K (the first K layers, K ≥ 1)."""
    if text != "auto" and not is_recompute_mode(text):
        raise argparse.ArgumentTypeError(f"choose auto, none, selective, full, full:N (every N-th layer recomputed "
                                         f"whole, N ≥ 2) or block:K (the first K layers, K ≥ 1), got {text!r}")
    return text


def attach_dash_values(argv: list[str], value_options: set[str]) -> list[str]:
    """``--opt -value`` as ``--opt=-value`` for options that take a value, when the value is
    not itself an option: argparse would read ``-inf``, ``-1,9`` or ``-4xcpu`` as an unknown
    option and answer "expected one argument"; this way the value reaches its check, which
    says what is wrong with it."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else None
        if token in value_options and following is not None and following.startswith("-") \
                and following not in value_options and not following.startswith("--"):
            out.append(f"{token}={following}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def unknown_option_hint(argv: list[str], known: set[str]) -> str:
    """For an argparse error: the options in ``argv`` this command does not know, each with the
    nearest one it does ("--clustr: did you mean --cluster?"); "" when there are none."""
    hints = []
    for token in argv:
        name = token.split("=", 1)[0]
        if name.startswith("--") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            hints.append(f"unknown option {name}" + (f": did you mean {close[0]}?" if close else ""))
    return "; ".join(hints)


class HintingParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors also name misspelt options (``--clustr``: did
    you mean ``--cluster``?) — argparse reports the required option as missing instead."""

    seen_argv: list[str] = []

    def error(self, message: str):
        known = {o for action in self._actions for o in action.option_strings}
        hint = unknown_option_hint(self.seen_argv, known) if "unrecognized" not in message else ""
        super().error(f"{message}; {hint}" if hint else message)


def subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for sub in action.choices.values()]


def value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option of every command that takes a value (``--cluster``, ``--memory-limit`` …)."""
    return {o for sub in subparsers(parser) for action in sub._actions if action.option_strings
            and isinstance(action, (argparse._StoreAction, argparse._AppendAction)) for o in action.option_strings}
