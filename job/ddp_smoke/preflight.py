"""Preflight: can this node run the worker at all? A few seconds per node, no process group.

The commonest bring-up failures happen before the worker runs: a node whose venv or image is
broken, where ``import torch`` or CUDA initialisation fails or sees too few GPUs, where the
interface named in ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` does not exist, or that cannot
reach the rendezvous port. Then torchrun waits out its join timeout and nobody writes a
report. Preflight runs on every node before torchrun (the sbatch runs it with srun, the
image's entrypoint and ``submit`` run it too) and checks, each bounded by ``--timeout``:

* ``python``: this interpreter runs the kit (the command itself is the proof; a node where the
  import fails prints a traceback instead, which the launcher's verdict reads);
* ``report_dir``: the report folder can be written (a file is created and removed);
* ``interfaces``: every interface ``GLOO_SOCKET_IFNAME`` names exists and has an address
  (gloo takes exact names, comma-separated); ``NCCL_SOCKET_IFNAME`` in NCCL's syntax
  (``eth`` = names starting so, ``=eth0`` = exactly, ``^docker,lo`` = anything but) matches
  an interface with an address;
* ``rendezvous``: a TCP connection to the rendezvous host and port opens (retried while
  refused: the host may start later);
* ``torch``: torch imports (in a child process, so that a hung CUDA initialisation is bounded
  too) and, with ``--gpus N``, CUDA initialises every device and sees N of them.

The rendezvous store is not up while preflight runs (torchrun starts it afterwards), so the
node that will host it listens on the rendezvous port itself for the duration (``--serve``):
the others then reach exactly the address and port torchrun's store will use, through the same
firewalls. Each node says hello there; the host waits until every expected node did
(``--nodes``) or the timeout, and names the node ranks that never joined (on Kubernetes this is
the only place a pod that never left Pending shows up). Each hello carries the MTU of the
node's interface; the host names the nodes whose MTU differs from the rest (``mtu``: such a
link passes small packets and drops large ones). After its hello each node sends 64 KiB, which
the host answers once they all arrived: a path that passes the hello and drops large packets
(a black hole, with every MTU equal) fails both ends' ``rendezvous``/``joined`` within 5 s,
naming the node, where torchrun's rendezvous would wait out its join timeout (its state no
longer fits the path once two nodes joined). A node says hello once its own checks are
done, and a node whose checks failed says why in its hello: the host fails at once, naming it
(the pods of a job have no launcher to gather their records; the host's line is the job's
word). The listener closes before torchrun starts; the clients close first, so no TIME_WAIT is
left on the host's side of the port.

Each node writes one JSON record, ``REPORT_DIR/preflight/<node>.json``::

    {"node": "gpu07", "host": "gpu07", "node_rank": 1, "run_id": "…", "ok": false,
     "duration_s": 2.1, "reason": "interfaces: GLOO_SOCKET_IFNAME=ib9: no such interface …",
     "checks": [{"name": "interfaces", "ok": false, "detail": "…"}, …],
     "joined": {"0": "gpu06", "1": "gpu07"}}              # only on the rendezvous host

and prints one line. Exit status 0 when every check passed, 1 when one failed, 2 for bad
input. ``python -m ddp_smoke launch-report`` turns the records into a report.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

from . import __version__
from .config.args import Parser
from .errors import ConfigError
from .interfaces import check_interfaces, compare_mtus, interface_mtu
from .outputs.files import write_atomic
from .outputs.launch_report import error_line

RECORDS = "preflight"   # the records' folder under the report folder
DEFAULT_TIMEOUT_S = 30.0
HELLO = "ddp-smoke-preflight"
_FAILED = "failed:"  # in a hello, before why the node's own checks failed
_ANSWER_S = 2.0          # a hello's reply; the listener answers at once
# The path probe after each hello: larger than any frame, jumbo ones included, so a link that
# passes small packets and drops large ones keeps it out while the hello got through; 64 KiB
# take milliseconds on a healthy path, a loaded one included.
PATH_BYTES = 1 << 16
PATH_S = 5.0
_RETRY_S = 0.25          # connection refused: the host's listener is not up yet
_TORCH_PROBE = r"""
import json, sys, time
t0 = time.monotonic()
import torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "import_s": time.monotonic() - t0}
if int(sys.argv[1]) > 0:
    n = torch.cuda.device_count()
    out["gpus"] = n
    for i in range(n):  # initialise each device: a broken GPU fails here, not in the run
        torch.ones(1, device=f"cuda:{i}").sum().item()
