"""The runs under a root, read once: figures per host and GPU, and their SQLite index.

See :mod:`ddp_smoke.outputs.history` for what is kept and why; this module reads reports
(tolerant of any shape: a field of another type counts as missing) and keeps the index
``ROOT/.ddp-smoke-history.sqlite`` in step with them.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sqlite3
import time

from ..model import injected
from . import fleet

INDEX_NAME = ".ddp-smoke-history.sqlite"
# 2: runs.practice, compute figures the sustained median block; 3: the fleet memory's tables
# (_FLEET_TABLES); 4: the training check's figures; 5: hosts.status (was hosts.verdict)
SCHEMA = 5
REPORT = "report.json"
# Folders a run writes beside its report: never a run of their own, not worth a walk.
_ARTIFACT_DIRS = {"storage", "flight", "stacks", "nccl", "torchrun"}


# -- figures of one report (pure) ---------------------------------------------------------

def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def _l(x) -> list:
    return x if isinstance(x, list) else []


def _num(x) -> float | None:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def human_bytes(n) -> str:
    """1024 -> '1 KiB' (sizes are powers of two, or near one: all_gather's 16383 B reads
    '16 KiB'; report.json has the exact figure)."""
    n = _num(n)
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"


def _check(report: dict, name: str) -> dict:
    for c in _l(report.get("checks")):
        if _d(c).get("name") == name and c.get("status") in ("pass", "fail"):
            return c
    return {}


def device_type(report: dict) -> str:
    """``cuda`` or ``cpu``: which margin applies to this run's figures."""
    devices = [str(_d(r).get("device") or "") for r in _l(report.get("ranks"))]
    return "cuda" if any(d.startswith("cuda") for d in devices) else "cpu"


def gpu_key(rank: dict) -> tuple[str, str]:
    """(key, label) of a rank's device: the GPU's serial, else UUID, else host:local_rank."""
    ident = _d(rank.get("identity"))
    host, local = rank.get("host"), rank.get("local_rank")
    serial = ident.get("gpu_serial")
    uuid = ident.get("gpu_uuid") or rank.get("gpu_uuid")
    kind = "gpu" if str(rank.get("device") or "").startswith("cuda") else "cpu slot"
    if serial:
        return f"serial:{serial}", f"GPU serial {serial} (now {host} gpu {local})"
    if uuid:
        return f"uuid:{uuid}", f"GPU {uuid} (now {host} gpu {local})"
    return f"{host}:{local}", f"{host} {kind} {local}"


