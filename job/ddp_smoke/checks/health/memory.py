"""Memory: ECC mode and errors, remapped rows, retired pages, the driver's recovery action.

Rules (thresholds in defaults.yaml ``health``, each with its source):

* ECC off: the counters below read NOT_SUPPORTED with ECC off (nvml.h), and an HBM bit flip
  goes unseen; issue 22.
* Volatile uncorrected ECC > ``ecc_uncorrected_volatile_max`` (0): GCM, Google CHS, AWS check 0,
  DCGM health (``DCGM_FR_VOLATILE_DBE_DETECTED``).
* Remapped rows (A100 and later): failure → RMA (NVIDIA A100 memory error management: a remap
  failure is the RMA criterion); uncorrectable ≥ ``row_remap_uncorrectable_limit`` (512,
  ``DCGM_LIMIT_MAX_ROW_REMAP_UNCORRECTABLE``) → RMA; pending → reset (the remap happens at the
  next reset; DCGM ``checkRowRemapping``).
* Retired pages (before Ampere): SBE + DBE ≥ ``retired_pages_limit`` (63,
  ``DCGM_LIMIT_MAX_RETIRED_PAGES``) → RMA; pending → reset.
* Recovery action (field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) ≠ none: the driver's own
  request (DCGM level 1 ``checkGpuRecoveryState``).
"""
from __future__ import annotations

from .finding import Finding, Limits, fail
from .reading import gpus, ref

# nvmlGpuRecoveryAction_t (nvml.h) → what the operator does
RECOVERY_ACTIONS = {1: "reset the GPU", 2: "reboot the node",
                    3: "drain peer-to-peer traffic, then reset the GPU",
                    4: "drain the node, then reset the GPU", 5: "recover the IMEX domain",
                    6: "reset the PCIe bus", 7: "reboot the system"}
_RMA = "drain and RMA (a remap failure is NVIDIA's RMA criterion)"


def judge(node: dict, lim: Limits) -> list[Finding]:
    out, t = [], lim.thresholds
    for g in gpus(node):
        gpu = ref(node, g["index"])
        if g.get("ecc_enabled") is False:
            out.append(fail("ECC is off", "nvmlDeviceGetEccMode current = disabled",
                            "enable ECC (nvidia-smi -e 1) and reset the GPU",
                            "issue 22; nvml.h (ECC counters unsupported with ECC off)", gpu=gpu))
        unc = g.get("ecc_uncorrected_volatile")
        if unc is not None and unc > t["ecc_uncorrected_volatile_max"]:
            out.append(fail(f"{unc} volatile uncorrected ECC error(s)", "nvmlDeviceGetTotalEcc"
                            f"Errors(UNCORRECTED, VOLATILE) = {unc} > "
                            f"{t['ecc_uncorrected_volatile_max']}", "reset the GPU; if it "
                            "recurs, drain and RMA", "GCM; Google CHS; AWS check 0; DCGM "
                            "DCGM_FR_VOLATILE_DBE_DETECTED", gpu=gpu))
        out += _rows(g.get("remapped_rows"), t, gpu)
        out += _pages(g.get("retired_pages"), t, gpu)
        action = g.get("recovery_action")
        if action:
            out.append(fail(f"the driver asks for recovery action {action}",
                            f"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = {action}",
                            RECOVERY_ACTIONS.get(action, "see nvmlGpuRecoveryAction_t"),
                            "DCGM level 1 checkGpuRecoveryState", gpu=gpu))
    return out


def _rows(rows: dict | None, t: dict, gpu) -> list[Finding]:
    if rows is None:
        return []
    source = "DCGM checkRowRemapping; NVIDIA A100 GPU memory error management"
    evidence = (f"nvmlDeviceGetRemappedRows: correctable {rows['correctable']}, uncorrectable "
                f"{rows['uncorrectable']}, pending {rows['pending']}, failure {rows['failure']}")
    if rows["failure"]:
        return [fail("row remapping failed", evidence, _RMA, source, gpu=gpu)]
    if rows["uncorrectable"] >= t["row_remap_uncorrectable_limit"]:
        return [fail(f"{rows['uncorrectable']} rows remapped for uncorrectable errors",
                     f"{evidence} (limit {t['row_remap_uncorrectable_limit']})",
                     "drain and RMA", "DCGM_LIMIT_MAX_ROW_REMAP_UNCORRECTABLE", gpu=gpu)]
    if rows["pending"]:
        return [fail("row remap pending", evidence,
                     "reset the GPU (the remap happens at the next reset)", source, gpu=gpu)]
    return []


def _pages(pages: dict | None, t: dict, gpu) -> list[Finding]:
    if pages is None:
        return []
    total = pages["sbe"] + pages["dbe"]
    evidence = f"retired pages: {pages['sbe']} SBE, {pages['dbe']} DBE, pending {pages['pending']}"
    if total >= t["retired_pages_limit"]:
        return [fail(f"{total} retired pages", f"{evidence} (limit {t['retired_pages_limit']})",
                     "drain and RMA", "DCGM_LIMIT_MAX_RETIRED_PAGES", gpu=gpu)]
    if pages["pending"]:
        return [fail("page retirement pending", evidence,
                     "reset the GPU (pages retire at the next reset)", "DCGM level 1 page "
                     "retirement", gpu=gpu)]
    return []
