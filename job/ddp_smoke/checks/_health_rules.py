"""The health check's judging: pure functions from one node's readings to findings.

Input: a node's readings as :mod:`._gpu` and :mod:`._hca` record them (JSON; tests feed
recorded ones), the ``health`` section of defaults.yaml (``lim``) and the profile's
``health`` section (``want``: what the hardware should be). Output::

    {"findings": [{"gpu": index|None, "uuid", "port", "what", "evidence", "action"}],
     "warnings": [str], "not_measured": [str], "checked": [str]}

A finding fails the check; a warning is printed and kept; "not measured" says what could not
be judged and why (an unsupported reading is never read as a pass). Every threshold's source
is beside its key in defaults.yaml and in README "Hardware health".
"""
from __future__ import annotations

import math

from ._gpu import bus_key

# NVML_GPU_RECOVERY_ACTION_* (nvml.h) → what the operator does
RECOVERY_ACTIONS = {1: "reset the GPU", 2: "reboot the node",
                    3: "drain peer-to-peer traffic, then reset the GPU",
                    4: "drain the node, then reset the GPU", 5: "recover the IMEX domain",
                    6: "reset the PCIe bus", 7: "reboot the system"}
# XIDs and what to do (NVIDIA XID catalogue; DCGM health "devastating" set; AWS check 0)
XID_ACTIONS = {79: "reboot the node (GPU fell off the bus); if it recurs, drain and RMA",
               74: "reset the GPU and check its NVLink (reseat); if it recurs, drain and RMA",
               48: "reset the GPU (double-bit ECC); if it recurs, drain and RMA",
               64: "reset the GPU (row remap failure); drain and RMA",
               92: "reset the GPU (high single-bit ECC rate)",
               95: "reset the GPU (uncontained ECC error)",
               119: "reset the GPU (GSP timeout)", 120: "reset the GPU (GSP error)",
               140: "reset the GPU (unrecovered ECC error)"}
FABRIC_COMPLETED, NVML_SUCCESS, DEGRADED_BW_TRUE = 3, 0, 1
# PCIe line rate per lane (GT/s) by generation: DCGM's expected replay rate is BER x rate
GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
HW_REASONS = {"hw_slowdown": "HW slowdown (clocks cut by half or more)",
              "hw_thermal": "HW thermal slowdown", "hw_power_brake": "HW power brake"}


class _Out:
    def __init__(self):
        self.findings, self.warnings, self.not_measured, self.checked = [], [], [], []

    def gpu(self, g: dict, what: str, evidence: str, action: str) -> None:
        self.findings.append({"gpu": g.get("index"), "uuid": g.get("uuid"), "port": None,
                              "what": f"{label(g)}: {what}", "evidence": evidence,
                              "action": action})

    def port(self, name: str, what: str, evidence: str, action: str) -> None:
        self.findings.append({"gpu": None, "uuid": None, "port": name,
                              "what": f"HCA port {name}: {what}", "evidence": evidence,
                              "action": action})

    def node(self, what: str, evidence: str, action: str) -> None:
        self.findings.append({"gpu": None, "uuid": None, "port": None, "what": what,
                              "evidence": evidence, "action": action})

    def as_dict(self) -> dict:
        return {"findings": self.findings, "warnings": self.warnings,
                "not_measured": self.not_measured, "checked": self.checked}


def label(g: dict) -> str:
    """"GPU 3 (bus 00000000:3A:00.0, serial 1654922006536)": what a repair ticket needs."""
    return (f"GPU {g.get('index')} (bus {g.get('bus_id') or '?'}, "
            f"serial {g.get('serial') or 'unreadable'})")


def judge_node(node: dict, lim: dict, want: dict) -> dict:
    """Everything judged on one node: its GPUs, its HCAs."""
    out = _Out()
    gpu = node.get("gpu") or {}
    if gpu.get("unavailable"):
        out.not_measured.append(f"GPUs: {gpu['unavailable']}")
    else:
        judge_gpus(gpu, lim, want, node.get("cuda_ranks", 0), node.get("run_pids"), out)
    hca = node.get("hca") or {}
    if hca.get("absent"):
        out.not_measured.append(f"HCAs: {hca['absent']}")
        if want.get("hca_ports"):
            out.node(f"no HCA found ({hca['absent']})",
                     f"the profile expects {want['hca_ports']} HCA ports",
                     "install or reseat the HCAs, load the RDMA drivers")
    else:
        judge_hcas(hca, lim, want, out)
    return out.as_dict()