print(json.dumps(out))
"""


def node_name(environ=os.environ) -> str:
    """The launcher's name for this node: Slurm's NodeName (what srun and scontrol use), the
    pod's node, else the hostname."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def node_rank(environ=os.environ) -> int | None:
    """This node's index in the launch (Slurm node id, the operator's node rank)."""
    for key in ("SLURM_NODEID", "PET_NODE_RANK", "GROUP_RANK", "JOB_COMPLETION_INDEX"):
        value = environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


# -- report folder --------------------------------------------------------------------------

def check_report_dir(report_dir: str) -> tuple[bool, str]:
    """The report folder exists (or can be made) and takes a file."""
    path = os.path.join(report_dir, f".preflight-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(report_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write("x")
        os.unlink(path)
    except OSError as e:
        return False, f"report folder {report_dir} not writable: {e.strerror or e}"
    return True, f"{report_dir} writable"


# -- rendezvous -----------------------------------------------------------------------------

def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); ConfigError when malformed."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv {endpoint!r}: expected HOST:PORT")
    return host, int(port)


class Listener:
    """The rendezvous host's stand-in for the store while preflight runs: accepts hellos
    (``ddp-smoke-preflight <run id> <node rank> <node>``), answers each, remembers who said it.
    """

    def __init__(self, port: int, run_id: str):
        self.run_id, self.joined = run_id or "-", {}
        self.failed: dict[str, str] = {}  # node rank (or name) -> "node: why", from its hello
        self.mtus: dict[str, int] = {}  # node -> MTU of the interface it reached us by
        self.changed = threading.Condition()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # The store binds this port right after: no state of ours may keep it busy.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("", port))  # OSError (EADDRINUSE …) is the caller's finding
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue  # the accept timeout, or the socket closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_ANSWER_S)
            try:
                reader = conn.makefile("rb")
                words = reader.readline().decode(errors="replace").split()
                if len(words) >= 4 and words[0] == HELLO:
                    conn.sendall(f"{HELLO} {self.run_id}\n".encode())
                    mine = interface_mtu(conn.getsockname()[0])  # this host's, named later
                    # by node rank; without one by name and address (two machines may
                    # share a hostname: that is the environment check's to name, later)
                    key = words[2] if words[2] != "-" else f"{words[3]}@{conn.getpeername()[0]}"
                    _, failed, why = " ".join(words[4:]).partition(f"{_FAILED} ")
                    blocked = _take_path_probe(conn, reader)
                    with self.changed:
                        self.joined[key] = words[3]
                        if failed or blocked:
                            self.failed[key] = f"{words[3]}: {why or blocked}"
                        self.mtus.update({words[3]: int(w[4:]) for w in words[4:5]
                                          if w.startswith("mtu=") and w[4:].isdigit()})
                        if mine:
                            self.mtus.setdefault("", mine)
                        self.changed.notify_all()
                    conn.recv(1)  # the client closes first: TIME_WAIT stays on its side
            except OSError:
                pass

    def wait(self, nodes: int, deadline: float) -> dict[str, str]:
        """Who joined, once ``nodes`` did or at the deadline."""
        with self.changed:
            while len(self.joined) < nodes and time.monotonic() < deadline:
                self.changed.wait(max(0.0, min(0.5, deadline - time.monotonic())))
            return dict(self.joined)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def _take_path_probe(conn: socket.socket, reader) -> str:
    """The host's side of the path probe: read the client's PATH_BYTES line and answer it;
    why it did not come whole ("" when it did, or when the client sent none and closed)."""
    conn.settimeout(PATH_S)
    try:
        got = reader.readline(PATH_BYTES + 1)
    except OSError:  # (socket.timeout)
        got = None
    if got == b"":
        return ""  # closed after its hello: a client that probes nothing
    if got is None or len(got) <= PATH_BYTES:
        return (f"path: its hello arrived, a {PATH_BYTES >> 10} KiB message after it did not "
                f"within {PATH_S:g} s: a link between it and this rendezvous host drops large "
                "packets (an MTU mismatch on the way, a black hole)")
    conn.sendall(b"ok\n")
    return ""


