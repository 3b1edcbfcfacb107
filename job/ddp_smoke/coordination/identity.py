"""Hardware identity for repair tickets: what names this machine, its GPU and its NICs.

Each rank adds ``identity`` to its record in the report (``runtime.rank_record``)::

    {"machine_id": "3d12…",                               # /etc/machine-id
     "product_serial": …, "board_serial": …, "product_uuid": …,   # /sys/class/dmi/id/*
     "product_name": …, "sys_vendor": …,                  # (serials: root-readable only)
     "gpu_bus_id": "0000:18:00.0", "gpu_uuid": "GPU-…",  # this rank's GPU
     "gpu_serial": …,                                     # only with pynvml installed
     "hca_guids": {"mlx5_0": "b859:9f03:00ab:cdef"},      # /sys/class/infiniband/*/node_guid
     "macs": {"eth0": "02:fc:00:00:00:01"}}               # netdevs backed by a device

A field that cannot be read is absent, never guessed. Firmware placeholders ("To Be Filled By
O.E.M.", "Not Specified", all zeros …) identify nothing and count as unreadable. Every reader
takes the filesystem ``root`` it reads under, so tests point it at a tree they make; only
:func:`collect` looks at torch and the live system.
"""
from __future__ import annotations

import importlib.util
import os
import re

DMI_FIELDS = ("product_serial", "board_serial", "product_uuid", "product_name", "sys_vendor")
_PLACEHOLDERS = re.compile(
    r"^(to be filled by o\.?e\.?m\.?|not specified|not applicable|default string|none|n/a|"
    r"system serial number|system product name|0+|[0-]+|123456789|0123456789|unknown)$",
    re.IGNORECASE)
_NULL_MAC = "00:00:00:00:00:00"


def _read(root: str, path: str) -> str | None:
    """The stripped text of root/path, or None when missing, unreadable or empty."""
    try:
        with open(os.path.join(root, path.lstrip("/")), errors="replace") as f:
            text = f.read().strip()
    except OSError:  # absent, or 0400 root-only (DMI serials) for other users
        return None
    return text or None


def _listdir(root: str, path: str) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(root, path.lstrip("/"))))
    except OSError:
        return []


def machine_id(root: str = "/") -> str | None:
    """systemd's machine id (D-Bus's copy on systems without systemd)."""
    for path in ("etc/machine-id", "var/lib/dbus/machine-id"):
        value = _read(root, path)
        if value and not _PLACEHOLDERS.match(value):
            return value
    return None


def dmi(root: str = "/") -> dict[str, str]:
    """Serials and names from the firmware's DMI tables, those that are readable and real."""
    out = {}
    for name in DMI_FIELDS:
        value = _read(root, f"sys/class/dmi/id/{name}")
        if value and not _PLACEHOLDERS.match(value):
            out[name] = value
    return out


def hca_guids(root: str = "/") -> dict[str, str]:
    """InfiniBand/RoCE adapters' node GUIDs, by device name (mlx5_0 …)."""
    out = {}
    for dev in _listdir(root, "sys/class/infiniband"):
        guid = _read(root, f"sys/class/infiniband/{dev}/node_guid")
        if guid and guid.replace(":", "").strip("0"):
            out[dev] = guid
    return out


def macs(root: str = "/") -> dict[str, str]:
    """Hardware addresses of network interfaces backed by a device (no lo, veth, bridge …).

    A physical netdev has a ``device`` link in sysfs; virtual ones live under
    /sys/devices/virtual and have none.
    """
    out = {}
    for name in _listdir(root, "sys/class/net"):
        base = f"sys/class/net/{name}"
        if not os.path.exists(os.path.join(root, base, "device")):
            continue
        address = _read(root, f"{base}/address")
        if address and address != _NULL_MAC:
            out[name] = address
    return out


def pci_bus_id(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The PCI address as sysfs and /proc/driver/nvidia spell it: ``0000:18:00.0``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def nvidia_proc_gpu(root: str, bus_id: str) -> dict[str, str]:
    """UUID, model and bus of the GPU at ``bus_id`` from the driver's /proc information file.

    Args:
        root: filesystem root.
        bus_id: ``DDDD:BB:DD.F`` (nvidia-smi's 8-digit domain is accepted too).

    Returns:
        ``gpu_uuid``, ``gpu_name``, ``gpu_bus_id`` where the file has them; empty when the
        driver's /proc tree is absent or has no such GPU.
    """
    want = _normal_bus(bus_id)
    for entry in _listdir(root, "proc/driver/nvidia/gpus"):
        if _normal_bus(entry) != want:
            continue
        text = _read(root, f"proc/driver/nvidia/gpus/{entry}/information") or ""
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        got = {"gpu_uuid": fields.get("GPU UUID"), "gpu_name": fields.get("Model"),
               "gpu_bus_id": _normal_bus(fields.get("Bus Location", entry))}
        return {k: v for k, v in got.items() if v and not _PLACEHOLDERS.match(v)}
    return {}


def _normal_bus(bus_id: str) -> str:
    """``00000000:18:00.0`` and ``0000:18:00.0`` alike as ``0000:18:00.0`` (lower case)."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts)


def node_identity(root: str = "/") -> dict:
    """Everything about the machine itself (no GPU): machine id, DMI, HCA GUIDs, MACs."""
    out: dict = {}
    mid = machine_id(root)
    if mid:
        out["machine_id"] = mid
    out.update(dmi(root))
    for key, value in (("hca_guids", hca_guids(root)), ("macs", macs(root))):
        if value:
            out[key] = value
    return out


def gpu_identity(device, root: str = "/") -> dict:
    """This rank's GPU: PCI bus id and UUID from torch, the driver's /proc file, NVML's serial.

    Empty on CPU. torch's device index follows CUDA's order (CUDA_VISIBLE_DEVICES,
    CUDA_DEVICE_ORDER), not the PCI order, so the GPU is matched by bus id, never by index.
    """
    if getattr(device, "type", None) != "cuda":
        return {}
    import torch  # only on a GPU rank; this module's readers need no torch

    props = torch.cuda.get_device_properties(device)
    out: dict = {}
    ids = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(i, int) for i in ids):
        out["gpu_bus_id"] = pci_bus_id(*ids)
        out.update(nvidia_proc_gpu(root, out["gpu_bus_id"]))
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid and "gpu_uuid" not in out:
        out["gpu_uuid"] = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    if "gpu_bus_id" in out:
        serial = _nvml_serial(out["gpu_bus_id"])
        if serial:
            out["gpu_serial"] = serial
    return out


def _nvml_serial(bus_id: str) -> str | None:
    """The board serial from NVML, only where pynvml is already installed (no new dependency);
    the driver's /proc files do not carry it."""
    if importlib.util.find_spec("pynvml") is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
            serial = pynvml.nvmlDeviceGetSerial(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 — no NVML library, no permission, a GPU without serial
        return None
    serial = serial.decode() if isinstance(serial, bytes) else str(serial)
    return serial if serial and not _PLACEHOLDERS.match(serial) else None


def collect(device, root: str = "/") -> dict:
    """This rank's whole identity: the machine's and its GPU's (never raises)."""
    try:
        return {**node_identity(root), **gpu_identity(device, root)}
    except Exception as e:  # noqa: BLE001 — identity is evidence, never a reason to fail a run
        return {"unreadable": f"{type(e).__name__}: {e}"}
