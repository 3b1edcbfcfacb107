"""A process with no part in a run that writes into its coordination store, as any user who
reaches the store's port could (issue 27): forged aborts, results, heartbeats and arrivals.

It knows what anyone can learn: the store's address and port (in every worker's environment)
and the kit's key names (in its source). It does not know the run's secret.
"""
from __future__ import annotations

import datetime
import json
import threading
import time

import torch.distributed as dist

PREFIX = "ddp_smoke/0/"


class Forger(threading.Thread):
    """Connects to ``addr:port`` once the run's store is up, waits for the run to start
    (``run_id`` posted), then writes each forgery in ``plan``: ``(after, key, value, how)``,
    where ``after`` is a key to wait for first (or None), ``how`` ``set`` or ``append``. Until
    stopped it rewrites the heartbeats in ``beats`` (rank -> record) every 20 ms, so that a
    genuine beat (one each 0.25 s) never stands for long. ``done`` lists the forgeries
    written."""

    def __init__(self, addr: str, port: int, plan: list[tuple], beats: dict | None = None,
                 timeout_s: float = 120):
        super().__init__(daemon=True, name="forger")
        self.addr, self.port, self.plan, self.beats = addr, port, plan, beats or {}
        self.end = time.monotonic() + timeout_s
        self.stop = threading.Event()
        self.done: list[str] = []
        self.error: str | None = None

    def _connect(self):
        while time.monotonic() < self.end and not self.stop.is_set():
            try:
                return dist.TCPStore(self.addr, self.port, 1, False,
                                     datetime.timedelta(seconds=5), wait_for_workers=False)
            except Exception:  # noqa: BLE001 — not up yet
                time.sleep(0.2)
        return None

    def _wait(self, store, key: str) -> bool:
        while time.monotonic() < self.end and not self.stop.is_set():
            if store.check([PREFIX + key]):
                return True
            time.sleep(0.02)
        return False

    def run(self) -> None:
        try:
            store = self._connect()
            if store is None or not self._wait(store, "run_id"):
                self.error = "the run's store never came up"
                return
            pending = list(self.plan)
            n = 10 ** 6
            while not self.stop.is_set() and time.monotonic() < self.end:
                for item in list(pending):
                    after, key, value, how = item
                    if after is None or store.check([PREFIX + after]):
                        text = value if isinstance(value, str) else json.dumps(value)
                        (store.append if how == "append" else store.set)(PREFIX + key, text)
                        self.done.append(key)
                        pending.remove(item)
                n += 1
                for rank, beat in self.beats.items():
                    store.set(f"{PREFIX}beat/{rank}", json.dumps({**beat, "n": n}))
                time.sleep(0.02)
        except Exception as e:  # noqa: BLE001 — the run ended and took its store along
            if not self.done:
                self.error = f"{type(e).__name__}: {e}"


def abort(rank: int, stage: str) -> list[tuple]:
    """An abort in ``rank``'s name, listed as the kit lists one: the run's example of issue 27."""
    body = {"rank": rank, "kind": "terminated", "signal": "SIGTERM", "stage": stage,
            "at": time.time()}
    return [(None, f"abort/{rank}", body, "set"), (None, "abort/listed", f"{rank},", "append")]