# -- GPUs -----------------------------------------------------------------------------------

def judge_gpus(gpu: dict, lim: dict, want: dict, cuda_ranks: int, run_pids, out: _Out) -> None:
    start, end = gpu.get("start") or {}, gpu.get("end") or {}
    gpus, count = end.get("gpus", []), end.get("count")
    out.checked.append(f"{len(gpus)} GPU(s) through NVML, driver {end.get('driver')}")
    expected = want.get("gpus_per_node")
    if expected is not None and count != expected:
        out.node(f"{count} GPU(s) on the node, the profile expects {expected}",
                 f"nvmlDeviceGetCount = {count}", "reseat or replace the missing GPU; reboot")
    elif count is not None and count < cuda_ranks:
        out.node(f"{count} GPU(s) visible to NVML for {cuda_ranks} GPU ranks",
                 f"nvmlDeviceGetCount = {count}", "reseat or replace the missing GPU; reboot")
    before = {g.get("uuid"): g for g in start.get("gpus", [])}
    # NVML shows this run's own PIDs somewhere on the node: its PID view is this one's
    ours = run_pids is not None and any(p["pid"] in run_pids for g in gpus
                                        for p in g.get("processes") or ())
    for g in gpus:
        if g.get("lost"):
            out.gpu(g, "lost (NVML_ERROR_GPU_IS_LOST)", "; ".join(
                f"{k}: {v}" for k, v in (g.get("not_measured") or {}).items())[:300],
                "reboot the node; if it recurs, drain and RMA")
            continue
        for what, why in (g.get("not_measured") or {}).items():
            out.not_measured.append(f"{label(g)} {what}: {why}")
        _memory(g, lim, out)
        _config(g, lim, run_pids, ours, out)
        _counters(g, before.get(g.get("uuid")), gpu.get("window_s") or 0.0, lim, want, out)
    _vbios(gpus, out)
    _xids(gpu, gpus, lim, out)
    _load(gpu, gpus, lim, want, out)


def _memory(g: dict, lim: dict, out: _Out) -> None:
    if g.get("ecc_enabled") is False:
        out.gpu(g, "ECC is off", "nvmlDeviceGetEccMode current = disabled",
                "enable ECC (nvidia-smi -e 1) and reset the GPU")
    unc = g.get("ecc_uncorrected_volatile")
    if unc is not None and unc > lim["ecc_uncorrected_volatile_max"]:
        out.gpu(g, f"{unc} volatile uncorrected ECC error(s)",
                f"volatile uncorrected ECC = {unc} > {lim['ecc_uncorrected_volatile_max']}",
                "reset the GPU; if it recurs, drain and RMA")
    rows = g.get("remapped_rows")
    if rows is not None:
        if rows["failure"]:
            out.gpu(g, "row remapping failed", f"remapped rows {rows}",
                    "drain and RMA (a remap failure is NVIDIA's RMA criterion)")
        elif rows["uncorrectable"] >= lim["row_remap_uncorrectable_limit"]:
            out.gpu(g, f"{rows['uncorrectable']} rows remapped for uncorrectable errors",
                    f"remapped rows {rows} (limit {lim['row_remap_uncorrectable_limit']})",
                    "drain and RMA")
        elif rows["pending"]:
            out.gpu(g, "row remap pending", f"remapped rows {rows}",
                    "reset the GPU (the remap happens at the next reset)")
    pages = g.get("retired_pages")
    if pages is not None:
        total = pages["sbe"] + pages["dbe"]
        if total >= lim["retired_pages_limit"]:
            out.gpu(g, f"{total} retired pages", f"retired pages {pages} (limit "
                    f"{lim['retired_pages_limit']})", "drain and RMA")
        elif pages["pending"]:
            out.gpu(g, "page retirement pending", f"retired pages {pages}",
                    "reset the GPU (pages retire at the next reset)")
    action = g.get("recovery_action")
    if action:
        out.gpu(g, f"the driver asks for recovery action {action}",
                f"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = {action}",
                RECOVERY_ACTIONS.get(action, "see NVML_GPU_RECOVERY_ACTION"))


