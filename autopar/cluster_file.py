"""Cluster files (YAML): regions of hosts, their links, and the WAN links between regions.

    regions:
      us-east: {device: A100-80GB, nodes: 2, per_node: 8,
                intra_node: {bandwidth_GBps: 300, latency_us: 2},
                inter_node: {bandwidth_GBps: 25, latency_us: 5}}
      eu-west: {device: A100-80GB, nodes: 1, per_node: 8}
    links:
      - {between: [us-east, eu-west], bandwidth_GBps: 0.125, latency_ms: 80}

A single-region cluster may give ``device/nodes/per_node`` (and the link blocks) at the top
level. Missing link figures take the device's defaults. ``memory_reserve_GB`` (per region or
top level) is subtracted from each device's memory. A top-level ``devices:`` section defines
device kinds of the file's own (measured ones: ``autopar profile``). Errors name the file, the
line and the fix.
"""

from __future__ import annotations


import dataclasses
import math

import yaml

from autopar.devices import (COLLECTIVES, MAX_LINK_BANDWIDTH_Bps, MAX_LINK_LATENCY_S, OP_CLASSES, OVERLAP_KINDS,
                             DeviceSpec, Link, check_device_count, get_device)
from autopar.errors import AutoparError, ErrorKind

GB = 10**9
MAX_FILE_BYTES = 1 << 20  # a cluster file is a few lines; a larger one is not one
_REGION_KEYS = {"device", "nodes", "per_node", "intra_node", "inter_node", "memory_reserve_GB"}


def _fail(where: str, message: str) -> AutoparError:
    return AutoparError(ErrorKind.BAD_CLUSTER, f"{where}: {message}")


def _lines(node, path=()) -> dict[tuple, int]:
    """Line number (1-based) of every mapping key and sequence item, by key path."""
    found = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            found.update(_lines(value, path + (key.value,)))
            found[path + (key.value,)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found.update(_lines(item, path + (i,)))
    return found


def load_cluster_file(path: str) -> dict:
    """The fields of the cluster file at ``path``. Read strictly: at most :data:`MAX_FILE_BYTES`,
    no anchors or aliases (a cluster file needs none, and nested aliases expand
    exponentially), no key given twice in one mapping (YAML would keep the last silently)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise AutoparError(ErrorKind.BAD_CLUSTER, f"cannot read cluster file {path!r}: {exc.strerror}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise _fail(path, f"larger than {MAX_FILE_BYTES:,} bytes; a cluster file describes regions and links in a "
                    "few lines")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(path, f"not UTF-8 text (byte {exc.start}); a cluster file is YAML") from exc
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise _fail(f"{path}:{event.start_mark.line + 1}", "YAML anchors and aliases (&name, *name) are not "
                            "allowed in a cluster file; write each value out")
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        _no_duplicate_keys(root, path)
        data = yaml.safe_load(text)
        lines = _lines(root) if data is not None else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise _fail(where, f"not valid YAML ({getattr(exc, 'problem', exc)})") from exc
    return parse_cluster(data, path, lines)


def _no_duplicate_keys(node, path: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if key.value in seen:
                raise _fail(f"{path}:{line}", f"key {key.value!r} appears twice in one mapping (first on line "
                            f"{seen[key.value]}); YAML would keep only the last: merge them or rename one")
            seen[key.value] = line
            _no_duplicate_keys(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_duplicate_keys(item, path)


def parse_cluster(data, source: str = "<cluster>", lines: dict | None = None) -> dict:
    """The fields of the file's ``autopar.cluster.Cluster`` (which builds itself from them:
    this module stays below it); with regions that differ, ``region_clusters`` holds each
    region's fields."""
    lines = lines or {}

    def where(*key) -> str:
        line = lines.get(tuple(key))
        return f"{source}:{line}" if line else source

    if not isinstance(data, dict):
        raise _fail(source, "a cluster file must be a mapping with `regions:` or `device/nodes/per_node`")
    custom = _custom_devices(data.get("devices", {}), where)
    if "regions" in data:
        regions = data["regions"]
        if not isinstance(regions, dict) or not regions:
            raise _fail(where("regions"), "`regions` must map region names to {device, nodes, per_node}")
        specs = {name: _region(spec, where, ("regions", name), custom) for name, spec in regions.items()}
    else:
        specs = {"default": _region(data, where, (), custom)}
    check_device_count(sum(s["nodes"] * s["per_node"] for s in specs.values()), f"cluster file {source}")
    per_node = {s["per_node"] for s in specs.values()}
    if len(per_node) > 1:
        raise _fail(where("regions"), f"regions have different node sizes (per_node {sorted(per_node)}); ranks "
                    "are numbered host-major with one node size: give every region the same `per_node`")
    wan = _wan_links(data.get("links", []), specs, where)
    own = {}
    for name, spec in specs.items():
        memory = spec["device"].memory_bytes - spec["reserve"]
        if memory <= 0:
            raise _fail(where(*(("regions", name) if "regions" in data else ())),
                        f"memory reservation {spec['reserve']} bytes leaves no memory on {spec['device'].name}")
        own[name] = {"device": spec["device"], "hosts": spec["nodes"], "devices_per_host": spec["per_node"],
                     "intra_link": spec["intra"], "inter_link": spec["inter"], "memory_limit_bytes": memory}
    if len(own) == 1:
        return next(iter(own.values()))
    host_regions = tuple(name for name, s in specs.items() for _ in range(s["nodes"]))
    slowest = min(own.values(), key=lambda c: (c["device"].flops_per_s("float32"), c["device"].memory_bandwidth_Bps))
    uniform = {(c["device"].name, c["intra_link"], c["inter_link"], c["memory_limit_bytes"]) for c in own.values()}
    return {"device": _slowest_device([c["device"] for c in own.values()]), "hosts": len(host_regions),
            "devices_per_host": slowest["devices_per_host"],
            "intra_link": min((c["intra_link"] for c in own.values()), key=lambda link: link.bandwidth_Bps),
            "inter_link": min((c["inter_link"] for c in own.values()), key=lambda link: link.bandwidth_Bps),
            "memory_limit_bytes": min(c["memory_limit_bytes"] for c in own.values()),
            "host_regions": host_regions, "wan_links": wan,
            "region_clusters": tuple(own.items()) if len(uniform) > 1 else ()}


