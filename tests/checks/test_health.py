"""The health check's rules, each on a recorded node read through the real readers.

Every test reads a recording from tests/data/health (PROVENANCE.md) with the readers the
check uses — NVML through the replay binding, sysfs/procfs/kmsg from the recording's tree —
and judges it with the check's own families; a test changes a recording only by a patch, as
a fault file does. The issue-33 defects each have a test here that the earlier code failed
(named ``test_defect_N_…``); tests/checks/test_health_replay.py drives the same recordings
through real torchrun runs.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from ddp_smoke.checks.health import readers
from ddp_smoke.checks.health.finding import CHECKED, NOT_MEASURED, WARN
from ddp_smoke.checks.health.readers import kmsg, nvml, replay, sysfs

from tests.checks.health_replay import DATA, fails, judged, level, read, recording

H200 = "h200_8gpu_healthy"
EXPECT_H200 = {"gpus_per_node": 8, "pcie_gen": 5, "pcie_width": 16, "nvlink_links": 18}


def test_every_recording_names_its_public_source():
    table = (DATA / "PROVENANCE.md").read_text()
    for path in DATA.glob("*.json"):
        body = json.loads(path.read_text())
        assert body["source"] and body["excerpt"] and body["transcribed"], path.name
        assert path.name in table and all(url in table for url in body["source"]), path.name


def test_healthy_h200_node_passes_with_every_family_read(tmp_path):
    out = judged(read(recording(tmp_path, H200)), EXPECT_H200, gpu_run=True)
    assert fails(out) == [] and level(out, WARN) == []
    checked = " | ".join(level(out, CHECKED))
    for what in ("8 GPU(s) through NVML (driver 570.195.03", "XID events during the run",
                 "kernel log (2 records)", "clock-event reasons under load on 8 GPU(s)",
                 "8 GPU(s) with 18 links; profile: 18", "fabric registration of 8 GPU(s)",
                 "10 HCA port(s) in sysfs"):
        assert what in checked, what


# -- one fault per GPU: the exact culprit set ------------------------------------------------

def test_one_fault_per_gpu_names_each_gpu_with_its_action(tmp_path):
    out = judged(read(recording(tmp_path, "h200_faults_per_gpu")), EXPECT_H200)
    got = {(f.gpu.index, f.gpu.bus_id, f.gpu.serial, f.what, f.action.split(";")[0])
           for f in out if f.level == "fail"}
    bus = ["1B", "43", "52", "61", "9D", "C3", "D1", "DF"]
    want = [(0, "row remap pending", "reset the GPU (the remap happens at the next reset)"),
            (1, "row remapping failed", "drain and RMA (a remap failure is NVIDIA's RMA "
                                        "criterion)"),
            (2, "1 volatile uncorrected ECC error(s)", "reset the GPU"),
            (3, "17 of the profile's 18 NVLink links up", "reset the GPU"),
            (4, "NVLink link 7: 3 replay error(s) during the run", "reset the GPU"),
            (5, "HW slowdown (clocks cut by half or more) in 100% of busy samples",
             "inspect cooling and power supply"),
            (6, "PCIe link at Gen4 x8 under load, expected Gen5 x16",
             "reseat the GPU (riser, retimer, cable)"),
            (7, "MIG is on", "disable MIG (nvidia-smi -mig 0) and reset the GPU")]
    assert got == {(i, f"00000000:{bus[i]}:00.0", f"16418240002{41 + i}", what, action)
                   for i, what, action in want}


def test_nvlink_down_without_a_profile_is_judged_against_the_part_and_its_peers(tmp_path):
    out = judged(read(recording(tmp_path, H200, {"nvml.gpus.3.nvlink.state.5": 0})))
    assert fails(out) == [(3, "NVLink link(s) 5 down")]


# -- issue 33's defects, one test each -------------------------------------------------------

@pytest.mark.parametrize("code, cause, fix", [
    ("NVML_ERROR_LIBRARY_NOT_FOUND", "libnvidia-ml.so.1 is not in this process's library path",
     "NVIDIA_DRIVER_CAPABILITIES includes utility"),
    ("NVML_ERROR_DRIVER_NOT_LOADED", "the nvidia kernel module is not loaded", "modprobe nvidia"),
    ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", "different driver versions", "reboot the node"),
    ("NVML_ERROR_NO_PERMISSION", "may not open /dev/nvidiactl", "device files")])
def test_defect_1_a_gpu_run_that_cannot_open_nvml_fails_with_cause_and_fix(tmp_path, code, cause,
                                                                            fix):
    reading = read(recording(tmp_path, H200, {"nvml.init": code}))
    [f] = [f for f in judged(reading, gpu_run=True) if f.level == "fail"]
    assert f.gpu is None and f.port is None  # the node
    assert cause in f.what and code in f.what and fix in f.action
    # not a GPU run (CPU ranks, no GPU profile): not measured, said with the same fix
    out = judged(reading)
    assert fails(out) == [] and any(cause in m and fix in m for m in level(out, NOT_MEASURED))


def test_defect_1_no_binding_installed_is_the_same_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    node = readers.Node(0.05, environ={})
    assert node.unavailable["code"] == "NO_BINDING"
    assert node.unavailable["fix"] == f"pip install '{nvml.TESTED_BINDING}'"


def test_a_recording_that_cannot_be_read_is_a_node_not_read_never_a_crash(tmp_path):
    node = readers.Node(0.05, environ={readers.REPLAY_ENV: str(tmp_path / "missing.json")})
    assert node.unavailable["code"] == "FileNotFoundError"
    assert fails(judged({"gpu": {"unavailable": node.unavailable}}, gpu_run=True))[0][1] \
        .startswith("GPUs not read: [Errno 2] No such file or directory")


def test_defect_2_unknown_from_the_handle_names_the_gpu_and_the_others_are_still_read(tmp_path):
    """A GPU off the bus before the run: GetHandleByIndex answers UNKNOWN (not GPU_IS_LOST);
    its bus is the one the driver attached that NVML no longer names."""
    reading = read(recording(tmp_path, H200, {"nvml.gpus.3.handle": "NVML_ERROR_UNKNOWN"}))
    out = judged(reading, gpu_run=True)
    [f] = [f for f in out if f.level == "fail"]
    assert (f.gpu.index, f.gpu.bus_id, f.gpu.serial) == (3, "0000:61:00.0", None)
    assert f.what == "does not answer NVML (fallen off the bus)"
    assert "NVML_ERROR_UNKNOWN from nvmlDeviceGetHandleByIndex" in f.evidence
    assert all(reading["gpu"]["samples"][str(i)]["n"] >= 2 for i in (0, 1, 2, 4, 5, 6, 7))
    assert reading["gpu"]["events"]["registered"] == [0, 1, 2, 4, 5, 6, 7]


@pytest.mark.parametrize("patch, what, action", [
    ({"nvml.gpus.2.handle": "NVML_ERROR_INSUFFICIENT_POWER"},
     "reports its external power cables improperly attached", "reseat the GPU's power cables"),
    ({"nvml.gpus.2.handle": "NVML_ERROR_IRQ_ISSUE"},
     "has an interrupt problem the kernel detected", "reboot the node"),
    ({"nvml.gpus.2.calls": {"nvmlDeviceGetRemappedRows": "NVML_ERROR_RESET_REQUIRED"}},
     "requires a reset", "reset the GPU (nvidia-smi -r) or reboot the node"),
    ({"nvml.gpus.2.all": "NVML_ERROR_GPU_IS_LOST"}, "is lost (fallen off the bus)",
     "reboot the node")])
def test_each_code_nvml_answers_for_a_faulty_gpu(tmp_path, patch, what, action):
    [f] = [f for f in judged(read(recording(tmp_path, H200, patch), seconds=0.05))
           if f.level == "fail"]
    assert (f.gpu.index, f.gpu.bus_id, f.what) == (2, f.gpu.bus_id, what)
    assert f.gpu.bus_id in ("00000000:52:00.0", "0000:52:00.0") and f.action.startswith(action)


def test_defect_2_a_gpu_lost_during_the_run_keeps_its_name_and_stops_nothing(tmp_path):
    reading = read(recording(tmp_path, "h200_gpu_off_bus"), seconds=0.3)
    out = judged(reading, gpu_run=True)
    assert {f.gpu.index for f in out if f.level == "fail"} == {1}
    assert {(f.gpu.bus_id, f.gpu.serial) for f in out if f.level == "fail"} == {
        ("00000000:43:00.0", "1641824000242")}
    assert "fallen off the bus) during the run" in " ".join(fails(out)[0][1:])
    samples = reading["gpu"]["samples"]
    assert samples["1"]["lost"] and samples["1"]["n"] <= 2  # not asked again once lost
    assert min(samples[str(i)]["n"] for i in (0, 2, 3, 4, 5, 6, 7)) >= 3
    assert [(x["xid"], x["index"]) for x in reading["gpu"]["xids"]] == [(79, 1)]


def test_defect_3_nvlink_errors_are_read_per_link_where_the_totals_read_zero(tmp_path):
    # Hopper: the all-link total fields (38, 52, 59) read 0 (DataDog/datadog-agent#55966)
    path = recording(tmp_path, H200, {"nvml.gpus.2.fields": {"38": 0, "52": 0, "59": 0},
                                      "nvml.changes": [{"after_s": 0.02, "set": {
                                          "gpus.2.nvlink.errors": {"11": {"recovery": 2}}}}]})
    assert fails(judged(read(path))) == [(2, "NVLink link 11: 2 recovery error(s) during the "
                                             "run")]


def test_defect_4_an_error_on_link_0_does_not_read_as_no_nvlink(tmp_path):
    reading = read(recording(tmp_path, H200,
                             {"nvml.gpus.0.nvlink.state.0": "NVML_ERROR_UNKNOWN"}))
    [f] = [f for f in judged(reading, EXPECT_H200) if f.level == "fail"]
    assert (f.gpu.index, f.what) == (0, "17 of the profile's 18 NVLink links up")
    assert "unreadable: 0 (NVML_ERROR_UNKNOWN)" in f.evidence
    # a part without NVLink (the link-count field NOT_SUPPORTED) against an 18-link profile
    reading = read(recording(tmp_path, H200, {"nvml.gpus.0.fields.91": "NVML_ERROR_NOT_SUPPORTED"}))
    assert fails(judged(reading, EXPECT_H200)) == [(0, "no NVLink, the profile expects 18 links")]
    assert fails(judged(reading)) == []  # without a profile: a PCIe part, by design


def test_defect_5_an_event_wait_error_ends_the_channel_without_spinning(tmp_path):
    reading = read(recording(tmp_path, "h200_event_wait_error"), seconds=0.4, period=0.05)
    events, s = reading["gpu"]["events"], reading["gpu"]["samples"]["0"]
    assert events["ok"] is False and "nvmlEventSetWait_v2 returned NVML_ERROR_UNKNOWN" in \
        events["why"]
    assert 2 <= s["n"] <= 0.4 / 0.05 + 3  # one sample per period, not a busy loop
    out = judged(reading)
    assert fails(out) == []
    assert any("XID events during the run" in m for m in level(out, NOT_MEASURED))
    assert any("event channel failed" in w for w in level(out, WARN))


def test_defect_5_an_event_maps_to_its_gpu_without_asking_the_lost_gpu(tmp_path):
    path = recording(tmp_path, H200, {"nvml.events": [{"after_s": 0.02, "gpu": 6, "xid": 48}],
                                      "nvml.gpus.6.calls": {"nvmlDeviceGetUUID":
                                                            "NVML_ERROR_GPU_IS_LOST"}})
    reading = read(path)
    assert [(x["xid"], x["index"]) for x in reading["gpu"]["xids"]] == [(48, 6)]


def test_defect_6_a_binding_without_the_newer_calls_reads_what_it_can(tmp_path):
    reading = read(recording(tmp_path, "h200_binding_11"))
    assert reading["gpu"]["binding"] == "11.525.150"
    assert reading["gpu"]["samples"]["0"]["busy"] >= 2  # clocks through the older name
    out = judged(reading, gpu_run=True)
    assert fails(out) == []
    assert any("GPUs 0-7 fabric" in m and nvml.TESTED_BINDING in m
               for m in level(out, NOT_MEASURED))
    assert any("nvidia-ml-py 11.525.150 is outside the tested range" in w
               for w in level(out, WARN))


def test_defect_7_only_the_gpu_traffic_hcas_are_judged(tmp_path):
    path = recording(tmp_path, H200, {"files": {
        "sys/class/infiniband/mlx5_9/ports/1/state": "1: DOWN",
        "sys/class/infiniband/mlx5_9/ports/1/phys_state": "3: Disabled"}})
    want = {"hca_ports": 8, "hca_rate_gbps": 400}
    out = judged(read(path), want)  # the GPU traffic: the 400 Gb/s ports
    assert fails(out) == [] and any("mlx5_9/1" in w for w in level(out, WARN))
    named = judged(read(path, env={"NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,"
                                                  "mlx5_6,mlx5_9"}), want)
    assert fails(named) == [("mlx5_9/1", "state '1: DOWN', phys_state '3: Disabled', rate "
                                         "'100 Gb/sec (4X EDR)'"),
                            (None, "7 GPU-traffic HCA port(s) up at full rate, the profile "
                                   "expects 8")]
    profile = judged(read(path), {**want, "hca_names": ["mlx5_[0-7]"]})
    assert fails(profile) == []


def test_defect_8_saturated_and_unreadable_counters_are_said(tmp_path):
    base = "sys/class/infiniband/mlx5_{}/ports/1/"
    path = recording(tmp_path, H200, {"files": {
        base.format(0) + "counters/link_downed": "255",
        base.format(1) + "counters/local_link_integrity_errors": "15",
        base.format(2) + "counters/symbol_error": "N/A (no PMA)"}})

    def rnr(root):
        (Path(root) / base.format(3) / "hw_counters/rnr_nak_retry_err").write_text("4\n")
    out = judged(read(path, during=rnr))
    assert fails(out) == [("mlx5_3/1", "rnr_nak_retry_err increased by 4 during the run")]
    unmeasured = " | ".join(level(out, NOT_MEASURED))
    assert "mlx5_0/1 link_downed: saturated at 255 (8-bit counter)" in unmeasured
    assert "mlx5_1/1 local_link_integrity_errors: saturated at 15 (4-bit" in unmeasured
    assert "mlx5_2/1 symbol_error: N/A (no PMA)" in unmeasured
    assert sum("saturated" in w and "perfquery -x -R" in w for w in level(out, WARN)) == 2


def test_defect_9_the_kernel_log_is_read_when_nvml_fails(tmp_path):
    path = recording(tmp_path, "h200_gpu_off_bus", {"nvml.init": "NVML_ERROR_DRIVER_NOT_LOADED",
                                                    "nvml.changes": []})
    out = judged(read(path), gpu_run=True)
    culprits = {(f.gpu.bus_id if f.gpu else None, f.what) for f in out if f.level == "fail"}
    assert ("0000:43:00", "XID 79") in culprits
    assert any(w.startswith("GPUs not read: the nvidia kernel module") for _, w in culprits)


def test_defect_9_a_kernel_log_without_nvrm_lines_is_not_this_hosts(tmp_path):
    path = recording(tmp_path, H200, {"kmsg": {"uptime_s": 100.0, "records": [
        "6,1,1000000,-;Starting gVisor...", "6,2,2000000,-;Checking naughty and nice process "
                                             "list..."]}})
    out = judged(read(path))
    assert any("holds no NVRM line on a GPU node: not this host's log" in m
               for m in level(out, NOT_MEASURED))
    assert not any(c.startswith("kernel log") for c in level(out, CHECKED))


def test_defect_10_fallen_off_without_xid_nvswitch_sxid_and_xid_154(tmp_path):
    records = [
        "6,1,38174242,-;NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.195.03",
        # NVIDIA/NVSentinel#155: the three lines are one record; kmsg escapes the newlines
        "3,7,86390000000,-;NVRM: The NVIDIA GPU 0000:9d:00.0\\x0aNVRM: (PCI ID: 10de:2335) "
        "installed in this system has\\x0aNVRM: fallen off the bus and is not responding to "
        "commands.",
        "3,8,86391000000,-;nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Fatal, Link 04 "
        "egress nonposted PRIV error",
        "4,9,86392000000,-;nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 "
        "Minion Link DLREQ interrupt",
        "3,10,86393000000,-;NVRM: Xid (PCI:0000:d1:00): 154, GPU recovery action changed from "
        "0x0 (None) to 0x1 (GPU Reset Required)"]
    out = judged(read(recording(tmp_path, H200, {"kmsg.records": records})))
    assert fails(out) == [
        (4, "fell off the bus (no XID line)"),
        (6, "the driver requires recovery: GPU Reset Required (XID 154)"),
        (None, "NVSwitch at PCI 0000:84:00: SXid 12028 (fatal)")]
    assert any("SXid 22013 (non-fatal" in w for w in level(out, WARN))
    assert [f.action for f in out if f.level == "fail"][1] == "reset the GPU"


def test_defect_11_fabric_route_and_summary_and_a_record_without_a_time(tmp_path):
    path = recording(tmp_path, H200, {
        "nvml.gpus.2.fabric": {"health_mask": 1 << 4},  # route unhealthy: TRUE
        "nvml.gpus.5.fabric": {"health_summary": 3},  # limited capacity
        "nvml.gpus.6.fabric": {"health_mask": 1 << 2},  # route recovery in progress: warns
        "kmsg.records": ["6,1,38174242,-;NVRM: loading NVIDIA UNIX Open Kernel Module",
                         "3,2;NVRM: Xid (PCI:0000:1b:00): 79, GPU has fallen off the bus."]})
    out = judged(read(path))
    assert fails(out) == [(0, "XID 79"), (2, "NVSwitch fabric: route unhealthy"),
                          (5, "NVSwitch fabric: health summary limited capacity")]
    assert any("route recovery in progress" in w for w in level(out, WARN))


def test_defect_12_temperatures_violations_inforom_and_hca_errors(tmp_path):
    base = "sys/class/infiniband/mlx5_{}/ports/1/"
    path = recording(tmp_path, H200, {
        "nvml.gpus.0.temp_c": 90, "nvml.gpus.1.fields.82": 95, "nvml.gpus.2.temp_c": 86,
        "nvml.gpus.3.inforom": "NVML_ERROR_CORRUPTED_INFOROM",
        "nvml.changes": [{"after_s": 0.02, "set": {"gpus.4.violation_ns.power": 2 * 10 ** 9}}]})

    def errors(root):
        (Path(root) / (base.format(1) + "hw_counters/local_ack_timeout_err")).write_text("900\n")
        (Path(root) / (base.format(2) + "counters/port_xmit_discards")).write_text("65000\n")
        (Path(root) / (base.format(5) + "state")).write_text("1: DOWN\n")  # a flap: seen
        time.sleep(0.25)  # several sampling periods: the sampler sees it
        (Path(root) / (base.format(5) + "state")).write_text("4: ACTIVE\n")  # and back up
    out = judged(read(path, seconds=0.4, during=errors), hca_local_ack_timeout_err_per_s=1.0)
    assert fails(out)[:3] == [(0, "GPU at its GPU slowdown temperature"),
                              (1, "HBM at its memory max operating temperature"),
                              (3, "InfoROM corrupted")]
    assert {x[0] for x in fails(out)[3:]} == {"mlx5_1/1", "mlx5_2/1", "mlx5_5/1"}
    assert any("local_ack_timeout_err at" in w for _, w in fails(out))
    assert any("port_xmit_discards at" in w for _, w in fails(out))
    assert ("mlx5_5/1", "link flapped during the run") in fails(out)
    warnings = " | ".join(level(out, WARN))
    assert "GPU 2" in warnings and "within 5 °C of its GPU slowdown" in warnings
    assert "GPU 4" in warnings and "power violation for 2.00 s" in warnings


# -- the rules at their edges --------------------------------------------------------------

@pytest.mark.parametrize("rows, expected", [
    ([9, 511, 0, 0], []),
    ([9, 511, 1, 0], [(0, "row remap pending")]),
    ([0, 512, 0, 0], [(0, "512 rows remapped for uncorrectable errors")]),
    ([0, 2, 1, 1], [(0, "row remapping failed")])])
def test_row_remap_limits_hold_at_their_edges(tmp_path, rows, expected):
    assert fails(judged(read(recording(tmp_path, H200, {"nvml.gpus.0.remapped_rows": rows}),
                             seconds=0.05))) == expected


def test_ecc_off_and_the_drivers_recovery_action(tmp_path):
    path = recording(tmp_path, H200, {"nvml.gpus.0.ecc_mode": [0, 0],
                                      "nvml.gpus.1.fields.230": 2})
    out = judged(read(path, seconds=0.05))
    assert fails(out) == [(0, "ECC is off"), (1, "the driver asks for recovery action 2")]
    assert [f.action for f in out if f.level == "fail"][1] == "reboot the node"


def test_pcie_replays_judged_at_dcgms_per_lane_rate(tmp_path):
    # Gen5 x16: ceil(1e-12 x 32e9 x 60 x 16) = 31 replays per minute (DCGM health)
    for rise, expected in ((31, []), (32, [(0, "32 PCIe replays in 0 s")])):
        path = recording(tmp_path, H200, {"nvml.changes": [{"after_s": 0.02, "set": {
            "gpus.0.fields.94": rise}}]})
        assert fails(judged(read(path))) == expected


@pytest.mark.parametrize("bits, failed", [(0x8, True), (0x40, True), (0x80, True),
                                          (0x20, False), (0x4, False)])
def test_hw_clock_events_fail_sw_ones_do_not(tmp_path, bits, failed):
    out = judged(read(recording(tmp_path, H200, {"nvml.gpus.1.reasons": bits})))
    assert bool(fails(out)) == failed


def test_idle_samples_do_not_count_for_the_load_rules():
    s = nvml.empty_summary()
    nvml.add_sample(s, nvml.IDLE, 0, 1, 16, 30, 40)
    nvml.add_sample(s, 0, 0, 1, 16)  # no kernel ran in the period
    nvml.add_sample(s, nvml.SW_THERMAL | nvml.HW_SLOWDOWN, 97, 5, 16, 70)
    assert (s["n"], s["busy"], s["hw_slowdown"], s["sw_thermal"]) == (3, 1, 1, 1)
    assert (s["pcie_gen_busy_max"], s["temp_max_c"], s["mem_temp_max_c"]) == (5, 70, 40)


def test_crc_errors_fail_at_100_per_second_and_warn_below(tmp_path):
    path = recording(tmp_path, H200, {"nvml.changes": [{"after_s": 0.02, "set": {
        "gpus.0.nvlink.errors": {"2": {"crc_flit": 10 ** 6}},
        "gpus.1.nvlink.errors": {"2": {"crc_flit": 1}}}}]})
    out = judged(read(path, seconds=0.3))
    assert fails(out)[0][0] == 0 and fails(out)[0][1].startswith("NVLink link 2: CRC errors at")
    assert any("GPU 1" in w and "CRC errors at" in w for w in level(out, WARN))


def test_vbios_odd_one_out_and_gpu_count_against_the_profile(tmp_path):
    path = recording(tmp_path, H200, {"nvml.gpus.5.vbios": "96.00.74.00.0D",
                                      "nvml.count": 7})
    out = judged(read(path), EXPECT_H200)
    assert (None, "7 GPU(s) on the node, the profile expects 8") in fails(out)
    [missing] = [f for f in out if f.what.startswith("attached to the NVIDIA driver")]
    assert missing.gpu.bus_id == "0000:df:00.0" and missing.what.endswith("not enumerated by NVML")
    assert (5, "VBIOS 96.00.74.00.0D differs from the node's 96.00.A5.00.04") in fails(out)


def test_stray_processes_only_when_nvml_shows_this_runs_pids(tmp_path):
    reading = read(recording(tmp_path, "h200_config_faults"))
    assert (1, "1 process(es) of another job hold GPU memory") in fails(
        judged(reading, run_pids=(os.getpid(),)))
    other_namespace = judged(reading, run_pids=(7, 8))
    assert not any("process" in w for _, w in fails(other_namespace))
    assert any("another PID namespace" in m for m in level(other_namespace, NOT_MEASURED))


def test_fabric_v3_struct_refused_by_an_older_driver_falls_back_to_v2(tmp_path):
    path = recording(tmp_path, H200, {"nvml.gpus.0.fabric": {"max_version": 2}})
    g = read(path)["gpu"]["end"]["gpus"]
    assert (g[0]["fabric"]["version"], g[1]["fabric"]["version"]) == (2, 3)


def test_not_supported_readings_are_listed_never_passed_nor_convicted():
    out = judged(read(str(DATA / "l20_not_supported.json")))
    assert fails(out) == []
    unsupported = [m for m in level(out, NOT_MEASURED) if "NVML_ERROR_NOT_SUPPORTED" in m]
    assert any("ecc mode" in m for m in unsupported)
    assert any("remapped rows" in m for m in unsupported)
    assert any("never busy" in m for m in level(out, NOT_MEASURED))


@pytest.mark.parametrize("name, expected", [
    ("h100_persistence_off", [(0, "persistence mode is off"), (1, "persistence mode is off")]),
    ("remap_pending", [(0, "row remap pending")]),
    ("a100_mig_enabled", [(0, "MIG is on")]),
    ("v100_nvlink_inactive", [(0, "NVLink link(s) 3, 5 down")]),
    ("pcie_x8_under_load", [(0, "PCIe link at Gen2 x8 under load, expected Gen2 x16")]),
    ("idle_gen1", []),
    ("xid79_kernel_log", [(0, "XID 79")])])
def test_recorded_public_outputs(name, expected):
    assert fails(judged(read(str(DATA / f"{name}.json")))) == expected


def test_recorded_xid_79_ages_out_of_the_window():
    reading = read(str(DATA / "xid79_kernel_log.json"))
    [x] = reading["kmsg"]["xids"]
    assert (x["bus"], x["xid"], x["age_s"]) == ("0000:44:00", 79, pytest.approx(120.0, abs=0.01))
    assert fails(judged(reading, xid_window_s=60.0)) == []


# -- the readers' own edges ------------------------------------------------------------------

def test_kmsg_parse_of_every_kind():
    assert kmsg.parse("3,1,5000000,-;NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the "
                      "bus", 10.0)["age_s"] == 5.0
    assert kmsg.parse("3,1;NVRM: Xid (PCI:0000:44:00): 48, DBE", 10.0)["age_s"] is None
    sx = kmsg.parse("4,2,1,-;nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link",
                    1.0)
    assert (sx["kind"], sx["bus"], sx["sxid"], sx["fatal"]) == ("sxid", "0000:04:00", 22013,
                                                                 False)
    fallen = kmsg.parse("3,3,1,-;NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.", 1.0)
    assert (fallen["kind"], fallen["bus"]) == ("fallen", "0000:01:00")
    assert kmsg.parse("6,4,1,-;NVRM: GPU at PCI:0000:3b:00: GPU-1234", 1.0)["kind"] == "nvrm"
    assert kmsg.bus_key("00000000:3B:00.0") == kmsg.bus_key("0000:3b:00") == (0, 0x3B, 0)


def test_kmsg_unreadable_and_read_in_part_are_said(tmp_path):
    assert "not readable here" in kmsg.KmsgReader(str(tmp_path)).finish()["unavailable"]
    (tmp_path / "dev").mkdir()
    (tmp_path / "proc").mkdir()
    (tmp_path / "dev" / "kmsg").write_text("6,1,1,-;NVRM: loading\n")
    (tmp_path / "proc" / "uptime").write_text("10.0 1.0\n")
    assert "not read to its end" in kmsg.KmsgReader(str(tmp_path), limit_s=-1).finish()["partial"]


def test_sysfs_reader_on_a_recorded_tree():
    root = replay.materialise(json.loads((DATA / "hca_ports.json").read_text()))
    ports = sysfs.read_ports(root)
    assert sorted(ports) == ["mlx4_0/1", "mlx4_0/2", "mlx5_0/1", "mlx5_1/1"]
    assert ports["mlx5_0/1"]["rate_gbps"] == 100.0 and ports["mlx4_0/2"]["rate_gbps"] == 56.0
    assert ports["mlx4_0/1"]["state"] == "1: DOWN"
    assert ports["mlx5_1/1"]["counters"]["link_downed"] == 0
    assert ports["mlx5_1/1"]["hw_counters"]["rnr_nak_retry_err"] is None  # absent: not read
    assert sysfs.read_ports(root + "/nothing") is None
    assert sysfs.rate_gbps("400 Gb/sec (4X NDR)") == 400.0 and sysfs.rate_gbps("garbage") is None


@pytest.mark.parametrize("spec, selected", [
    ("mlx5", {"mlx5_0/1", "mlx5_1/1"}), ("=mlx5_0", {"mlx5_0/1"}),
    ("^mlx5_0", {"mlx5_1/1", "mlx4_0/1", "mlx4_0/2"}), ("mlx4_0:2", {"mlx4_0/2"}),
    ("^=mlx5_1,mlx4_0:1", {"mlx5_0/1", "mlx4_0/2"})])
def test_nccl_ib_hca_selects_as_nccl_does(spec, selected):
    from ddp_smoke.checks.health import hca
    ports = {"mlx5_0/1": {}, "mlx5_1/1": {}, "mlx4_0/1": {}, "mlx4_0/2": {}}
    assert hca.select(ports, {}, spec)[0] == selected