def _config(g: dict, lim: dict, run_pids, ours: bool, out: _Out) -> None:
    if g.get("mig_enabled"):
        out.gpu(g, "MIG is on", "nvmlDeviceGetMigMode current = enabled (training needs the "
                "whole GPU; row-remap and NVLink readings are unsupported under MIG)",
                "disable MIG (nvidia-smi -mig 0) and reset the GPU")
    if g.get("persistence") is False and lim["require_persistence_mode"]:
        out.gpu(g, "persistence mode is off", "nvmlDeviceGetPersistenceMode = disabled",
                "enable persistence (nvidia-persistenced, or nvidia-smi -pm 1)")
    fabric = g.get("fabric")
    if fabric is not None:
        bad = (fabric["state"] != FABRIC_COMPLETED or fabric["status"] != NVML_SUCCESS
               or fabric["health_mask"] & 0x3 == DEGRADED_BW_TRUE)
        if bad:
            out.gpu(g, "NVSwitch fabric not ready or degraded", f"fabric {fabric} (want state "
                    f"{FABRIC_COMPLETED} completed, status 0, no degraded bandwidth)",
                    "restart nvidia-fabricmanager; if it persists, reboot the node")
    procs = g.get("processes")
    if procs is None or run_pids is None:
        return
    stray = [p for p in procs if p["pid"] not in run_pids]
    if stray and ours:
        out.gpu(g, f"{len(stray)} process(es) of another job hold GPU memory",
                "; ".join(f"pid {p['pid']} {p['used_mib']} MiB" for p in stray[:5]),
                "stop the stray processes (or drain the node until they end)")
    elif stray:
        out.not_measured.append(f"{label(g)} stray processes: NVML does not show this run's "
                                "own PIDs (another PID namespace)")


def _vbios(gpus: list[dict], out: _Out) -> None:
    seen: dict[str, list] = {}
    for g in gpus:
        if g.get("vbios"):
            seen.setdefault(g["vbios"], []).append(g)
    if len(seen) > 1:
        common = max(seen, key=lambda v: len(seen[v]))
        for v, odd in seen.items():
            for g in odd if v != common else ():
                out.gpu(g, f"VBIOS {v} differs from the node's {common}",
                        f"VBIOS versions on the node: {sorted(seen)}",
                        f"flash VBIOS {common} (the node's common one)")


def _counters(g: dict, g0: dict | None, window_s: float, lim: dict, want: dict,
              out: _Out) -> None:
    """Increases across the run: PCIe replays, NVLink replay/recovery/CRC."""
    links = g.get("nvlink_up")
    if links is not None:
        down = [k for k, up in links.items() if not up]
        expected = want.get("nvlink_links")
        if down and (expected or len(down) < len(links)):
            out.gpu(g, f"NVLink link(s) {', '.join(down)} down", f"{len(links) - len(down)} of "
                    f"{len(links)} links up", "reset the GPU; if it persists, drain and RMA "
                    "(NVLink/NVSwitch)")
        if expected and len(links) < expected:
            out.gpu(g, f"{len(links)} NVLink links, the profile expects {expected}",
                    f"nvmlDeviceGetNvLinkState answers for {len(links)} links",
                    "reset the GPU; if it persists, drain and RMA")
    if g0 is None or window_s <= 0:
        out.not_measured.append(f"{label(g)} counter increases: no reading at the run's start")
        return
    delta = {k: g[k] - g0[k] for k in ("pcie_replay", "nvlink_replay", "nvlink_recovery",
                                       "nvlink_crc_flit")
             if g.get(k) is not None and g0.get(k) is not None}
    gen, width = g.get("pcie_max_gen"), g.get("pcie_max_width")
    if "pcie_replay" in delta and gen in GT_PER_S and width:
        per_min = math.ceil(lim["pcie_replay_ber"] * GT_PER_S[gen] * 1e9 * 60 * width)
        allowed = per_min * max(1.0, window_s / 60)
        if delta["pcie_replay"] > allowed:
            out.gpu(g, f"{delta['pcie_replay']} PCIe replays in {window_s:.0f} s",
                    f"allowed {allowed:.0f} at Gen{gen} x{width} (BER "
                    f"{lim['pcie_replay_ber']:g})", "reseat the GPU (PCIe riser/retimer); if it "
                    "recurs, drain and RMA")
    for k in ("nvlink_replay", "nvlink_recovery"):
        if delta.get(k, 0) > lim["nvlink_replay_recovery_max"]:
            out.gpu(g, f"{delta[k]} NVLink {k.split('_')[1]} error(s) during the run",
                    f"{k} increased by {delta[k]}", "reset the GPU; if it recurs, drain and RMA")
    crc = delta.get("nvlink_crc_flit", 0) / window_s
    if crc >= lim["nvlink_crc_per_s_max"]:
        out.gpu(g, f"NVLink CRC errors at {crc:.0f}/s", f"crc_flit increased by "
                f"{delta['nvlink_crc_flit']} in {window_s:.0f} s", "reset the GPU; if it "
                "recurs, drain and RMA")
    elif crc > 0:
        out.warnings.append(f"{label(g)}: NVLink CRC errors at {crc:.2f}/s (below "
                            f"{lim['nvlink_crc_per_s_max']:g}/s)")


