"""What a rank that lost the coordination store leaves behind: one JSON file per rank.

A rank that loses the store can tell nobody through it. It prints its one JSON line on stderr
(the harness's ``_give_up``) and also writes it as ``REPORT_DIR/lost/<rank>.json``: on a
cluster the report folder is shared, so the launcher (the sbatch's last line, ``submit``),
which may live on when the store's node did not, reads every survivor's word from one place
and names the node that went silent (:func:`ddp_smoke.outputs.last_line.from_folder`). No torch here:
the verdict reads these files in any pod or on a login node.
"""
from __future__ import annotations

import json
import os

from . import proc

FOLDER = "lost"


def write(report_dir: str, rank: int, record: dict) -> str | None:
    """Leave ``record`` as ``report_dir/lost/<rank>.json``; the path, or None when the folder
    cannot be written (the stderr line still says it)."""
    folder = os.path.join(report_dir, FOLDER)
    path = os.path.join(folder, f"{rank}.json")
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)  # whole or absent: the reader may look at any moment
        return path
    except OSError:
        return None


def read(report_dir: str, run_id: str | None = None) -> dict[int, dict]:
    """Every rank's record in ``report_dir/lost``, by rank; only run ``run_id``'s when given."""
    folder = os.path.join(report_dir, FOLDER)
    out = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    for name in names:
        stem, dot, ext = name.partition(".")
        if ext != "json" or not stem.isdigit():
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and (run_id is None or record.get("run_id") == run_id):
            out[int(stem)] = record
    return out


def hosts(records: dict[int, dict]) -> dict[int, str]:
    """rank -> host, for each rank some record's writer knew: a rank other than 0 knows its
    own node's and rank 0's node's ranks, so the records of survivors on several nodes
    together name every node they saw."""
    known: dict[int, str] = {}
    for record in records.values():
        for r, host in enumerate(record.get("hosts") or []):
            if host:
                known.setdefault(r, host)
    return known


def clear(report_dir: str, run_id: str, since: float | None = None) -> None:
    """Rank 0, before it connects: an earlier run's records must never speak for this run.
    Kept: this run's records written since ``since`` (epoch seconds; default: this process's
    start), a rank's that lost the store while rank 0 was still starting; an earlier run of
    the same id (a resubmitted job of one name) wrote before that."""
    since = proc.started() if since is None else since
    folder = os.path.join(report_dir, FOLDER)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    mine = read(report_dir, run_id)
    for name in names:
        path = os.path.join(folder, name)
        try:
            stem = name.partition(".")[0]
            if name == f"{stem}.json" and stem.isdigit() and int(stem) in mine \
                    and os.stat(path).st_mtime >= since:
                continue
            os.unlink(path)
        except OSError:
            pass