def _slowest_device(devices: list[DeviceSpec]) -> DeviceSpec:
    """What one uniform mesh over mixed devices runs at: every figure at its minimum
    (a synchronous step waits for the slowest device)."""
    if len({d.name for d in devices}) == 1:
        return devices[0]
    kinds = set.intersection(*(set(d.peak_flops) for d in devices))
    return dataclasses.replace(
        devices[0], name="mixed(" + ",".join(sorted({d.name for d in devices})) + ")",
        peak_flops={k: min(d.peak_flops[k] for d in devices) for k in kinds},
        memory_bytes=min(d.memory_bytes for d in devices),
        memory_bandwidth_Bps=min(d.memory_bandwidth_Bps for d in devices),
        compute_efficiency=min(d.compute_efficiency for d in devices),
        memory_efficiency=min(d.memory_efficiency for d in devices), aliases=(),
        class_efficiency=_weakest(devices, "class_efficiency"),
        collective_efficiency=_weakest(devices, "collective_efficiency"),
        overlap_efficiency=min(d.overlap_efficiency for d in devices),
        collective_overlap=tuple((kind, min(d.overlap(kind) for d in devices))
                                 for kind in sorted({k for d in devices for k, _ in d.collective_overlap})))


def _weakest(devices: list[DeviceSpec], field: str) -> tuple[tuple[str, float], ...]:
    """Per kind listed by any device, the lowest efficiency among them (unlisted = 1)."""
    tables = [dict(getattr(d, field)) for d in devices]
    kinds = {kind for table in tables for kind in table}
    return tuple(sorted((kind, min(table.get(kind, 1.0) for table in tables)) for kind in kinds))


