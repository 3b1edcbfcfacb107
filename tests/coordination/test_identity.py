"""Node identity: readers on a sysfs/procfs tree made here, and the real machine in a real run.

The tree is data laid out as the kernel and the NVIDIA driver lay it out (paths and file formats
as on a DGX-class node), not a mock: the readers open files under a root they are given.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddp_smoke.coordination import identity
from tests.launch import torchrun

GPU_INFO = """Model: \t\t NVIDIA H100 80GB HBM3
IRQ:   \t\t 0
GPU UUID: \t GPU-5a1c9b2e-8d3f-4e7a-9b1c-0d2e3f4a5b6c
Video BIOS: \t 96.00.99.00.01
Bus Type: \t PCIe
DMA Size: \t 52 bits
DMA Mask: \t 0xfffffffffffff
Bus Location: \t 0000:18:00.0
Device Minor: \t 0
GPU Excluded:\t No
"""


def _tree(root: Path, files: dict[str, str], links: dict[str, str] = ()) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for rel, target in dict(links).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, root / rel)
    return root


@pytest.fixture
def node(tmp_path) -> Path:
    """A GPU node's tree: real serials, one placeholder, a physical and two virtual netdevs,
    two HCAs (one with an unset GUID), one GPU in the driver's /proc."""
    return _tree(tmp_path / "node", {
        "etc/machine-id": "8f3c2a1b9d4e4f5a8b7c6d5e4f3a2b1c\n",
        "sys/class/dmi/id/product_serial": "1234ABCD5678\n",
        "sys/class/dmi/id/board_serial": "To Be Filled By O.E.M.\n",
        "sys/class/dmi/id/product_uuid": "4c4c4544-0042-3510-8052-b4c04f4a3532\n",
        "sys/class/dmi/id/product_name": "PowerEdge XE9680\n",
        "sys/class/dmi/id/sys_vendor": "Dell Inc.\n",
        "sys/class/infiniband/mlx5_0/node_guid": "b859:9f03:00ab:cdef\n",
        "sys/class/infiniband/mlx5_1/node_guid": "0000:0000:0000:0000\n",
        "sys/devices/pci0000:00/0000:00:03.0/net/eth0/address": "0c:42:a1:00:00:01\n",
        "sys/devices/virtual/net/lo/address": "00:00:00:00:00:00\n",
        "sys/devices/virtual/net/docker0/address": "02:42:ac:11:00:01\n",
        "sys/devices/pci0000:00/0000:00:03.0/vendor": "0x15b3\n",
        "proc/driver/nvidia/gpus/0000:18:00.0/information": GPU_INFO,
    }, {
        "sys/class/net/eth0": "../../devices/pci0000:00/0000:00:03.0/net/eth0",
        "sys/devices/pci0000:00/0000:00:03.0/net/eth0/device": "../../../0000:00:03.0",
        "sys/class/net/lo": "../../devices/virtual/net/lo",
        "sys/class/net/docker0": "../../devices/virtual/net/docker0",
    })


def test_node_identity_reads_what_is_there_and_drops_placeholders(node):
    assert identity.node_identity(str(node)) == {
        "machine_id": "8f3c2a1b9d4e4f5a8b7c6d5e4f3a2b1c",
        "product_serial": "1234ABCD5678",
        "product_uuid": "4c4c4544-0042-3510-8052-b4c04f4a3532",
        "product_name": "PowerEdge XE9680", "sys_vendor": "Dell Inc.",
        "hca_guids": {"mlx5_0": "b859:9f03:00ab:cdef"},
        "macs": {"eth0": "0c:42:a1:00:00:01"},
    }


def test_missing_fields_are_absent_never_faked(tmp_path):
    bare = _tree(tmp_path / "bare", {"etc/machine-id": "\n", "sys/class/dmi/id/board_serial": ""})
    assert identity.node_identity(str(bare)) == {}
    assert identity.node_identity(str(tmp_path / "nothing-here")) == {}
    assert identity.nvidia_proc_gpu(str(bare), "0000:18:00.0") == {}


def test_dbus_machine_id_when_systemd_has_none(tmp_path):
    root = _tree(tmp_path / "r", {"var/lib/dbus/machine-id": "abc123def456\n"})
    assert identity.machine_id(str(root)) == "abc123def456"


@pytest.mark.parametrize("bus", ["0000:18:00.0", "00000000:18:00.0", "0000:18:00.0".upper()])
def test_gpu_found_by_bus_id_in_the_drivers_proc_file(node, bus):
    assert identity.nvidia_proc_gpu(str(node), bus) == {
        "gpu_uuid": "GPU-5a1c9b2e-8d3f-4e7a-9b1c-0d2e3f4a5b6c",
        "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_bus_id": "0000:18:00.0"}
    assert identity.nvidia_proc_gpu(str(node), "0000:19:00.0") == {}  # another GPU: nothing


def test_pci_bus_id_is_spelled_as_sysfs_spells_it():
    assert identity.pci_bus_id(0, 0x18, 0) == "0000:18:00.0"
    assert identity.pci_bus_id(1, 0xbe, 0x1f, 1) == "0001:be:1f.1"


def test_cpu_rank_has_no_gpu_identity():
    import torch

    assert identity.gpu_identity(torch.device("cpu")) == {}


@pytest.mark.timeout(180)
def test_real_run_records_this_machines_identity(tmp_path):
    """Every rank's record carries the real /etc/machine-id and the real NICs' addresses."""
    real_id = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() \
        else None
    if not real_id:
        pytest.skip("this machine has no /etc/machine-id")
    run = torchrun(2, "--checks", "environment", report_dir=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    physical = {n: (Path("/sys/class/net") / n / "address").read_text().strip()
                for n in os.listdir("/sys/class/net")
                if (Path("/sys/class/net") / n / "device").exists()}
    for r in run.report["ranks"]:
        assert r["identity"]["machine_id"] == real_id
        assert r["identity"].get("macs", {}) == {k: v for k, v in physical.items()
                                                 if v != "00:00:00:00:00:00"}
        assert "slurm_node" not in r and "k8s_node" not in r  # not launched by either
