"""Shared storage: every rank's file and a checkpoint read back intact from one directory.

Every rank writes ``file_bytes`` of data derived from (run id, rank) with its SHA-256 in a
header line into ``<storage_dir>/ddp-smoke-<run id>/`` (temp file, fsync, rename, fsync of
the folder, as checkpoints are written); rank 0 saves a model state with ``torch.save``, the
same way. The folder is made fresh by rank 0 (mode 0700) and an existing one is refused;
every rank uses it only when it is a real directory of its own user, not open to others,
holding this run's marker; files are created with ``O_EXCL | O_NOFOLLOW`` relative to it:
another user of a world-writable scratch directory cannot make the check follow a link or
overwrite a file. What a rank created is removed on every way out (abort: :func:`cleanup`).
After a barrier,
rank 0 reads every rank's file back and verifies header, length, checksum and content, and
every rank ``torch.load``s the checkpoint and compares it with the state it expects. After a
second barrier each rank deletes what it wrote (the run's directory too, once empty).
``storage_dir`` (flag ``--storage-dir``) must be one directory on every node, as checkpoints
need; its default, ``<report_dir>/storage``, is shared only when the report directory is.
Culprits: a rank whose file is missing on rank 0's host — "not shared" when every file written
on its host is missing there while rank 0's own host's files are present, else "missing" — or
reads back corrupt; a rank that could not write; rank 0 when its checkpoint reads back wrong on
two or more ranks, else the one rank that reads it wrong or cannot see it; rank 0 when the
run's folder already existed (``refused``).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import stat
import threading
import time

import torch

from ..coordination import ending, progress
from ..model import FAIL, PASS, CheckResult

FORMAT = "ddp-smoke-storage/1"
MARKER = ".ddp-smoke-run"  # in the run folder: the run id of the run that made it
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SIBLING_WAIT_S = 10.0  # a rank whose host-local folder a sibling is making waits this long
# Paths this process created and has not removed yet, for cleanup() from any thread.
_created: list[str] = []
_created_lock = threading.Lock()


def payload(run_id: str, rank: int, size_bytes: int) -> bytes:
    """The bytes rank ``rank`` writes: reproducible anywhere from (run id, rank)."""
    return random.Random(f"{run_id}/{rank}").randbytes(size_bytes)


def model_state(width: int, seed: int) -> dict[str, torch.Tensor]:
    """A linear layer's state_dict, from its own generator (the global RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(width, width, generator=g),
            "bias": torch.randn(width, generator=g), "step": torch.tensor(seed)}


def fs_type(path: str) -> str | None:
    """The filesystem type under ``path`` (nfs, lustre, ext4, overlay …) from mountinfo."""
    path, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4]
                if path.startswith(point.rstrip("/") + "/") or path == point:
                    if len(point) > len(best):
                        best, kind = point, right.split()[0]
    except OSError:
        return None
    return kind


def _write_own(ctx, folder: str, dfd: int, size_bytes: int) -> dict:
    path = os.path.join(folder, f"rank{ctx.rank}.bin")
    data = payload(ctx.env.run_id, ctx.rank, size_bytes)
    header = {"format": FORMAT, "rank": ctx.rank, "run_id": ctx.env.run_id,
              "payload_bytes": size_bytes, "sha256": hashlib.sha256(data).hexdigest()}
    body = bytearray(data)
    if body:  # the bytes go bad after their checksum was taken, as on a faulty disk or link
        ctx.faults.corrupt(torch.frombuffer(body, dtype=torch.uint8))
    t = time.perf_counter()
    try:
        _atomic_write(folder, dfd, f"rank{ctx.rank}.bin",
                      lambda f: f.write(json.dumps(header).encode() + b"\n" + bytes(body)))
    except OSError as e:
        return {"path": path, "error": f"{type(e).__name__}: {e}", "write_s": 0.0}
    return {"path": path, "error": None, "write_s": round(time.perf_counter() - t, 6)}