def _xids(gpu: dict, gpus: list[dict], lim: dict, out: _Out) -> None:
    by_uuid = {g.get("uuid"): g for g in gpus}
    by_bus = {bus_key(g.get("bus_id") or ""): g for g in gpus}
    if gpu.get("xid_events"):
        out.not_measured.append(gpu["xid_events"])
    else:
        out.checked.append("XID events during the run (NVML event set)")
    seen = [(by_uuid.get(e.get("uuid")), e["xid"], "during the run") for e in gpu.get("xids", [])]
    if gpu.get("kernel_xids") is None:
        out.not_measured.append(f"past XIDs: {gpu.get('kernel_xids_why') or 'not read'}")
    else:
        out.checked.append(f"kernel log XIDs of the last {lim['xid_window_s']:.0f} s")
        if gpu.get("kernel_xids_why"):  # read in part only
            out.not_measured.append(f"past XIDs: {gpu['kernel_xids_why']}")
        seen += [(by_bus.get(bus_key(e["bus"])), e["xid"], f"{e['age_s']:.0f} s ago (kernel log)")
                 for e in gpu["kernel_xids"]
                 if e.get("age_s") is None or e["age_s"] <= lim["xid_window_s"]]
    for g, xid, when in seen:
        g = g or {"index": None}
        if xid in lim["xid_critical"]:
            out.gpu(g, f"XID {xid} {when}", f"XID {xid} is critical",
                    XID_ACTIONS.get(xid, "reset the GPU; if it recurs, drain and RMA"))
        elif xid not in lim["xid_ignored"]:
            out.warnings.append(f"{label(g)}: XID {xid} {when}")



def _load(gpu: dict, gpus: list[dict], lim: dict, want: dict, out: _Out) -> None:
    """Rules on the samples taken while the other checks loaded the GPUs."""
    samples = gpu.get("samples")
    if samples is None:
        out.not_measured.append("under-load readings: no sampler ran")
        return
    for g, s in zip(gpus, samples):
        if s.get("errors"):
            out.not_measured.append(f"{label(g)} sampling: {s['errors']}")
        if not s["busy"]:
            out.not_measured.append(f"{label(g)} under load: never busy in {s['n']} "
                                    "sample(s) (clock reasons, PCIe link)")
            continue
        for name, words in HW_REASONS.items():
            share = s[name] / s["busy"]
            if share >= lim["hw_slowdown_fraction"]:
                out.gpu(g, f"{words} in {share:.0%} of busy samples", f"{s[name]} of "
                        f"{s['busy']} busy samples (limit {lim['hw_slowdown_fraction']:.0%}); "
                        "explains a low compute or bandwidth figure on this GPU",
                        "inspect cooling and power supply; if it persists, drain and RMA")
        if s["sw_thermal"]:
            out.warnings.append(f"{label(g)}: SW thermal slowdown in {s['sw_thermal']} of "
                                f"{s['busy']} busy samples")
        gen_want = want.get("pcie_gen") or g.get("pcie_max_gen")
        width_want = want.get("pcie_width") or g.get("pcie_max_width")
        gen, width = s["pcie_gen_busy_max"], s["pcie_width_busy_max"]
        if (gen_want and gen < gen_want) or (width_want and width < width_want):
            out.gpu(g, f"PCIe link at Gen{gen} x{width} under load, expected Gen{gen_want} "
                    f"x{width_want}", f"best of {s['busy']} busy samples; device/system "
                    f"maximum Gen{g.get('pcie_max_gen')} x{g.get('pcie_max_width')}",
                    "reseat the GPU (riser, retimer, cable); if it persists, drain and RMA")
    out.checked.append("clock-event reasons and PCIe link under load")


