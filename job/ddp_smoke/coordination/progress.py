"""The kit's collectives, counted: a light flight recorder that works the same on gloo and NCCL.

Every collective a check issues goes through this module. Each call records, on this rank,
the sequence number of the world collective it enters (``seq``), its op and size, and whether
the rank is inside it (entered and not yet left). The heartbeat thread publishes
:func:`progress` to the coordination store, so when a run stalls rank 0 can tell the rank that
never *entered* the collective the others are blocked in (the culprit) from the ranks blocked
inside it (victims) — see :mod:`ddp_smoke.coordination.blame`.

World collectives are issued by every rank in the same order, so their sequence numbers are
comparable across ranks. Point-to-point exchanges are issued by some ranks only: they are
recorded as "inside a sendrecv with rank P" without advancing ``seq``.

NCCL collectives return once enqueued; here the caller's stream is synchronised before the
call counts as left, so "inside" means the same thing on both backends: the data has not
arrived yet.

The recorder also keeps how long this rank spent inside each symmetric world collective of the
current check (:meth:`Recorder.spent`): the rank that arrives last spends the least time
inside while the others wait for it, which :mod:`ddp_smoke.coordination.stragglers` reads
without any clock agreement between hosts.
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor forms; older releases (2.11 on some GPU images) lack the new names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# A broadcast's root may leave as soon as its data is sent: its short stay is no late arrival.
# Every other world collective holds each rank until the last one has contributed.
_ASYMMETRIC = {"broadcast"}


class Recorder:
    """This rank's collective progress; written by the main thread, read by the heartbeat."""

    def __init__(self):
        self._lock = threading.Lock()
        self.seq = 0            # world collectives entered so far
        self.op = None          # the current (or last) op
        self.nbytes = 0
        self.peer = None        # the other end of a point-to-point exchange
        self.inside = False
        self.since = time.monotonic()
        self._spent: list[float | None] = []  # seconds inside each world collective of the check
        self.keep = 2048                      # at most this many kept per check (set by the harness)
        self.stall = False  # the injector's ``stall``: the next collective never returns

    @contextlib.contextmanager
    def track(self, op: str, nbytes: int = 0, peer: int | None = None):
        """Mark this rank inside ``op`` for the duration of the block."""
        with self._lock:
            if peer is None:
                self.seq += 1
            self.op, self.nbytes, self.peer = op, int(nbytes), peer
            self.inside, self.since = True, time.monotonic()
        while self.stall:  # inside by its own count; the backend never gets the call
            time.sleep(3600)
        try:
            yield
        finally:
            with self._lock:
                now = time.monotonic()
                if peer is None and len(self._spent) < self.keep:
                    # None keeps the k-th entry the k-th collective on every rank
                    self._spent.append(None if op in _ASYMMETRIC else now - self.since)
                self.inside, self.since = False, now

    def spent(self) -> list[float | None]:
        """Seconds this rank spent inside each world collective since the last call (in
        issue order, the first ``keep`` of them; None for a broadcast), and start anew."""
        with self._lock:
            got, self._spent = self._spent, []
        return [None if s is None else round(s, 6) for s in got]

    def spent_so_far(self) -> list[float | None]:
        """:meth:`spent` without starting anew: the current check's durations until now."""
        with self._lock:
            return [None if s is None else round(s, 6) for s in self._spent]

    def snapshot(self) -> dict:
        """JSON-able progress: ``seq``, ``op``, ``bytes``, ``peer``, ``inside``, ``for_s``."""
        with self._lock:
            return {"seq": self.seq, "op": self.op, "bytes": self.nbytes, "peer": self.peer,
                    "inside": self.inside, "for_s": round(time.monotonic() - self.since, 3)}


RECORDER = Recorder()


def progress() -> dict:
    """This rank's collective progress, for the heartbeat."""
    return RECORDER.snapshot()


def _settle(tensor: torch.Tensor | None) -> None:
    """Wait until a CUDA collective's data has arrived (NCCL returns once enqueued)."""
    if tensor is not None and tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    with RECORDER.track("all_reduce", _nbytes(tensor)):
        dist.all_reduce(tensor, op=op)
        _settle(tensor)


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """Every rank's ``tensor`` concatenated into ``out``."""
    with RECORDER.track("all_gather", _nbytes(out)):
        _ALL_GATHER(out, tensor)
        _settle(out)


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """The sum of every rank's ``tensor``, this rank's chunk into ``out``."""
    with RECORDER.track("reduce_scatter", _nbytes(tensor)):
        _REDUCE_SCATTER(out, tensor)
        _settle(out)


def broadcast(tensor: torch.Tensor, src: int) -> None:
    with RECORDER.track("broadcast", _nbytes(tensor)):
        dist.broadcast(tensor, src=src)
        _settle(tensor)


def all_to_all_single(out: torch.Tensor, tensor: torch.Tensor) -> None:
    with RECORDER.track("all_to_all", _nbytes(tensor)):
        dist.all_to_all_single(out, tensor)
        _settle(out)


def barrier() -> None:
    with RECORDER.track("barrier"):
        dist.barrier()


def sendrecv(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int | None = None) -> None:
    """Send ``send`` to rank ``to`` while receiving ``recv`` from ``frm`` (default: ``to``)."""
    frm = to if frm is None else frm
    with RECORDER.track("sendrecv", _nbytes(send), peer=frm):
        ops = [dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        _settle(recv)


def ping_pong(tensor: torch.Tensor, peer: int, first: bool, iters: int) -> list[float]:
    """``iters`` round trips of ``tensor`` with rank ``peer``: the ``first`` side sends and
    waits for the echo, the other echoes. Returns the seconds of each round trip on the first
    side (the other side's waits are not round trips: an empty list)."""
    out = []
    with RECORDER.track("ping_pong", _nbytes(tensor), peer=peer):
        for _ in range(iters):
            t = time.perf_counter()
            if first:
                dist.send(tensor, peer)
                dist.recv(tensor, peer)
            else:
                dist.recv(tensor, peer)
                dist.send(tensor, peer)
            _settle(tensor)
            if first:
                out.append(time.perf_counter() - t)
    return out


def tracked(op: str, nbytes: int = 0):
    """Count a block that issues world collectives the kit does not call itself (DDP's
    parameter broadcast and gradient all-reduce) as one collective."""
    return RECORDER.track(op, nbytes)