def _atomic_write(folder: str, dfd: int, name: str, write) -> None:
    """Create ``name`` in the folder through a new temp file: fsync, rename, fsync the folder."""
    tmp = f".{name}.tmp"
    fd = _create(folder, dfd, tmp)
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    _track(os.path.join(folder, name))
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    _untrack(os.path.join(folder, tmp))
    os.fsync(dfd)


def _create(folder: str, dfd: int, name: str) -> int:
    """A new file, never an existing one, never through a link; tracked for cleanup."""
    _track(os.path.join(folder, name))
    try:
        return os.open(name, _NEW, 0o600, dir_fd=dfd)
    except OSError:
        _untrack(os.path.join(folder, name))
        raise


def _track(path: str) -> None:
    with _created_lock:
        if path not in _created:
            _created.append(path)


def _untrack(path: str) -> None:
    with _created_lock:
        if path in _created:
            _created.remove(path)


def cleanup() -> None:
    """Remove every file and folder this process created for the check, newest first.

    Safe from any thread and more than once; the harness calls it on the abort path, where
    the check's own ``finally`` never runs (the process leaves with ``os._exit``). A folder
    is removed only when empty.
    """
    with _created_lock:
        paths = list(reversed(_created))
        _created.clear()
    for path in paths:
        try:
            os.rmdir(path) if path.endswith(os.sep) else os.unlink(path)
        except OSError:
            pass  # never written, already gone, or a folder still holding others' files


ending.at_leave(cleanup)  # the abort path leaves with os._exit: no finally runs


def _make_folder(folder: str, run_id: str) -> str | None:
    """Rank 0: make the run folder fresh, mode 0700, with this run's marker; None, or why not."""
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.mkdir(folder, 0o700)
    except FileExistsError:
        return (f"refused: {folder} already exists and was not made by this run (another "
                "user, or a run with the same id); remove it or choose another --storage-dir")
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    _track(folder + os.sep)
    return _write_marker(folder, run_id)


def _write_marker(folder: str, run_id: str) -> str | None:
    try:
        dfd = os.open(folder, _DIR)
        try:
            with os.fdopen(_create(folder, dfd, MARKER), "w") as f:
                f.write(run_id)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _open_folder(folder: str, run_id: str) -> int:
    """The run folder's descriptor, once it is safe to use; OSError with the reason if not.

    A rank that does not see the folder (storage_dir not shared with rank 0's host) makes its
    own, so that rank 0 reports the missing files as "not shared"; its siblings on the host
    wait for that one's marker.
    """
    try:
        dfd = os.open(folder, _DIR)
    except FileNotFoundError:
        if _make_folder(folder, run_id) is None:
            return _open_folder(folder, run_id)
        dfd = os.open(folder, _DIR)  # a sibling made it first
    try:
        _check_folder(dfd, folder, run_id)
    except OSError:
        os.close(dfd)
        raise
    return dfd


def _check_folder(dfd: int, folder: str, run_id: str) -> None:
    st = os.fstat(dfd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"refused: {folder} belongs to uid {st.st_uid} with mode "
                              f"{stat.S_IMODE(st.st_mode):o}, not to this user with 0700")
    end = time.monotonic() + _SIBLING_WAIT_S
    while True:
        try:
            fd = os.open(MARKER, _READ, dir_fd=dfd)
            with os.fdopen(fd) as f:
                got = f.read()
        except FileNotFoundError:
            got = None
        if got == run_id:
            return
        if got or time.monotonic() > end:  # not this run's, or no marker ever appeared
            raise PermissionError(f"refused: {folder} was not made by run {run_id} "
                                  f"(marker {got!r})")
        time.sleep(0.05)