def say_hello(host: str, port: int, deadline: float, run_id: str, rank: int | None,
              node: str, problem: str = "") -> tuple[bool, str]:
    """Open a TCP connection to the rendezvous endpoint before the deadline; say hello (and
    ``problem``: why this node's own checks failed, on one line)."""
    t0, last = time.monotonic(), "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, (f"cannot reach rendezvous {host}:{port} over TCP within "
                           f"{time.monotonic() - t0:.0f} s: {last}")
        try:
            with socket.create_connection((host, port), timeout=min(left, 3.0)) as s:
                took = time.monotonic() - t0
                s.settimeout(_ANSWER_S)
                mtu = interface_mtu(s.getsockname()[0])
                failed = f" {_FAILED} {' '.join(problem.split())}" if problem else ""
                s.sendall(f"{HELLO} {run_id or '-'} {rank if rank is not None else '-'} "
                          f"{node}{f' mtu={mtu}' if mtu else ''}{failed}\n".encode())
                reader = s.makefile("rb")
                try:
                    answer = reader.readline().decode(errors="replace").split()
                except OSError:
                    answer = []
                if answer[:1] == [HELLO]:
                    return _send_path_probe(s, reader, host, port, took, deadline)
            return True, (f"rendezvous {host}:{port} reached in {took * 1000:.0f} ms (a "
                          "program that is not preflight answered)")
        except ConnectionRefusedError:
            last = "connection refused (nothing listens there yet, or a firewall rejects)"
            time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))
        except socket.timeout:
            last = "timed out (packets dropped: a firewall, or no route)"
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))


def _send_path_probe(s: socket.socket, reader, host: str, port: int, took: float,
                     deadline: float) -> tuple[bool, str]:
    """The client's side of the path probe: PATH_BYTES to the host, which answers once they
    all arrived (within PATH_S, and before ``deadline``)."""
    s.settimeout(max(0.1, min(PATH_S, deadline - time.monotonic())))
    try:
        s.sendall(b"p" * PATH_BYTES + b"\n")
        answer = reader.readline()
    except OSError:
        answer = b""
    if answer.strip() != b"ok":
        return False, (f"rendezvous {host}:{port} reached and its hello answered, but a "
                       f"{PATH_BYTES >> 10} KiB message to it did not arrive within "
                       f"{PATH_S:g} s: a link on the way drops large packets (an MTU mismatch, "
                       "a black hole: jumbo frames behind a port without them)")
    return True, (f"rendezvous {host}:{port} reached in {took * 1000:.0f} ms (the rendezvous "
                  f"host's preflight answered; {PATH_BYTES >> 10} KiB crossed)")


# -- torch and CUDA -------------------------------------------------------------------------