def _custom_devices(section, where) -> dict[str, DeviceSpec]:
    """``devices:`` — device kinds the file defines itself (``autopar profile`` writes one):

        devices:
          my-cpu: {peak_TFLOPS: {fp32: 0.09}, memory_GB: 24, memory_bandwidth_GBps: 9.5,
                   intra_node: {bandwidth_GBps: 1.1, latency_us: 60}}

    Figures are what kernels reach (efficiency 1 unless ``compute_efficiency`` says otherwise);
    ``op_overhead_us`` is a fixed time per executed op; ``op_class_efficiency`` maps op classes
    (matmul, attention, conv, pool, reduction, elementwise) to the fraction of the roofline they reach;
    ``overlap_efficiency`` (0–1, default 0.9 as the catalog's GPUs) is the fraction of overlappable communication the
    device hides behind compute, ``collective_overlap`` the same per collective kind (all_gather,
    reduce_scatter, all_reduce; −1 to 1, below 0 where overlapping slows the compute more than it
    hides) — ``autopar profile`` measures both."""
    if not isinstance(section, dict):
        raise _fail(where("devices"), "`devices` must map names to {peak_TFLOPS, memory_GB, memory_bandwidth_GBps}")
    found = {}
    for name, spec in section.items():
        key = ("devices", name)
        if not isinstance(spec, dict):
            raise _fail(where(*key), "a device must be a mapping {peak_TFLOPS: {fp32: ...}, memory_GB, "
                        "memory_bandwidth_GBps}")
        for required in ("peak_TFLOPS", "memory_GB", "memory_bandwidth_GBps"):
            if required not in spec:
                raise _fail(where(*key), f"device {name!r} is missing `{required}`")
        flops = spec["peak_TFLOPS"]
        if not isinstance(flops, dict) or "fp32" not in flops:
            raise _fail(where(*key, "peak_TFLOPS"), "`peak_TFLOPS` must map dtypes to TFLOP/s and include fp32")
        intra = _link(spec.get("intra_node"), Link(2 * GB, 50e-6), where, key + ("intra_node",))
        inter = _link(spec.get("inter_node"), Link(1.25 * GB, 100e-6), where, key + ("inter_node",))
        found[str(name).lower()] = DeviceSpec(
            name=str(name),
            peak_flops={dtype: _number(v, where, key + ("peak_TFLOPS", dtype)) * 1e12 for dtype, v in flops.items()},
            memory_bytes=int(_number(spec["memory_GB"], where, key + ("memory_GB",)) * GB),
            memory_bandwidth_Bps=_number(spec["memory_bandwidth_GBps"], where, key + ("memory_bandwidth_GBps",)) * GB,
            intra_node_bandwidth_Bps=intra.bandwidth_Bps, intra_node_latency_s=intra.latency_s,
            inter_node_bandwidth_Bps=inter.bandwidth_Bps, inter_node_latency_s=inter.latency_s,
            compute_efficiency=_number(spec.get("compute_efficiency", 1.0), where, key + ("compute_efficiency",)),
            memory_efficiency=_number(spec.get("memory_efficiency", 1.0), where, key + ("memory_efficiency",)),
            op_overhead_s=_number(spec.get("op_overhead_us", 0), where, key + ("op_overhead_us",), allow_zero=True)
            * 1e-6,
            class_efficiency=_efficiencies(spec.get("op_class_efficiency", {}), OP_CLASSES, where,
                                           key + ("op_class_efficiency",)),
            collective_efficiency=_efficiencies(spec.get("collective_efficiency", {}), COLLECTIVES, where,
                                                key + ("collective_efficiency",)),
            overlap_efficiency=_fraction(spec.get("overlap_efficiency", DeviceSpec.overlap_efficiency), where,
                                         key + ("overlap_efficiency",)),
            collective_overlap=_overlaps(spec.get("collective_overlap", {}), where, key + ("collective_overlap",)),
            source=str(spec.get("source", "defined in the cluster file")))
    return found


def _efficiencies(section, kinds: tuple[str, ...], where, key: tuple) -> tuple[tuple[str, float], ...]:
    """``{kind: fraction}`` of an ``op_class_efficiency`` / ``collective_efficiency`` entry."""
    if not isinstance(section, dict):
        raise _fail(where(*key), f"`{key[-1]}` must map {', '.join(kinds)} to fractions of the ideal speed")
    found = []
    for kind, value in section.items():
        if kind not in kinds:
            raise _fail(where(*key, kind), f"unknown kind {kind!r} in `{key[-1]}`; expected one of {', '.join(kinds)}")
        found.append((kind, _number(value, where, key + (kind,))))
    return tuple(sorted(found))


