"""NVLink: every link's state, and its error counters over the run, read link by link.

"By design": a GPU has the links the profile's ``nvlink_links`` says its SKU has (18 on HGX
H100/H200 and B200; export parts such as some H800/H20-class boards have fewer: their profile
says so). Without a profile, the part itself says: the link-count field
(``NVML_FI_DEV_NVLINK_LINK_COUNT``) and, within it, links answering NOT_SUPPORTED (not wired
on this board) are by design; a link that exists and is not up is down.

Rules:

* Fewer links up than the profile's ``nvlink_links`` fails (naming the down, unwired and
  unreadable links); without a profile, a link down on a GPU that has others up, or whose node
  peers have links up, fails: DCGM health ``DCGM_FR_NVLINK_DOWN``, Azure NHC (``<inactive>``).
  A GPU without NVLink at all (PCIe cards, NVIDIA/NVSentinel#1481) fails only against a
  profile that expects links.
* Per link (``nvmlDeviceGetNvLinkErrorCounter``; the all-link total fields read 0 on Hopper,
  DataDog/datadog-agent#55966): replay or recovery increase > ``nvlink_replay_recovery_max``
  (0) fails; CRC flit errors ≥ ``nvlink_crc_per_s_max`` (100/s) fail, fewer warn: DCGM health,
  ``DCGM_LIMIT_MAX_NVLINK_CRC_ERROR``.
"""
from __future__ import annotations

from collections import Counter

from .finding import Finding, Limits, checked, fail, warn
from .reading import delta, gpus, ref, start_gpu, window_s

_ACTION = "reset the GPU; if it persists, drain and RMA (NVLink / NVSwitch baseboard)"
_SOURCE = "DCGM health DCGM_FR_NVLINK_DOWN; Azure NHC azure_gpu_nvlink.nhc"


def judge(node: dict, lim: Limits) -> list[Finding]:
    out, expected = [], lim.expect.get("nvlink_links")
    all_gpus = list(gpus(node))
    peers_up = any((g.get("nvlink") or {}).get("up") for g in all_gpus)
    counts = Counter((g.get("nvlink") or {}).get("count") for g in all_gpus if g.get("nvlink"))
    for g in all_gpus:
        gpu, links = ref(node, g["index"]), g.get("nvlink")
        if links is None:
            if expected:
                code = (g.get("errors") or {}).get("nvlink_count", "link count 0")
                out.append(fail(f"no NVLink, the profile expects {expected} links",
                                f"NVML_FI_DEV_NVLINK_LINK_COUNT: {code}", _ACTION, _SOURCE,
                                gpu=gpu))
            continue
        out += _state(links, expected, peers_up, gpu)
        out += _counters(links, (start_gpu(node, g["index"]) or {}).get("nvlink"),
                         window_s(node), lim.thresholds, gpu)
    if counts:
        design = ", ".join(f"{n} GPU(s) with {c} links" for c, n in sorted(counts.items()))
        out.append(checked(f"NVLink state and per-link error counters ({design}"
                           + (f"; profile: {expected}" if expected else "") + ")"))
    return out


def _state(links: dict, expected: int | None, peers_up: bool, gpu) -> list[Finding]:
    up, down = links["up"], links["down"]
    detail = "; ".join(x for x in (
        f"down: {_list(down)}" if down else "",
        f"not wired (NOT_SUPPORTED): {_list(links['unsupported'])}" if links["unsupported"] else "",
        "unreadable: " + ", ".join(f"{k} ({v})" for k, v in links["unreadable"].items())
        if links["unreadable"] else "") if x)
    evidence = f"{len(up)} of {links['count']} links up" + (f"; {detail}" if detail else "")
    if expected and len(up) < expected:
        return [fail(f"{len(up)} of the profile's {expected} NVLink links up", evidence,
                     _ACTION, _SOURCE, gpu=gpu)]
    if down and (up or peers_up or expected):
        return [fail(f"NVLink link(s) {_list(down)} down", evidence, _ACTION, _SOURCE, gpu=gpu)]
    return []


def _list(links) -> str:
    return ", ".join(str(x) for x in links)


def _counters(links: dict, before: dict | None, window: float, t: dict, gpu) -> list[Finding]:
    out, then = [], (before or {}).get("counters", {})
    for link, now in sorted(links["counters"].items(), key=lambda kv: int(kv[0])):
        was = then.get(link, {})
        for kind in ("replay", "recovery"):
            rise = delta(now.get(kind), was.get(kind))
            if rise and rise > t["nvlink_replay_recovery_max"]:
                out.append(fail(f"NVLink link {link}: {rise} {kind} error(s) during the run",
                                f"nvmlDeviceGetNvLinkErrorCounter({kind}) {was[kind]} -> "
                                f"{now[kind]}", _ACTION, "DCGM health NVLINK_ERROR_CRITICAL",
                                gpu=gpu))
        crc = delta(now.get("crc_flit"), was.get("crc_flit"))
        if crc and window > 0:
            rate, source = crc / window, "DCGM_LIMIT_MAX_NVLINK_CRC_ERROR"
            if rate >= t["nvlink_crc_per_s_max"]:
                out.append(fail(f"NVLink link {link}: CRC errors at {rate:.0f}/s",
                                f"crc_flit +{crc} in {window:.0f} s", _ACTION, source, gpu=gpu))
            elif rate > 0:
                out.append(warn(f"NVLink link {link}: CRC errors at {rate:.2f}/s (below "
                                f"{t['nvlink_crc_per_s_max']:g}/s)", "", source, gpu=gpu))
    return out