def figures(report: dict) -> list[dict]:
    """The figures history keeps from one report.json dict; tolerant of missing parts.

    Returns:
        ``{"kind": "host"|"gpu", "entity", "label", "host", "figure", "unit", "value"}`` rows.
    """
    out = []
    ranks = [_d(r) for r in _l(report.get("ranks"))]

    def add(kind, entity, label, host, figure, unit, value):
        value = _num(value)
        if entity and value is not None and value > 0:
            out.append({"kind": kind, "entity": str(entity), "label": str(label),
                        "host": str(host) if host else None, "figure": figure, "unit": unit,
                        "value": value})

    def slot(row: dict) -> tuple[str, str, str | None]:  # a per-rank row's device: key, label, host
        rank = row.get("rank")
        record = ranks[rank] if isinstance(rank, int) and 0 <= rank < len(ranks) else {}
        host = record.get("host") or row.get("host")
        return (*gpu_key({**record, "host": host}), host)

    bw = _d(_check(report, "bandwidth").get("figures"))
    pairs = _d(bw.get("pairs"))
    best: dict[str, float] = {}
    for p in _l(pairs.get("results")):
        p, v = _d(p), _num(_d(p).get("busbw_gbps"))
        for host in (p.get("host_a"), p.get("host_b")):
            if host and v is not None:
                best[host] = max(best.get(host, 0.0), v)
    for host, v in best.items():
        add("host", host, host, host,
            f"best node-pair busbw {human_bytes(pairs.get('size_bytes'))}", "GB/s", v)
    hosts = {r.get("host") for r in ranks if r.get("host")}
    if len(hosts) == 1:
        host = next(iter(hosts))
        last: dict[str, dict] = {}
        for row in _l(bw.get("results")):
            row = _d(row)
            c, s = row.get("collective"), _num(row.get("size_bytes"))
            if c and s is not None and s >= (_num(last.get(c, {}).get("size_bytes")) or 0):
                last[c] = row
        for c, row in last.items():
            add("host", host, host, host, f"{c} busbw {human_bytes(row.get('size_bytes'))} "
                f"x{report.get('world_size')} ranks", "GB/s", row.get("busbw_gbps"))
    comp = _d(_check(report, "compute").get("figures"))
    size = comp.get("matrix_size")
    # the terminal's unit: GFLOPS for a CPU slot, TFLOPS for a GPU (checks/compute.py)
    unit, scale = ("TFLOPS", 1.0) if device_type(report) == "cuda" else ("GFLOPS", 1e3)
    for row in map(_d, _l(comp.get("ranks"))):
        key, label, host = slot(row)
        for dtype, m in _d(row.get("matmul")).items():
            # the median block, the rate the compute check judges: a throttled or quota-held
            # device keeps its best block (a CPU slot's best is even timed in CPU seconds)
            sustained = _num(_d(m).get("tflops_median"))
            add("gpu", key, label, host, f"{dtype} matmul n={size} sustained", unit,
                None if sustained is None else sustained * scale)
        add("gpu", key, label, host, "hbm copy", "GB/s", row.get("hbm_gbps"))
    train = _d(_check(report, "training").get("figures"))
    model = _d(train.get("model"))
    # comparable runs: the same layout and mesh (world size), model size and batch
    what = (f"training {train.get('layout')} {'x'.join(map(str, _l(train.get('mesh'))))} ranks, "
            f"{(_num(model.get('params')) or 0) / 1e6:.4g}M params, batch "
            f"{model.get('micro_batch')}x{model.get('seq_len')}")
    for row in map(_d, _l(train.get("ranks"))):
        key, label, host = slot(row)
        add("gpu", key, label, host, what, "tokens/s", row.get("tokens_per_s"))
        mfu = _num(row.get("mfu"))  # null on CPU: no figure
        add("gpu", key, label, host, f"{what} MFU", "%", None if mfu is None else mfu * 100)
    return out


def host_runs(report: dict) -> list[tuple]:
    """(host, status, first reason, boot id) of every host of a report: the fleet memory's
    row (the boot id from the health check's node figures, when it read one)."""
    boots = {_d(n).get("host"): _d(n).get("boot_id")
             for c in _l(report.get("checks")) if _d(c).get("name") == "health"
             for n in _l(_d(_d(c).get("figures")).get("nodes"))}
    out = []
    for h in map(_d, _l(report.get("hosts"))):
        if not h.get("host"):
            continue
        first = _d((sorted(map(_d, _l(h.get("reasons"))), key=lambda r: "link" in r) or [{}])[0])
        reason = f"{first.get('check')}: {first.get('reason')}" if first else ""
        boot = boots.get(h["host"])
        out.append((str(h["host"]), str(h.get("status") or ""), reason[:300],
                    str(boot) if boot else None))
    return out


def run_time(report: dict, fallback: float) -> float:
    """When the run started (Unix time), from ``started_at``; else the file's mtime."""
    try:
        return datetime.datetime.fromisoformat(str(report["started_at"])).timestamp()
    except (KeyError, TypeError, ValueError):
        return fallback


# -- the index ------------------------------------------------------------------------------

_TABLES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE runs (path TEXT PRIMARY KEY, mtime_ns INTEGER, size INTEGER, t REAL,
                   run_id TEXT, verdict TEXT, device TEXT, margin REAL, readable INTEGER,
                   practice TEXT);
CREATE TABLE figures (path TEXT, kind TEXT, entity TEXT, label TEXT, host TEXT, figure TEXT,
                      unit TEXT, value REAL);