def start_torch_probe(gpus: int) -> subprocess.Popen:
    """Import torch (and initialise every GPU) in a child, while the network checks run."""
    return subprocess.Popen([sys.executable, "-c", _TORCH_PROBE, str(gpus)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_torch_probe(proc: subprocess.Popen, gpus: int, deadline: float) -> tuple[bool, str]:
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        what = "CUDA initialisation" if gpus else "import torch"
        return False, f"{what} did not finish within the preflight timeout"
    if proc.returncode != 0:
        return False, f"import torch failed: {error_line(err.splitlines()) or f'exit {proc.returncode}'}"
    facts = json.loads(out.strip().splitlines()[-1])
    text = f"torch {facts['torch']} imported in {facts['import_s']:.1f} s"
    if gpus:
        if facts.get("gpus") != gpus:
            return False, f"{text}; CUDA sees {facts.get('gpus')} GPU(s), expected {gpus}"
        text += f"; CUDA {facts['cuda']} initialised {gpus} GPU(s)"
    return True, text


# -- the run --------------------------------------------------------------------------------

def run(args: argparse.Namespace, environ=os.environ) -> dict:
    """All checks on this node; returns the record (also written when ``--report-dir``)."""
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    node, rank = args.node or node_name(environ), node_rank(environ)
    run_id = args.run_id or environ.get("DDP_SMOKE_RUN_ID", "")
    checks: list[dict] = []

    def note(name: str, result: tuple[bool, str]) -> None:
        checks.append({"name": name, "ok": result[0], "detail": result[1]})

    note("python", (True, f"python {sys.version.split()[0]} ({sys.executable}), "
                          f"ddp_smoke {__version__}"))
    listener = None
    rdzv = split_endpoint(args.rdzv) if args.rdzv else None
    if args.serve and rdzv:
        try:  # first: the others may already be knocking
            listener = Listener(rdzv[1], run_id)
        except OSError as e:
            note("rendezvous_host", (False, f"cannot listen on the rendezvous port {rdzv[1]} "
                                            f"on this node: {e.strerror or e} (another program "
                                            "holds it?); torchrun's store could not either"))
    probe = start_torch_probe(args.gpus) if not args.skip_torch else None
    if args.report_dir:
        note("report_dir", check_report_dir(args.report_dir))
    note("interfaces", check_interfaces(environ))
    if probe is not None:
        note("torch", finish_torch_probe(probe, args.gpus, deadline - 2.0))
    if rdzv:  # with what failed here, for the host to say at once
        problem = "; ".join(f"{c['name']}: {c['detail']}" for c in checks if not c["ok"])
        # Its own checks end first, then its hello, over a second before the host's wait:
        # under Slurm the host's failure ends the step, and a node still saying why it could
        # not reach it lost its record (CI: "no preflight record" for a node cut from the
        # port, 0.2 s apart before); a torch import slower than the hello's deadline left the
        # host no time to say hello to itself
        note("rendezvous", say_hello(*rdzv, deadline - 1.5, run_id, rank, node, problem))
    joined = None
    if listener is not None:
        # (--hello-wait: the image's nodes may start later, or run torchrun without preflight)
        waited = deadline if args.hello_wait is None else min(deadline, t0 + args.hello_wait)
        joined = listener.wait(args.nodes, waited - 0.3)
        listener.close()
        # (the others' own failures are theirs: "joined", which the launchers' verdicts read
        # as the host's word on the others)
        others = {r: why for r, why in sorted(listener.failed.items())
                  if not _is_own(r, rank, node)}  # (not its own: said as its own)
        failed = [f"node rank {r} {why}" if r.isdigit() else f"node {why}"
                  for r, why in others.items()]
        if args.nodes and len(joined) < args.nodes and args.hello_wait is None:
            failed.insert(0, never_joined(joined, args.nodes, args.timeout))
        if failed:
            note("joined", (False, "; ".join(failed)))
            # by name, for the launcher's report (each named node's own record may be elsewhere)
            checks[-1]["nodes"] = dict(why.split(": ", 1) for why in others.values())
        else:
            note("joined", (True, f"{len(joined)} node(s) said hello"))
        mtus = dict(listener.mtus)
        own = mtus.pop("", None)  # the host's own, unless it said hello to itself
        if own:
            mtus.setdefault(node, own)
        ok, detail, odd = compare_mtus(mtus)
        note("mtu", (ok, detail))
        checks[-1]["nodes"] = odd
    failed = [c for c in checks if not c["ok"]]
    record = {"node": node, "host": socket.gethostname(), "node_rank": rank, "run_id": run_id,
              "ok": not failed, "version": __version__,
              "duration_s": round(time.monotonic() - t0, 3),
              "reason": "; ".join(f"{c['name']}: {c['detail']}" for c in failed),
              "checks": checks}
    if joined is not None:
        record["joined"] = joined
    if args.report_dir:
        write_record(record, args.report_dir)
    return record


def _is_own(key: str, rank: int | None, node: str) -> bool:
    """A hello's key (its node rank, else its name@address) is this node's own."""
    return key in (str(rank), node) or key.startswith(f"{node}@")


def never_joined(joined: dict[str, str], nodes: int, timeout_s: float) -> str:
    """``node rank(s) 1, 2 never joined …``, naming the ranks missing from 0..nodes-1."""
    missing = [str(r) for r in range(nodes) if str(r) not in joined]
    if any(not k.isdigit() for k in joined):  # nodes without a rank said hello by name
        missing = []
    names = ", ".join(f"{r} {n}" for r, n in sorted(joined.items()))
    which = f"node rank(s) {', '.join(missing)}" if missing else f"{nodes - len(joined)} node(s)"
    return (f"{which} never joined within {timeout_s:.0f} s: {len(joined)} of {nodes} said "
            f"hello ({names or 'none'})")


def write_record(record: dict, report_dir: str) -> str:
    path = os.path.join(report_dir, RECORDS, f"{record['node']}.json")
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return path


def line(record: dict) -> str:
    """The record in one line."""
    if record["ok"]:
        return (f"ddp-smoke preflight: {record['node']} ok in {record['duration_s']:.1f} s · "
                + " · ".join(c["detail"] for c in record["checks"]))
    return f"ddp-smoke preflight: {record['node']} FAIL · {record['reason']}"


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m ddp_smoke preflight", description=__doc__)
    p.add_argument("--report-dir", metavar="DIR",
                   help="check it is writable and write DIR/preflight/<node>.json")
    p.add_argument("--rdzv", metavar="HOST:PORT", help="the rendezvous endpoint to reach")
    p.add_argument("--serve", action="store_true",
                   help="this node hosts the rendezvous: listen on its port meanwhile")
    p.add_argument("--nodes", type=int, default=0, metavar="N",
                   help="with --serve: wait until N nodes said hello (or the timeout)")
    p.add_argument("--hello-wait", type=float, metavar="SECONDS",
                   help="with --serve: wait that long at most for the --nodes, none missing")
    p.add_argument("--gpus", type=int, default=0, metavar="N",
                   help="CUDA must initialise and see N GPUs (default 0: no CUDA check)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"bound on the whole preflight (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--node", help="this node's name in the record (default: SLURMD_NODENAME, "
                                  "else the hostname)")
    p.add_argument("--run-id", help="default DDP_SMOKE_RUN_ID")
    p.add_argument("--skip-torch", action="store_true", help="leave out the torch import")
    return p


def main(argv: list[str]) -> int:
    """``python -m ddp_smoke preflight …``: 0 all passed, 1 a check failed, 2 bad input."""
    try:
        args = _parser().parse_args(argv)
        if not 0 < args.timeout <= 3600:
            raise ConfigError(f"--timeout {args.timeout}: expected seconds in (0, 3600]")
        if args.nodes < 0 or args.gpus < 0:
            raise ConfigError("--nodes and --gpus: expected integers >= 0")
        if args.rdzv:
            split_endpoint(args.rdzv)
        record = run(args)
    except ConfigError as e:
        print(f"ddp-smoke: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 — a record could not be written: one line, named
        print(f"ddp-smoke preflight: {node_name()} FAIL · {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    print(line(record), file=sys.stdout if record["ok"] else sys.stderr, flush=True)
    return 0 if record["ok"] else 1