def _overlaps(section, where, key: tuple) -> tuple[tuple[str, float], ...]:
    """``{kind: η}`` of a ``collective_overlap`` entry, each η from −1 to 1."""
    if not isinstance(section, dict):
        raise _fail(where(*key), f"`{key[-1]}` must map {', '.join(OVERLAP_KINDS)} to overlap efficiencies")
    found = []
    for kind, value in section.items():
        if kind not in OVERLAP_KINDS:
            raise _fail(where(*key, kind), f"unknown kind {kind!r} in `{key[-1]}`; expected one of "
                        f"{', '.join(OVERLAP_KINDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1 <= value <= 1:
            raise _fail(where(*key, kind), f"`{kind}` is an overlap efficiency between -1 and 1, got {value!r}")
        found.append((kind, float(value)))
    return tuple(sorted(found))


def _region(spec, where, key: tuple, custom: dict[str, DeviceSpec]) -> dict:
    if not isinstance(spec, dict):
        raise _fail(where(*key), "a region must be a mapping {device: ..., nodes: ..., per_node: ...}")
    unknown = set(spec) - _REGION_KEYS - {"regions", "links", "devices"}
    if unknown:
        raise _fail(where(*key, sorted(unknown)[0]), f"unknown key {sorted(unknown)[0]!r}; expected {sorted(_REGION_KEYS)}")
    for required in ("device", "nodes", "per_node"):
        if required not in spec:
            raise _fail(where(*key), f"missing `{required}`")
    try:
        device = custom.get(str(spec["device"]).lower()) or get_device(str(spec["device"]))
    except AutoparError as exc:
        hint = f" or one of this file's `devices` ({', '.join(sorted(custom))})" if custom else ""
        raise _fail(where(*key, "device"), exc.message + hint) from exc
    for count in ("nodes", "per_node"):
        value = spec[count]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _fail(where(*key, count), f"`{count}` must be a positive integer, got {value!r} "
                        "(a cluster needs at least one device)")
    intra = _link(spec.get("intra_node"), Link.of_device(device, inter_node=False), where, key + ("intra_node",))
    inter = _link(spec.get("inter_node"), Link.of_device(device, inter_node=True), where, key + ("inter_node",))
    reserve = _number(spec.get("memory_reserve_GB", 0), where, key + ("memory_reserve_GB",), allow_zero=True)
    return {"device": device, "nodes": spec["nodes"], "per_node": spec["per_node"], "intra": intra,
            "inter": inter, "reserve": int(reserve * GB)}


def _number(value, where, key, allow_zero=False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0 \
            or (value == 0 and not allow_zero):
        raise _fail(where(*key), f"`{key[-1]}` must be a {'non-negative' if allow_zero else 'positive'} number, "
                    f"got {value!r}")
    return float(value)


def _fraction(value, where, key) -> float:
    if _number(value, where, key, allow_zero=True) > 1:
        raise _fail(where(*key), f"`{key[-1]}` is a fraction between 0 and 1, got {value!r}")
    return float(value)


def _link(spec, default: Link, where, key: tuple) -> Link:
    if spec is None:
        return default
    if not isinstance(spec, dict):
        raise _fail(where(*key), "a link must be a mapping {bandwidth_GBps: ..., latency_us: ...}")
    bandwidth = _number(spec["bandwidth_GBps"], where, key + ("bandwidth_GBps",)) * GB \
        if "bandwidth_GBps" in spec else default.bandwidth_Bps
    latency = default.latency_s
    for unit, scale in (("latency_us", 1e-6), ("latency_ms", 1e-3), ("latency_s", 1.0)):
        if unit in spec:
            latency = _number(spec[unit], where, key + (unit,), allow_zero=True) * scale
    problem = link_problem(bandwidth, latency)
    if problem:
        raise _fail(where(*key), problem)
    return dataclasses.replace(default, bandwidth_Bps=bandwidth, latency_s=latency)


def link_problem(bandwidth_Bps: float, latency_s: float | None) -> str | None:
    """Why a link of this bandwidth and latency is no real link (a unit slipped), or None."""
    if bandwidth_Bps > MAX_LINK_BANDWIDTH_Bps:
        return (f"bandwidth {bandwidth_Bps / 1e9:.3g} GB/s is beyond any link ({MAX_LINK_BANDWIDTH_Bps / 1e9:,.0f} GB/s "
                "at most): check the unit (GBps is gigabytes per second)")
    if latency_s is not None and latency_s > MAX_LINK_LATENCY_S:
        return f"latency {latency_s:.3g} s is beyond any link (a week at most): check the unit (us, ms or s)"
    return None


def _wan_links(links, specs: dict, where) -> tuple:
    if not isinstance(links, list):
        raise _fail(where("links"), "`links` must be a list of {between: [a, b], bandwidth_GBps, latency_ms}")
    found = []
    for i, spec in enumerate(links):
        pair = spec.get("between") if isinstance(spec, dict) else None
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(where("links", i), "each link needs `between: [region_a, region_b]`")
        for name in pair:
            if name not in specs:
                raise _fail(where("links", i, "between"), f"unknown region {name!r}; regions: {sorted(specs)}")
        if "bandwidth_GBps" not in spec:
            raise _fail(where("links", i), "a WAN link needs `bandwidth_GBps`")
        if pair[0] == pair[1]:
            raise _fail(where("links", i, "between"), f"links join two regions; [{pair[0]}, {pair[1]}] names one "
                        "(the links inside a region are its intra_node and inter_node)")
        earlier = next((k for k, (a, b, _) in enumerate(found) if {a, b} == set(pair)), None)
        if earlier is not None:
            raise _fail(where("links", i), f"a second link between {pair[0]!r} and {pair[1]!r} (the first is "
                        f"links[{earlier}]); give each pair of regions one link")
        found.append((pair[0], pair[1], _link(spec, Link(0.0, 0.0), where, ("links", i))))
    names = sorted(specs)
    for a_index, a in enumerate(names):
        for b in names[a_index + 1:]:
            if not any({x, y} == {a, b} for x, y, _ in found):
                raise _fail(where("links"), f"no link between regions {a!r} and {b!r}: add "
                            f"`- {{between: [{a}, {b}], bandwidth_GBps: ..., latency_ms: ...}}` under `links`")
    return tuple(found)


_BANDWIDTH_UNITS = {"GBps": GB, "MBps": 1e6, "Gbps": GB / 8, "Mbps": 1e6 / 8}  # bytes/s per unit
_LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_link_change(text: str) -> tuple[str, float, float | None]:
    """``autopar replan --link``: ``WHICH=BANDWIDTH[@LATENCY]`` -> (which, bytes/s, seconds or
    None). WHICH is intra_node, inter_node or two regions ``a-b``; BANDWIDTH a number with
    GBps or MBps (bytes) or Gbps or Mbps (bits); LATENCY a number with us, ms or s.
    ``us-eu=0.125GBps@40ms`` is 1 Gbit/s at 40 ms."""
    which, sep, value = text.partition("=")
    rate, _, latency = value.partition("@")
    bandwidth = _with_unit(rate, _BANDWIDTH_UNITS)
    if not sep or not which.strip() or bandwidth is None or bandwidth <= 0:
        raise AutoparError(ErrorKind.BAD_INPUT, f"--link {text!r}: expected WHICH=BANDWIDTH[@LATENCY], e.g. "
                           "a-b=0.125GBps@40ms or inter_node=100Gbps (WHICH: intra_node, inter_node or two regions "
                           "joined by '-'; bandwidth in GBps, MBps, Gbps or Mbps; latency in us, ms or s)")
    seconds = None
    if latency:
        seconds = _with_unit(latency, _LATENCY_UNITS)
        if seconds is None or seconds < 0:
            raise AutoparError(ErrorKind.BAD_INPUT, f"--link {text!r}: latency {latency!r} must be a number with us, "
                               "ms or s (e.g. 40ms)")
    problem = link_problem(bandwidth, seconds)
    if problem:
        raise AutoparError(ErrorKind.BAD_INPUT, f"--link {text!r}: {problem}")
    return which.strip(), bandwidth, seconds


def _with_unit(text: str, units: dict[str, float]) -> float | None:
    """``"0.125GBps"`` -> 1.25e8 (units matched as written, the longest first); None when the
    number is not a finite one or the unit not in ``units``."""
    text = text.strip()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            try:
                value = float(text[: -len(unit)])
            except ValueError:
                return None
            return value * units[unit] if math.isfinite(value) else None
    return None
