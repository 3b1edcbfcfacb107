"""Hardware profiles: pass floors for the bandwidth and compute checks, one YAML file each.

A profile is selected by name (a file ``<name>.yaml`` beside this module) or by path (any value
ending in ``.yaml``). The default, ``cpu``, has no floors: the checks report figures only. A
profile file holds::

    description: what hardware it describes
    device_name: "H200"     # substring every rank's device name must contain ("" = any)
    bandwidth:              # applied only when the run has exactly this shape
      world_size: 8
      nodes: 1
      floors:
        - {collective: all_reduce, size_bytes: 17179869184, min_busbw_gbps: 431.0}
    multi_node:             # applied to runs of >= min_nodes nodes of ranks_per_node ranks each
      fabric: "8x 400 Gb/s InfiniBand or RoCE, one NIC per GPU"
      ranks_per_node: 8
      min_nodes: 2
      floors:               # busbw across the nodes, as nccl-tests defines it
        - {collective: all_reduce, size_bytes: 17179869184, min_busbw_gbps: 333.0}
    expect_transport: ib    # the network NCCL must use between nodes (transport check)
    compute:
      min_tflops: {bf16: 676.0}   # per rank and dtype (fp32 on CPU)
    training:               # the training check's MFU (absent: tokens/s only)
      peak_tflops: 989.0    # the GPU's dense bf16 peak, 1e12 FLOP/s (the datasheet's)
      min_mfu: 0.3          # a floor, where a source gives one for the kit's model
    health:                 # what the health check expects of each node (absent: not judged)
      gpus_per_node: 8      # also makes a run a GPU run: GPUs that cannot be read fail it
      pcie_gen: 5           # every GPU's PCIe link under load, at least
      pcie_width: 16
      nvlink_links: 18      # NVLink links per GPU by design, all up
      hca_names: ["mlx5_*"] # the HCAs that carry GPU traffic (glob of device or device/port)
      hca_ports: 8          # of those, ports ACTIVE / LinkUp at hca_rate_gbps or more
      hca_rate_gbps: 400
    sources: [where each number comes from]

"By design" in ``health``: the profile states the SKU's design — its GPU count, its NVLink
links per GPU (export parts such as some H800/H20-class boards have fewer than HGX's 18: their
profile says so), which HCAs carry the GPU traffic and at what rate. A node is judged against
that; what the profile does not state, the hardware states for itself (the NVLink link-count
field, links NVML calls NOT_SUPPORTED as not wired) and the node's GPUs are held to each
other. Without ``hca_names``, NCCL_IB_HCA (NCCL's own selection) names the GPU-traffic HCAs,
else the ports at ``hca_rate_gbps``; other ports (storage, front end, uncabled) at most warn.
HCA expectations apply to runs of two or more nodes only.

A run below a floor fails its check, and the check says by how much. The sweep always reaches
the sizes the floors name, so a floor is measured where it was defined. A profile with floors
that has none for the run's shape (another node count or ranks per node) fails the bandwidth
check: a gate without data is not a pass.
"""
from __future__ import annotations

import copy
import difflib
import functools
import math
from importlib import resources
from typing import Any

import yaml

from ...errors import ConfigError
from .. import rules

DEFAULT = "cpu"
_TOP = {"description": str, "device_name": str, "bandwidth": dict, "compute": dict,
        "sources": list, "expect_transport": str, "multi_node": dict, "health": dict,
        "training": dict}


def names() -> list[str]:
    """The profiles shipped with the package."""
    return sorted(p.name[:-5] for p in resources.files(__package__).iterdir()
                  if p.name.endswith(".yaml"))


def selected(config: dict[str, Any]) -> str:
    """The profile the run asked for (key ``profile``, flag ``--profile``), else ``cpu``."""
    return config.get("profile") or DEFAULT


def load(name: str) -> dict[str, Any]:
    """Read and validate a profile; ConfigError (one line) on any mistake. Read once per
    process (every check and the pre-launch checks ask for it): a copy each time."""
    return copy.deepcopy(_load(name))


def _close(name: str) -> list[str]:
    """The shipped profiles a mistyped name is closest to, whole or by its first part (the
    device: ``h900`` -> h100-8gpu, h200-8gpu)."""
    whole = difflib.get_close_matches(name, names(), n=1)
    stems = {n.split("-")[0]: n for n in names()}
    return whole or [stems[s] for s in difflib.get_close_matches(name.split("-")[0], stems, n=2)]


@functools.lru_cache(maxsize=8)
def _load(name: str) -> dict[str, Any]:
    if name.endswith(".yaml"):
        text = _read_path(name)
    elif name in names():
        text = resources.files(__package__).joinpath(f"{name}.yaml").read_text()
    else:
        close = _close(name)
        raise ConfigError(f"key 'profile' = {name!r}: no such profile"
                          + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
                          + f"; shipped: {', '.join(names())}, or give a path to a .yaml file")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"profile {name}: not valid YAML ({e})") from None
    _validate(name, data)
    return {"name": name, "device_name": "", "bandwidth": {}, "compute": {}, **data}


def _read_path(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"key 'profile' = {path!r}: {e.strerror}") from None


_SECTIONS = {"bandwidth": ("world_size", "nodes", "floors"), "compute": ("min_tflops",),
             "training": ("peak_tflops", "min_mfu"),
             "health": ("gpus_per_node", "pcie_gen", "pcie_width", "nvlink_links", "hca_names",
                        "hca_ports", "hca_rate_gbps")}
_FLOOR = "{collective, size_bytes (int >= 1), min_busbw_gbps (finite number > 0)}"


