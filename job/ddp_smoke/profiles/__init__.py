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
    compute:
      min_tflops: {bf16: 676.0}   # per rank and dtype (fp32 on CPU)
    sources: [where each number comes from]

A run below a floor fails its check, and the check says by how much. The sweep always reaches
the sizes the floors name, so a floor is measured where it was defined.
"""
from __future__ import annotations

import math
from importlib import resources
from typing import Any

import yaml

from .. import limits
from ..config import ConfigError

DEFAULT = "cpu"
_TOP = {"description": str, "device_name": str, "bandwidth": dict, "compute": dict,
        "sources": list}


def names() -> list[str]:
    """The profiles shipped with the package."""
    return sorted(p.name[:-5] for p in resources.files(__package__).iterdir()
                  if p.name.endswith(".yaml"))


def selected(config: dict[str, Any]) -> str:
    """The profile the run asked for (key ``profile``, flag ``--profile``), else ``cpu``."""
    return config.get("profile") or DEFAULT


def load(name: str) -> dict[str, Any]:
    """Read and validate a profile; ConfigError (one line) on any mistake."""
    if name.endswith(".yaml"):
        text = _read_path(name)
    elif name in names():
        text = resources.files(__package__).joinpath(f"{name}.yaml").read_text()
    else:
        raise ConfigError(f"key 'profile' = {name!r}: no such profile; shipped: "
                          f"{', '.join(names())}, or give a path to a .yaml file")
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


_SECTIONS = {"bandwidth": ("world_size", "nodes", "floors"), "compute": ("min_tflops",)}
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
    for floor in floors:
        if (not isinstance(floor, dict) or set(floor) != {"collective", "size_bytes",
                                                          "min_busbw_gbps"}
                or floor["collective"] not in limits.SWEPT
                or not (_integer(floor["size_bytes"]) and floor["size_bytes"] >= 1)
                or not _positive(floor["min_busbw_gbps"])):
            fail(f"bandwidth floor {floor!r}: expected {_FLOOR}, collective one of "
                 f"{', '.join(limits.SWEPT)}")
    tflops = data.get("compute", {}).get("min_tflops", {})
    dtypes = limits.GPU_MATMUL_DTYPES  # fp32 is also the CPU's
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


def floor_sizes(profile: dict[str, Any], collectives) -> list[int]:
    """The sizes the profile's bandwidth floors name, for the collectives being swept."""
    return [f["size_bytes"] for f in profile["bandwidth"].get("floors", [])
            if f["collective"] in collectives]


def bandwidth_applies(profile: dict[str, Any], world_size: int, nodes: int) -> str | None:
    """None when the bandwidth floors apply to this run, else the reason they do not."""
    bw = profile["bandwidth"]
    if not bw.get("floors"):
        return f"profile {profile['name']} sets no bandwidth floors"
    if (bw["world_size"], bw["nodes"]) != (world_size, nodes):
        return (f"profile {profile['name']} floors are for {bw['world_size']} ranks on "
                f"{bw['nodes']} node(s); this run has {world_size} on {nodes}")
    return None
