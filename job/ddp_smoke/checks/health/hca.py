"""HCA ports: the ones that carry the GPU traffic, their state, rate, counters and flaps.

Which ports carry the GPU traffic: the profile's ``hca_names`` (glob patterns of device or
``device/port``, e.g. ``rdmap*`` for AWS EFA — on p6-b200 the two ``ibp*`` devices are NVLink
controllers, not NICs: aws/sagemaker-hyperpod-cli#282), else ``NCCL_IB_HCA`` as NCCL reads it
(``^`` excludes, ``=`` exact names, else prefixes; ``:port``), else the ports at the profile's
``hca_rate_gbps``, else every port. The others — storage and front-end NICs, uncabled
ports — are reported and at most warn.

Rules:

* A named GPU-traffic port not ``4: ACTIVE`` / ``5: LinkUp`` or below ``hca_rate_gbps`` fails;
  fewer than ``hca_ports`` such ports up at rate fails the node: LBNL NHC ``check_hw_ib``,
  Azure NHC (400 × 8), gpud (≥ 8 ports at ≥ 400 for H100/H200/B200).
* Counter increases over the run, on active ports: ``link_downed``,
  ``local_link_integrity_errors``, ``excessive_buffer_overrun_errors``, ``rnr_nak_retry_err``
  > 0 fail; ``symbol_error``, ``port_rcv_errors`` > 10/s, ``link_error_recovery`` > 5/min,
  ``port_xmit_discards`` > 100/s, ``local_ack_timeout_err`` > 1/s fail: NVSentinel NIC
  monitor design defaults. A counter at its maximum (IBTA widths: 4 bits for the integrity
  and overrun counters, 8 for link_downed) can no longer rise: not measured, and a warning to
  clear it; "N/A (no PMA)" is not measured.
* A state change seen by the sampler, or ``carrier_changes`` rising by more than
  ``hca_flaps_max`` (0): a link flap during the run fails (NVIDIA Health Validation
  ``rdma_linkflap_fatal``; Azure NHC counts flaps per day).
"""
from __future__ import annotations

from fnmatch import fnmatch

from .finding import Finding, Limits, checked, fail, unmeasured, warn
from .readers.sysfs import COUNTER_BITS
from .reading import delta

# counter → (kind, limit key): "any" fails on any increase; "rate" above the limit per second
COUNTERS = {"link_downed": ("any", None), "local_link_integrity_errors": ("any", None),
            "excessive_buffer_overrun_errors": ("any", None), "rnr_nak_retry_err": ("any", None),
            "symbol_error": ("rate", "hca_symbol_error_per_s"),
            "port_rcv_errors": ("rate", "hca_port_rcv_errors_per_s"),
            "link_error_recovery": ("rate", "hca_link_error_recovery_per_s"),
            "port_xmit_discards": ("rate", "hca_port_xmit_discards_per_s"),
            "local_ack_timeout_err": ("rate", "hca_local_ack_timeout_err_per_s")}
_SOURCE = "NVSentinel NIC monitor design (link-counter-detection.md)"
_RESEAT = "reseat the cable or transceiver; check the switch port; if it recurs, replace it"


def nccl_selects(spec: str, dev: str, port: str) -> bool:
    """Whether NCCL_IB_HCA=``spec`` selects ``dev``'s ``port`` (NCCL's own syntax)."""
    exclude, spec = spec.startswith("^"), spec.lstrip("^")
    exact, spec = spec.startswith("="), spec.lstrip("=")
    hit = False
    for token in filter(None, (t.strip() for t in spec.split(","))):
        name, _, p = token.partition(":")
        if (dev == name if exact else dev.startswith(name)) and (not p or p == port):
            hit = True
    return hit != exclude


def select(ports: dict, expect: dict, nccl_ib_hca: str | None) -> tuple[set, str, bool]:
    """(GPU-traffic ports, how they were chosen, whether they were named explicitly)."""
    names, rate = expect.get("hca_names"), expect.get("hca_rate_gbps")
    if names:
        return ({k for k in ports if any(fnmatch(k.split("/")[0], n) or fnmatch(k, n)
                                         for n in names)}, f"profile hca_names {names}", True)
    if nccl_ib_hca:
        return ({k for k in ports if nccl_selects(nccl_ib_hca, *k.split("/"))},
                f"NCCL_IB_HCA={nccl_ib_hca}", True)
    if rate:
        return ({k for k, p in ports.items() if _up(p) and (p["rate_gbps"] or 0) >= rate},
                f"ports at >= {rate:g} Gb/s", False)
    return set(ports), "every port (no profile hca_names, no NCCL_IB_HCA)", False


def _up(p: dict) -> bool:
    return p["state"] == "4: ACTIVE" and p["phys_state"] == "5: LinkUp"