def verify(path: str, run_id: str, rank: int, size_bytes: int,
           dir_fd: int | None = None) -> dict:
    """Rank 0's reading of rank ``rank``'s file: state ok|missing|unreadable|corrupt, detail.

    With ``dir_fd``, the file is opened relative to that folder; never through a link.
    """
    try:
        name = path if dir_fd is None else os.path.basename(path)
        with os.fdopen(os.open(name, _READ, dir_fd=dir_fd), "rb") as f:
            head, _, body = f.read().partition(b"\n")
    except FileNotFoundError:
        return {"rank": rank, "state": "missing", "detail": f"{path} does not exist"}
    except OSError as e:
        return {"rank": rank, "state": "unreadable", "detail": f"{path}: {type(e).__name__}: {e}"}
    try:
        header = json.loads(head)
        owner = (header["format"], header["rank"], header["run_id"])
    except (ValueError, KeyError, TypeError):
        return {"rank": rank, "state": "corrupt", "detail": "header line unreadable"}
    if owner != (FORMAT, rank, run_id):
        return {"rank": rank, "state": "corrupt", "detail": f"header names {owner}, not rank "
                                                            f"{rank} of run {run_id}"}
    if len(body) != header["payload_bytes"] or len(body) != size_bytes:
        return {"rank": rank, "state": "corrupt", "detail": f"{len(body)} payload bytes, "
                                                            f"{size_bytes} written"}
    want = payload(run_id, rank, size_bytes)
    if body != want:
        at = next(i for i, (a, b) in enumerate(zip(body, want)) if a != b)
        summed = hashlib.sha256(body).hexdigest() == header["sha256"]
        return {"rank": rank, "state": "corrupt",
                "detail": f"first wrong byte at offset {at} of {size_bytes} (checksum "
                          f"{'matches: written wrong' if summed else 'mismatch: bytes changed'})"}
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        return {"rank": rank, "state": "corrupt", "detail": "header checksum wrong, data intact"}
    return {"rank": rank, "state": "ok", "detail": ""}


def _save_checkpoint(ctx, folder: str, dfd: int, opts: dict) -> dict:
    state = model_state(opts["model_width"], opts["seed"])
    ctx.faults.corrupt(state["weight"])  # rank 0 saves a wrong model
    t = time.perf_counter()
    try:
        _atomic_write(folder, dfd, "checkpoint.pt", lambda f: torch.save(state, f))
        size = os.stat("checkpoint.pt", dir_fd=dfd, follow_symlinks=False).st_size
    except (OSError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}", "save_s": 0.0, "checkpoint_bytes": 0}
    return {"error": None, "save_s": round(time.perf_counter() - t, 6), "checkpoint_bytes": size}


def _load_checkpoint(folder: str, dfd: int | None, opts: dict) -> dict:
    t = time.perf_counter()
    path = os.path.join(folder, "checkpoint.pt")
    try:
        if dfd is None:
            raise FileNotFoundError(path)
        f = os.fdopen(os.open("checkpoint.pt", _READ, dir_fd=dfd), "rb")
    except FileNotFoundError:
        return {"state": "missing", "detail": f"{path} does not exist", "load_s": 0.0}
    except OSError as e:
        return {"state": "unreadable", "detail": f"{type(e).__name__}: {e}"[:300], "load_s": 0.0}
    try:
        with f:
            got = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 — any unpickling failure is a finding, not a crash
        return {"state": "unreadable", "detail": f"{type(e).__name__}: {e}"[:300], "load_s": 0.0}
    load_s = round(time.perf_counter() - t, 6)
    want = model_state(opts["model_width"], opts["seed"])
    if not isinstance(got, dict) or got.keys() != want.keys():
        return {"state": "corrupt", "detail": "keys differ from the saved state", "load_s": load_s}
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    detail = (f"tensor {bad[0]!r} differs by up to "
              f"{(got[bad[0]].double() - want[bad[0]].double()).abs().max().item():.3g}"
              if bad else "")
    return {"state": "corrupt" if bad else "ok", "detail": detail, "load_s": load_s}