# -- HCAs -----------------------------------------------------------------------------------

# counter → (kind, limit key): "fatal" fails on any increase; "rate" above limit per second
HCA_COUNTERS = {"link_downed": ("fatal", None),
                "local_link_integrity_errors": ("fatal", None),
                "excessive_buffer_overrun_errors": ("fatal", None),
                "symbol_error": ("rate", "hca_symbol_error_per_s"),
                "port_rcv_errors": ("rate", "hca_port_rcv_errors_per_s"),
                "link_error_recovery": ("rate", "hca_link_error_recovery_per_s")}


def judge_hcas(hca: dict, lim: dict, want: dict, out: _Out) -> None:
    start, end, window = hca.get("start") or {}, hca.get("end") or {}, hca.get("window_s") or 0.0
    rate_want = want.get("hca_rate_gbps")
    good = []
    for name, p in end.items():
        active = p["state"] == "4: ACTIVE" and p["phys_state"] == "5: LinkUp"
        fast = rate_want is None or (p["rate_gbps"] or 0) >= rate_want
        if active and fast:
            good.append(name)
        elif want.get("hca_ports"):
            out.port(name, f"state {p['state']!r}, phys_state {p['phys_state']!r}, rate "
                     f"{p['rate']!r}", "expected '4: ACTIVE', '5: LinkUp'"
                     + (f", >= {rate_want:g} Gb/s" if rate_want else ""),
                     "reseat the cable or transceiver; check the switch port and subnet manager"
                     if active or p["phys_state"] != "5: LinkUp" else "check the subnet manager")
        else:
            out.warnings.append(f"HCA port {name}: state {p['state']!r}, phys_state "
                                f"{p['phys_state']!r}, rate {p['rate']!r}")
        if active:
            _hca_counters(name, p, start.get(name), window, lim, out)
    if want.get("hca_ports") and len(good) < want["hca_ports"]:
        out.node(f"{len(good)} HCA port(s) up at full rate, the profile expects "
                 f"{want['hca_ports']}", f"ports: {sorted(end)}",
                 "reseat or replace the HCAs and cables named above")
    out.checked.append(f"{len(end)} HCA port(s) in sysfs ({len(good)} active)")


def _hca_counters(name: str, p: dict, p0: dict | None, window_s: float, lim: dict,
                  out: _Out) -> None:
    if p0 is None or window_s <= 0:
        out.not_measured.append(f"HCA port {name} counter increases: no reading at the start")
        return
    for counter, (kind, key) in HCA_COUNTERS.items():
        a, b = p0["counters"].get(counter), p["counters"].get(counter)
        if a is None or b is None:
            continue
        delta = b - a
        if kind == "fatal" and delta > 0:
            out.port(name, f"{counter} increased by {delta} during the run",
                     f"{counter} {a} -> {b} in {window_s:.0f} s",
                     "reseat the cable or transceiver; if it recurs, replace it")
        elif kind == "rate" and delta > max(1.0, lim[key] * window_s):
            out.port(name, f"{counter} at {delta / window_s:.1f}/s", f"{counter} {a} -> {b} in "
                     f"{window_s:.0f} s (limit {lim[key]:g}/s)",
                     "reseat the cable or transceiver; if it recurs, replace it")