def judge(node: dict, lim: Limits) -> list[Finding]:
    hca = node.get("hca") or {}
    want = lim.expect
    if hca.get("absent"):
        out = [unmeasured("HCAs", hca["absent"])]
        if want.get("hca_ports"):
            out.append(fail(f"no HCA found ({hca['absent']})", f"the profile expects "
                            f"{want['hca_ports']} HCA ports", "install or reseat the HCAs, "
                            "load the RDMA drivers", "LBNL NHC check_hw_ib"))
        return out
    end = hca.get("end")
    if not end:
        return [unmeasured("HCAs", str(hca.get("unavailable") or "no reading"))]
    chosen, how, explicit = select(end, want, hca.get("nccl_ib_hca"))
    rate, out, good = want.get("hca_rate_gbps"), [], []
    for name, p in end.items():
        fast = rate is None or (p["rate_gbps"] or 0) >= rate
        ours = name in chosen
        if _up(p) and fast:
            good += [name] if ours else []
        else:
            what = (f"state {p['state']!r}, phys_state {p['phys_state']!r}, rate {p['rate']!r}")
            if ours and explicit:
                out.append(fail(what, "expected '4: ACTIVE', '5: LinkUp'" + (
                    f", >= {rate:g} Gb/s" if rate else "") + f" (GPU traffic: {how})",
                    _RESEAT if p["phys_state"] != "5: LinkUp" or _up(p) else
                    "check the subnet manager", "LBNL NHC check_hw_ib; Azure NHC", port=name))
            else:
                out.append(warn(what, f"not judged as GPU traffic ({how})", port=name))
        if _up(p):
            out += _counters(name, p, (hca.get("start") or {}).get(name),
                             float(hca.get("window_s") or 0.0), lim.thresholds, ours)
        out += _flaps(name, p, (hca.get("start") or {}).get(name),
                      (hca.get("states") or {}).get(name, []), lim.thresholds, ours)
    if want.get("hca_ports") and len(good) < want["hca_ports"]:
        out.append(fail(f"{len(good)} GPU-traffic HCA port(s) up at full rate, the profile "
                        f"expects {want['hca_ports']}", f"GPU traffic: {how}; up: "
                        f"{sorted(good)}", "reseat or replace the HCAs and cables named above",
                        "Azure NHC (400 x 8); leptonai/gpud infiniband thresholds"))
    out.append(checked(f"{len(end)} HCA port(s) in sysfs, GPU traffic: {how} "
                       f"({len(good)} up at rate)"))
    return out


def _counters(name: str, p: dict, p0: dict | None, window: float, t: dict,
              ours: bool) -> list[Finding]:
    if p0 is None or window <= 0:
        return [unmeasured(f"HCA port {name} counter increases", "no reading at the start")]
    out, now_all = [], {**p["counters"], **p["hw_counters"]}
    was_all = {**p0.get("counters", {}), **p0.get("hw_counters", {})}
    for counter, (kind, key) in COUNTERS.items():
        a, b = was_all.get(counter), now_all.get(counter)
        if isinstance(b, str) or isinstance(a, str):
            out.append(unmeasured(f"HCA port {name} {counter}", b if isinstance(b, str) else a))
            continue
        bits = COUNTER_BITS.get(counter)
        if bits and (2 ** bits - 1) in (a, b):
            out.append(unmeasured(f"HCA port {name} {counter}", f"saturated at {2 ** bits - 1} "
                                  f"({bits}-bit counter): increases cannot be seen"))
            out.append(warn(f"{counter} saturated at {2 ** bits - 1}", "clear the port counters "
                            "(perfquery -x -R) and rerun", "IBTA PortCounters widths",
                            port=name))
            continue
        rise = delta(b, a)
        if rise is None or rise <= 0:
            continue
        limit = 0.0 if kind == "any" else max(1.0, t[key] * window)
        if rise > limit:
            what = (f"{counter} increased by {rise} during the run" if kind == "any" else
                    f"{counter} at {rise / window:.1f}/s")
            evidence = f"{counter} {a} -> {b} in {window:.0f} s" + (
                f" (limit {t[key]:g}/s)" if key else "")
            out.append(fail(what, evidence, _RESEAT, _SOURCE, port=name) if ours else
                       warn(what, evidence, _SOURCE, port=name))
    return out


def _flaps(name: str, p: dict, p0: dict | None, states: list, t: dict,
           ours: bool) -> list[Finding]:
    carrier = delta(p.get("carrier_changes"), (p0 or {}).get("carrier_changes"))
    changed = len(states) > 1
    if not changed and not (carrier and carrier > t["hca_flaps_max"]):
        return []
    evidence = (f"states seen: {' -> '.join(str(s) for s in states)}" if changed else "") + (
        f"{'; ' if changed else ''}carrier_changes +{carrier}" if carrier else "")
    what = "link flapped during the run"
    source = "NVIDIA Health Validation rdma_linkflap_fatal; Azure NHC ib_link_flapping"
    return [fail(what, evidence, _RESEAT, source, port=name) if ours else
            warn(what, evidence, source, port=name)]