def run(ctx) -> dict:
    """Make the folder, write, barrier, read back (rank 0: every file; all: the checkpoint),
    barrier, clean up."""
    opts = ctx.section("storage")
    folder = os.path.join(os.path.abspath(ctx.storage_dir), f"ddp-smoke-{ctx.env.run_id}")
    obs = {"dir": folder, "fs_type": fs_type(ctx.storage_dir), "file_bytes": opts["file_bytes"]}
    if ctx.config.get("storage_dir") is None:
        _track(os.path.abspath(ctx.storage_dir) + os.sep)  # the default folder goes when empty
    try:
        refused = _make_folder(folder, ctx.env.run_id) if ctx.rank == 0 else None
        made = torch.tensor([refused is None], dtype=torch.int32, device=ctx.device)
        progress.broadcast(made, 0)  # the folder exists (or was refused) before anyone writes
        if not made.item():  # every rank leaves here: no further collectives on any
            return {**obs, "refused": refused}
        return _round_trip(ctx, opts, folder, obs)
    finally:
        cleanup()


def _round_trip(ctx, opts: dict, folder: str, obs: dict) -> dict:
    try:
        dfd = _open_folder(folder, ctx.env.run_id)
    except OSError as e:
        dfd, obs["write"] = None, {"path": folder, "error": f"{type(e).__name__}: {e}",
                                   "write_s": 0.0}
    else:  # this run's folder: every rank tries to remove it last (the last one succeeds)
        _track(folder + os.sep)
    try:
        if dfd is not None:
            obs["write"] = _write_own(ctx, folder, dfd, opts["file_bytes"])
        if ctx.rank == 0:
            obs["save"] = (_save_checkpoint(ctx, folder, dfd, opts) if dfd is not None else
                           {"error": obs["write"]["error"], "save_s": 0.0,
                            "checkpoint_bytes": 0})
        progress.barrier()  # every file and the checkpoint are on disk before anyone reads
        if ctx.rank == 0:
            t = time.perf_counter()
            obs["files"] = [verify(os.path.join(folder, f"rank{r}.bin"), ctx.env.run_id, r,
                                   opts["file_bytes"], dir_fd=dfd) if dfd is not None else
                            {"rank": r, "state": "unreadable", "detail": "folder refused"}
                            for r in range(ctx.world_size)]
            obs["read_all_s"] = round(time.perf_counter() - t, 6)
        obs["load"] = _load_checkpoint(folder, dfd, opts)
        progress.barrier()  # rank 0 has read every file before anyone deletes its own
    finally:
        if dfd is not None:
            os.close(dfd)
    return obs


# The folder's own state, not a rank's: full, read-only, over quota (errno 28, 30, 122).
_FOLDER_STATE = re.compile(r"\[Errno (28|30|122)\]")


def _folder_culprit(ev, errors: dict[int, str]) -> list:
    """One culprit for the folder when the ranks' errors are its state (a full, read-only or
    over-quota filesystem fails whichever rank writes first: not that rank's fault)."""
    if not errors or not all(_FOLDER_STATE.search(e) for e in errors.values()):
        return []
    first = errors[min(errors)].split("] ", 1)[-1]
    return [ev.culprit(None, f"unwritable folder {ev.observations[0]['dir']}: {first} (ranks "
                             f"{sorted(errors)} could not write; the filesystem, not a rank: "
                             "free space, lift the quota or remount it read-write)")]


def _file_culprits(ev) -> list:
    obs, out = ev.observations, []
    failed = {r for r, o in enumerate(obs) if o["write"]["error"]}
    out += _folder_culprit(ev, {r: obs[r]["write"]["error"] for r in failed}) or [
        ev.culprit(r, f"unwritable: {obs[r]['write']['path']}: {obs[r]['write']['error']}")
        for r in sorted(failed)]
    found = {f["rank"]: f for f in obs[0]["files"] if f["rank"] not in failed}
    missing = {r for r, f in found.items() if f["state"] == "missing"}
    for r, f in sorted(found.items()):
        if f["state"] in ("corrupt", "unreadable"):
            out.append(ev.culprit(r, f"{f['state']}: its file, as rank 0 reads it: {f['detail']}"))
        elif r in missing:
            out.append(ev.culprit(r, _missing_reason(ev, r, missing, "its file")))
    return out