def _validate(name: str, data: Any) -> None:
    def fail(what: str):
        raise ConfigError(f"profile {name}: {what}")

    if not isinstance(data, dict):
        fail("expected a mapping")
    for key, value in data.items():
        if key not in _TOP:
            fail(f"unknown key {key!r}; valid keys: {', '.join(_TOP)}")
        if not isinstance(value, _TOP[key]):
            fail(f"key {key!r} must be a {_TOP[key].__name__}")
        for sub in value if key in _SECTIONS else ():
            if sub not in _SECTIONS[key]:
                fail(f"unknown key {key}.{sub!r}; valid keys: {', '.join(_SECTIONS[key])}")
    bw = data.get("bandwidth", {})
    floors = bw.get("floors", [])
    if not isinstance(floors, list):
        fail(f"bandwidth.floors = {floors!r}: expected a list of {_FLOOR}")
    for key in ("world_size", "nodes"):
        if floors and not (_integer(bw.get(key)) and bw[key] >= 1):
            fail(f"bandwidth.{key} must be an integer >= 1 when floors are set")
    multi = data.get("multi_node", {})
    unknown = set(multi) - {"fabric", "ranks_per_node", "min_nodes", "floors"}
    if unknown:
        fail(f"multi_node: unknown key {sorted(unknown)[0]!r}; valid keys: fabric, "
             "ranks_per_node, min_nodes, floors")
    for key in ("ranks_per_node", "min_nodes"):
        if multi and not (_integer(multi.get(key)) and multi[key] >= 1):
            fail(f"multi_node.{key} must be an integer >= 1")
    multi_floors = multi.get("floors", [])
    if not isinstance(multi_floors, list):
        fail(f"multi_node.floors = {multi_floors!r}: expected a list of {_FLOOR}")
    for floor in floors + multi_floors:
        if (not isinstance(floor, dict) or set(floor) != {"collective", "size_bytes",
                                                          "min_busbw_gbps"}
                or floor["collective"] not in rules.SWEPT
                or not (_integer(floor["size_bytes"]) and floor["size_bytes"] >= 1)
                or not _positive(floor["min_busbw_gbps"])):
            fail(f"bandwidth floor {floor!r}: expected {_FLOOR}, collective one of "
                 f"{', '.join(rules.SWEPT)}")
    for key, value in data.get("health", {}).items():  # what the health check expects
        if key == "hca_names":
            if not (isinstance(value, list) and value and
                    all(isinstance(v, str) and v for v in value)):
                fail(f"health.hca_names = {value!r}: expected a list of device-name globs")
        elif not (_integer(value) and value >= 1):
            fail(f"health.{key} = {value!r}: expected an integer >= 1")
    for key, value in data.get("training", {}).items():
        if not (_positive(value) and (key != "min_mfu" or value < 1)):
            fail(f"training.{key} = {value!r}: expected a finite number > 0"
                 + (" and < 1 (a share of the peak)" if key == "min_mfu" else ""))
    tflops = data.get("compute", {}).get("min_tflops", {})
    dtypes = rules.GPU_MATMUL_DTYPES  # fp32 is also the CPU's
    if (not isinstance(tflops, dict) or not all(k in dtypes for k in tflops)
            or not all(_positive(v) for v in tflops.values())):
        fail(f"compute.min_tflops = {tflops!r}: must map dtype ({', '.join(dtypes)}) -> "
             "a finite number > 0")


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v: Any) -> bool:
    """A finite number > 0 (a NaN floor would compare False and pass every run)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0)


def floor_sizes(profile: dict[str, Any], collectives, world_size: int | None = None,
                nodes: int | None = None) -> list[int]:
    """The sizes the profile's bandwidth floors name, for the collectives being swept: those
    for this run's shape when given, else all of them."""
    floors = (bandwidth_floors(profile, world_size, nodes)[0] if nodes is not None
              else profile["bandwidth"].get("floors", []) +
              profile.get("multi_node", {}).get("floors", []))
    return [f["size_bytes"] for f in floors if f["collective"] in collectives]


def has_floors(profile: dict[str, Any]) -> bool:
    """Whether the profile gates bandwidth at all (single node or multi-node)."""
    return bool(profile["bandwidth"].get("floors")
                or profile.get("multi_node", {}).get("floors"))


def bandwidth_floors(profile: dict[str, Any], world_size: int,
                     nodes: int) -> tuple[list[dict], str | None]:
    """The floors that apply to a run of this shape, and why none do (None when some do).

    Single-node floors apply to exactly their (world size, nodes); multi-node floors to any
    run of at least ``min_nodes`` nodes with ``ranks_per_node`` ranks on each.
    """
    bw, multi, name = profile["bandwidth"], profile.get("multi_node", {}), profile["name"]
    if bw.get("floors") and (bw["world_size"], bw["nodes"]) == (world_size, nodes):
        return bw["floors"], None
    if (multi.get("floors") and nodes >= multi["min_nodes"]
            and world_size == nodes * multi["ranks_per_node"]):
        return multi["floors"], None
    if not has_floors(profile):
        return [], f"profile {name} sets no bandwidth floors"
    shapes = []
    if bw.get("floors"):
        shapes.append(f"{bw['world_size']} ranks on {bw['nodes']} node(s)")
    if multi.get("floors"):
        shapes.append(f">= {multi['min_nodes']} nodes of {multi['ranks_per_node']} ranks "
                      f"({multi.get('fabric', 'its fabric')})")
    return [], (f"profile {name} has floors for {' and '.join(shapes)}; this run has "
                f"{world_size} ranks on {nodes} node(s)")
