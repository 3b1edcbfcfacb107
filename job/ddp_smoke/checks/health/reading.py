"""Accessors over one node's reading (what :meth:`readers.Node.finish` returns), shared by the
signal families so that each asks the same questions the same way.

A GPU that NVML cannot reach (its handle refused) or lost (``GPU_IS_LOST`` on any call) is
judged once, by :mod:`.presence`; every other family skips it (:func:`gpus`) instead of
listing each of its readings as not measured.
"""
from __future__ import annotations

from typing import Iterator

from .finding import GpuRef
from .readers.kmsg import bus_key

LOST, UNKNOWN = "NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN"


def gpu_reading(node: dict) -> dict:
    """The NVML reading, ``{}`` when NVML was not opened."""
    g = node.get("gpu") or {}
    return {} if g.get("unavailable") else g


def end_gpus(node: dict) -> list[dict]:
    return (gpu_reading(node).get("end") or {}).get("gpus", [])


def start_gpu(node: dict, index: int) -> dict | None:
    start = (gpu_reading(node).get("start") or {}).get("gpus", [])
    return next((g for g in start if g.get("index") == index), None)


def samples(node: dict, index: int) -> dict | None:
    return (gpu_reading(node).get("samples") or {}).get(str(index))


def window_s(node: dict) -> float:
    return float(gpu_reading(node).get("window_s") or 0.0)


def unreachable(g: dict) -> str | None:
    """The code that refused this GPU's handle, or None."""
    return (g.get("errors") or {}).get("handle")


def lost(node: dict, g: dict) -> bool:
    s = samples(node, g["index"]) or {}
    return LOST in (g.get("errors") or {}).values() or bool(s.get("lost"))


def gpus(node: dict) -> Iterator[dict]:
    """The end snapshot's GPUs that NVML still reaches (the others are presence's)."""
    for g in end_gpus(node):
        if not unreachable(g) and not lost(node, g):
            yield g


def ref(node: dict, index: int, bus: str | None = None) -> GpuRef:
    """What names GPU ``index``: its end reading, else its start reading (a GPU that fell
    off the bus during the run was still named at the start), else ``bus``."""
    end = next((g for g in end_gpus(node) if g.get("index") == index), {})
    start = start_gpu(node, index) or {}
    pick = {k: end.get(k) or start.get(k) for k in ("bus_id", "serial", "uuid")}
    return GpuRef(index, pick["bus_id"] or bus, pick["serial"], pick["uuid"])


def by_bus(node: dict) -> dict:
    """bus_key → GPU index, from every snapshot that named a bus."""
    out = {}
    for snap in ("start", "end"):
        for g in (gpu_reading(node).get(snap) or {}).get("gpus", []):
            if g.get("bus_id"):
                out[bus_key(g["bus_id"])] = g["index"]
    return out


def delta(now, before) -> int | None:
    """An increase between two readings of a counter; None unless both are numbers."""
    if isinstance(now, int) and isinstance(before, int):
        return now - before
    return None