def _missing_reason(ev, rank: int, missing: set[int], what: str) -> str:
    """'not shared' when rank's whole host is missing and rank 0's host is complete."""
    host, host0, obs = ev.host(rank), ev.host(0), ev.observations
    on_host = {r for r in range(ev.world_size) if ev.host(r) == host}
    on_host0 = {r for r in range(ev.world_size) if ev.host(r) == host0}
    if host != host0 and on_host <= missing and not on_host0 & missing:
        return (f"not shared: {what} is missing on rank 0's host {host0}, as is every file "
                f"written on {host}; {obs[rank]['dir']} ({obs[rank]['fs_type']} here, "
                f"{obs[0]['fs_type']} on {host0}) is not one directory across hosts")
    return f"missing: {what} was written but rank 0 on {host0} does not see it"


def _checkpoint_culprits(ev) -> list:
    obs, world = ev.observations, ev.world_size
    if obs[0]["save"]["error"]:
        return _folder_culprit(ev, {0: obs[0]["save"]["error"]}) or [ev.culprit(
            0, f"unwritable: could not save the checkpoint: {obs[0]['save']['error']}")]
    loads = {r: o["load"] for r, o in enumerate(obs) if o["load"]["state"] != "ok"}
    unseen = {r for r, g in loads.items() if g["state"] == "missing" and ev.host(r) != ev.host(0)}
    out = [ev.culprit(r, "not shared: cannot see the checkpoint rank 0 saved on "
                         f"{ev.host(0)} ({loads[r]['detail']})") for r in sorted(unseen)]
    wrong = {r: g for r, g in loads.items() if r not in unseen}
    if len(wrong) >= 2 or (wrong and len(wrong) == world):
        first = next(iter(wrong.values()))
        out.append(ev.culprit(0, f"{first['state']}: the checkpoint it saved reads back wrong "
                                 f"on ranks {sorted(wrong)}: {first['detail']}"))
    else:
        out += [ev.culprit(r, f"{g['state']}: the checkpoint, on this rank only: {g['detail']}")
                for r, g in wrong.items()]
    return out


def judge(ev) -> CheckResult:
    obs, world = ev.observations, ev.world_size
    if obs[0].get("refused"):
        return CheckResult("storage", FAIL, summary="run folder refused",
                           culprits=_folder_culprit(ev, {0: obs[0]["refused"]})
                           or [ev.culprit(0, obs[0]["refused"])],
                           figures={"dir": obs[0]["dir"],
                                    "fs_types": [o["fs_type"] for o in obs]})
    culprits = _file_culprits(ev) + _checkpoint_culprits(ev)
    states = [f["state"] for f in obs[0]["files"]]
    ckpt_bytes = obs[0]["save"]["checkpoint_bytes"]
    summary = (f"{world} files of {obs[0]['file_bytes']} B and a {ckpt_bytes} B checkpoint "
               f"round-tripped through {obs[0]['dir']} ({obs[0]['fs_type']})" if not culprits
               else ", ".join(f"{n} {kind}" for kind, n in sorted(collections.Counter(
                   c.reason.split(":")[0] for c in culprits).items())))
    return CheckResult("storage", FAIL if culprits else PASS, summary=summary, culprits=culprits,
                       figures={"dir": obs[0]["dir"], "fs_types": [o["fs_type"] for o in obs],
                                "file_bytes": obs[0]["file_bytes"], "file_states": states,
                                "checkpoint_bytes": ckpt_bytes,
                                "write_s": [o["write"]["write_s"] for o in obs],
                                "read_all_s": obs[0]["read_all_s"],
                                "save_s": obs[0]["save"]["save_s"],
                                "load_s": [o["load"]["load_s"] for o in obs]})