CREATE INDEX figures_by_entity ON figures (kind, entity, figure);
CREATE INDEX figures_by_path ON figures (path);
CREATE TABLE hosts (path TEXT, host TEXT, status TEXT);
CREATE INDEX hosts_by_path ON hosts (path);
"""
# The fleet memory (outputs/fleet.py): each host's status in each run with its first reason and
# boot id (practice runs left out: a failure made on purpose is no failure of the node), and
# the kit's own actions from actions.json beside the report (written after it: kept fresh on
# its own mtime and size).
_FLEET_TABLES = """
CREATE TABLE host_runs (path TEXT, host TEXT, status TEXT, reason TEXT, boot_id TEXT);
CREATE INDEX host_runs_by_host ON host_runs (host);
CREATE TABLE actions (path TEXT, t TEXT, run_id TEXT, node TEXT, action TEXT, reason TEXT,
                      done INTEGER, detail TEXT);
CREATE TABLE action_files (path TEXT PRIMARY KEY, mtime_ns INTEGER, size INTEGER);
"""


class Index:
    """The SQLite index of the reports under ``root``; see the module docstring."""

    def __init__(self, root: str, settings: dict | None = None, create: bool = True):
        """``create=False``: use the index only when it exists, else one in memory (rank 0
        leaves a root it was not asked to index as it found it)."""
        self.root = os.path.abspath(root)
        self.path = os.path.join(self.root, INDEX_NAME)
        self.create = create
        self.settings = dict(settings or {})
        self.db = self._open()
        self.stats = {"reports": 0, "read": 0, "removed": 0, "unreadable": 0, "complete": True}

    def _open(self) -> sqlite3.Connection:
        exists = os.path.exists(self.path)
        writable = (exists or self.create) and os.access(self.root, os.W_OK) and (
            not exists or os.access(self.path, os.W_OK))
        for attempt in range(2 if writable else 0):
            try:
                db = sqlite3.connect(self.path, timeout=5)
                if self._schema(db) == SCHEMA:
                    return db
                db.close()
                if attempt == 0:  # another schema or an empty file: rebuild from the reports
                    os.unlink(self.path)
            except (sqlite3.Error, OSError):
                if attempt == 0 and os.path.exists(self.path):
                    try:
                        os.unlink(self.path)  # corrupt: the reports are the record
                        continue
                    except OSError:
                        pass
                break
        # A root we cannot write (another user's, read-only): an index in memory, this time only.
        self.path = ":memory:"
        db = sqlite3.connect(":memory:")
        self._schema(db)
        return db

    @staticmethod
    def _schema(db: sqlite3.Connection) -> int:
        have = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not have:
            db.executescript(_TABLES + _FLEET_TABLES)
            db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
            db.commit()
            return SCHEMA
        row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone() \
            if "meta" in have else None
        return int(row[0]) if row and str(row[0]).isdigit() else -1

    def close(self) -> None:
        self.db.close()

    # refresh -------------------------------------------------------------------------------
    def reports(self, deadline: float | None = None):
        """Paths of every report.json under the root, relative to it, in a stable order.

        A folder that holds a report is a run: its subfolders (storage, stacks …) are not
        walked; neither are hidden folders. Stops at ``deadline`` (the worker's budget).
        """
        for top, dirs, files in os.walk(self.root):
            if deadline is not None and time.monotonic() > deadline:
                self.stats["complete"] = False
                return
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                             and not (REPORT in files and d in _ARTIFACT_DIRS))
            if REPORT in files:
                yield os.path.relpath(os.path.join(top, REPORT), self.root)

    def refresh(self, deadline: float | None = None) -> dict:
        """Bring the index up to date with the reports; return counts of what it did."""
        known = {p: (m, s) for p, m, s in self.db.execute("SELECT path, mtime_ns, size FROM runs")}
        seen = set()
        for rel in self.reports(deadline):
            seen.add(rel)
            try:
                st = os.stat(os.path.join(self.root, rel))
            except OSError:
                continue
            if known.get(rel) == (st.st_mtime_ns, st.st_size):
                self._actions(rel)
                continue
            self._add(rel, st)
            if deadline is not None and time.monotonic() > deadline:
                self.stats["complete"] = False
                break
        if self.stats["complete"]:  # only a whole walk knows what went
            gone = [p for p in known if p not in seen]
            for p in gone:
                self._remove(p)
            self.stats["removed"] = len(gone)
        self.stats["reports"] = self.db.execute(
            "SELECT COUNT(*) FROM runs WHERE readable = 1").fetchone()[0]
        try:
            self.db.commit()
        except sqlite3.Error:  # locked by another writer past the timeout: next time
            pass
        return self.stats

    def _remove(self, rel: str) -> None:
        for table in ("runs", "figures", "hosts", "host_runs", "actions", "action_files"):
            self.db.execute(f"DELETE FROM {table} WHERE path = ?", (rel,))

    def _add(self, rel: str, st: os.stat_result) -> None:
        self._remove(rel)
        self.stats["read"] += 1
        try:
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
                report = json.load(f)
            if not isinstance(report, dict):
                raise ValueError("not an object")
        except (OSError, ValueError):  # half-written by hand, truncated, not ours
            self.stats["unreadable"] += 1
            self.db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,0,NULL)",
                            (rel, st.st_mtime_ns, st.st_size, st.st_mtime, None, None, None,
                             None))
            return
        device = device_type(report)
        own = _d(_d(report.get("config")).get("history"))
        margin = _num(own.get("margin_cpu" if device == "cpu" else "margin"))
        self.db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,1,?)",
                        (rel, st.st_mtime_ns, st.st_size, run_time(report, st.st_mtime),
                         str(report.get("run_id") or ""), str(report.get("verdict") or ""),
                         device, margin, injected(report)))
        self.db.executemany(
            "INSERT INTO figures VALUES (?,?,?,?,?,?,?,?)",
            [(rel, f["kind"], f["entity"], f["label"], f["host"], f["figure"], f["unit"],
              f["value"]) for f in figures(report)])
        self.db.executemany("INSERT INTO hosts VALUES (?,?,?)",
                            [(rel, str(_d(h).get("host")), str(_d(h).get("status") or _d(h).get("verdict")))
                             for h in _l(report.get("hosts")) if _d(h).get("host")])
        if not report.get("injected"):
            self.db.executemany("INSERT INTO host_runs VALUES (?,?,?,?,?)",
                                [(rel, *row) for row in host_runs(report)])
        self._actions(rel)

    def _actions(self, rel: str) -> None:
        """Read the run's actions.json again when it changed (or came, or went)."""
        path = os.path.join(os.path.dirname(rel), fleet.ACTIONS_FILE)
        try:
            st = os.stat(os.path.join(self.root, path))
            now = (st.st_mtime_ns, st.st_size)
        except OSError:
            now = None
        had = self.db.execute("SELECT mtime_ns, size FROM action_files WHERE path = ?",
                              (rel,)).fetchone()
        if (tuple(had) if had else None) == now:
            return
        self.db.execute("DELETE FROM actions WHERE path = ?", (rel,))
        self.db.execute("DELETE FROM action_files WHERE path = ?", (rel,))
        body = fleet.read(os.path.join(self.root, path)) if now else None
        if now:
            self.db.execute("INSERT INTO action_files VALUES (?,?,?)", (rel, *now))
        for a in _l((body or {}).get("actions")):
            a = _d(a)
            self.db.execute("INSERT INTO actions VALUES (?,?,?,?,?,?,?,?)",
                            (rel, str(a.get("t") or ""), str(body.get("run_id") or ""),
                             str(a.get("node") or ""), str(a.get("action") or ""),
                             str(a.get("reason") or ""), int(bool(a.get("done"))),
                             str(a.get("detail") or "")))

    # queries -------------------------------------------------------------------------------
    @property
    def _shown(self) -> str:
        """The runs the queries read: practice runs (``--fault``) only when the settings ask
        (``include_practice``): a failure made on purpose is no trend of the cluster's."""
        return "" if self.settings.get("include_practice") else " AND r.practice IS NULL"

    def runs(self) -> list[tuple]:
        """(path, t, run_id, verdict, practice) of every readable run shown, oldest first."""
        return self.db.execute("SELECT path, t, run_id, verdict, practice FROM runs r "
                               f"WHERE readable = 1{self._shown} ORDER BY t, path").fetchall()

    def practice_runs(self) -> int:
        """How many readable practice runs the index holds (shown or not)."""
        return self.db.execute("SELECT COUNT(*) FROM runs WHERE readable = 1 AND practice IS "
                               "NOT NULL").fetchone()[0]

    def entities(self, kind: str, names: list[str] | None = None) -> list[tuple[str, str]]:
        """(entity, label) of every entity of a kind (or those named), in first-seen order;
        the label is the latest run's."""
        rows = self.db.execute(
            "SELECT f.entity, f.label FROM figures f JOIN runs r ON r.path = f.path "
            f"WHERE f.kind = ?{self._shown} ORDER BY r.t, r.path", (kind,)).fetchall()
        labels = {}
        for entity, label in rows:
            labels[entity] = label
        keep = labels if names is None else {e: labels[e] for e in names if e in labels}
        return list(keep.items())

    def series(self, kind: str, entity: str, until: float | None = None) -> dict[str, dict]:
        """Each figure of an entity: ``{"unit", "points": [(t, path, run_id, value,
        practice)]}``, oldest first; only runs that started at or before ``until`` when given."""
        rows = self.db.execute(
            "SELECT f.figure, f.unit, r.t, r.path, r.run_id, f.value, r.device, r.margin, "
            "r.practice FROM figures f JOIN runs r ON r.path = f.path WHERE f.kind = ? AND "
            f"f.entity = ?{self._shown} ORDER BY r.t, r.path", (kind, entity)).fetchall()
        out: dict[str, dict] = {}
        for figure, unit, t, path, run_id, value, device, margin, practice in rows:
            if until is not None and t > until:
                continue
            entry = out.setdefault(figure, {"unit": unit, "points": []})
            entry["points"].append((t, path, run_id, value, practice))
            entry["device"], entry["run_margin"] = device, margin
        return out

    def host_statuses(self, host: str, until: float | None = None) -> list[tuple[str, bool]]:
        """(status, practice) of a host in every run shown, oldest first."""
        rows = self.db.execute(
            "SELECT r.t, h.status, r.practice FROM hosts h JOIN runs r ON r.path = h.path "
            f"WHERE h.host = ?{self._shown} ORDER BY r.t, r.path", (host,)).fetchall()
        return [(v, p is not None) for t, v, p in rows if until is None or t <= until]

    def host_runs(self) -> dict[str, list[dict]]:
        """Each host's runs, oldest first: ``{"t", "run_id", "status", "reason", "boot_id"}``
        (:func:`ddp_smoke.outputs.fleet.lemons` reads these)."""
        rows = self.db.execute(
            "SELECT h.host, r.t, r.run_id, h.status, h.reason, h.boot_id FROM host_runs h "
            "JOIN runs r ON r.path = h.path ORDER BY r.t, r.path").fetchall()
        out: dict[str, list[dict]] = {}
        for host, t, run_id, status, reason, boot in rows:
            out.setdefault(host, []).append({"t": t, "run_id": run_id, "status": status,
                                             "reason": reason, "boot_id": boot})
        return out

    def actions(self) -> list[dict]:
        """Every action the kit recorded (actions.json), oldest first."""
        rows = self.db.execute("SELECT t, run_id, node, action, reason, done, detail, path "
                               "FROM actions ORDER BY t, path").fetchall()
        keys = ("t", "run_id", "node", "action", "reason", "done", "detail", "path")
        return [dict(zip(keys, row)) for row in rows]

    def margin(self, entry: dict) -> float:
        """The margin for a series: the flag's, else the latest run's own config, else the
        default for its device type."""
        s = self.settings
        if s.get("margin_override") is not None:
            return s["margin_override"]
        if entry.get("run_margin") is not None:
            return entry["run_margin"]
        return s["margin_cpu"] if entry.get("device") == "cpu" else s["margin"]
