"""The fault campaign's matrix: dimensions, the cells that cannot exist (and why), the pairwise
covering set, the commit-seeded CI sample, and each cell's exact expected outcome. Pure.

A cell is one real fault of one *kind*, landing at one *position* (rank 0, a middle rank, the
last rank, the node that holds the coordination store) at one *stage* (the join, or a check),
under one *launcher*, on one *shape* (nodes x ranks per node). The full product is
33 x 4 x 10 x 9 x 6 = 71,280 cells; the covering set holds every pair of values of any two
dimensions that some possible cell holds (pairwise coverage), each pair in at least one cell,
chosen greedily for the most new pairs per second of expected run time.

Expected outcomes are what is *right*, from the launcher's structure (who hosts the store,
who stops whom) and what can be known where (the kernel's word is on the dead rank's node
only); :func:`expect` is the one place they are written, each with its reason.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import random

KINDS = ("sigkill", "sigsegv", "sigabrt", "sigterm", "sigstop", "exit", "oom", "hang", "stall",
         "slow_rank", "slow_link", "slow_node", "dead_link", "dead_node", "blackhole",
         "lossy_link", "lossy_one_way", "flapping_link", "slow_rail", "dead_rail", "store_killed",
         "disk_full", "read_only",
         "dup_hostname", "sdc", "missing_interface", "gpu_xid79", "gpu_off_bus",
         "gpu_remap_pending", "gpu_nvlink_down", "gpu_faults_per_gpu", "hca_port_down",
         "torch_skew")
POSITIONS = ("rank0", "middle", "last", "store_node")
STAGES = ("join", "environment", "ddp_step", "sampler_epochs", "collectives", "storage",
          "bandwidth", "transport", "compute", "health")
LAUNCHERS = ("torchrun", "smoke_local", "slurm", "image", "submit", "pytorchjob", "indexed_job",
             "trainjob", "node_check", "daemonset")
# Pods started alone, as Kubernetes starts them: the image's entrypoint on bare pods, the
# PyTorchJob of k8s/, its Indexed Job and its TrainJob (their pods as the Training Operator,
# Trainer with JobSet, the Job controller and the kubelet make them)
PODS = ("image", "pytorchjob", "indexed_job", "trainjob")
# docker/pod.sh's jobs: their rendezvous host's preflight waits for every pod's hello first
K8S_JOBS = ("pytorchjob", "indexed_job", "trainjob")
# node-check as Slurm's HealthCheckProgram: NxM is N Slurm nodes, each checking itself alone
# with --cpu-ranks M; the fault lands on one of them (Cell.node), and the outcome is the
# cluster's: the nodes the kit drained, with their reasons. Its worker runs these checks only.
NODE_CHECK_STAGES = ("join", "environment", "collectives", "bandwidth", "health")
# ... and as the DaemonSet of k8s/node-check, its pods in the pod emulation: one a node, each
# labelling its Node through the stand-in API server (tests/k8s_api.py)
NODE_TIER = ("node_check", "daemonset")
# 2x2: several nodes of several ranks, the node speakers on (runner.worker_args), as at scale
SHAPES = ("1x2", "1x3", "1x4", "2x2", "3x1", "4x1")
DIMENSIONS = {"kind": KINDS, "position": POSITIONS, "stage": STAGES, "launcher": LAUNCHERS,
              "shape": SHAPES}

# What each kind is, for the table's legend and the docs.
DESCRIBE = {
    "sigkill": "SIGKILL to the rank's process (an operator, the OOM killer's signal)",
    "sigsegv": "SIGSEGV to the rank's process (a crash in native code)",
    "sigabrt": "SIGABRT to the rank's process (abort() in a library)",
    "sigterm": "SIGTERM to the rank's process alone (a node reclaimed, a container stopped)",
    "sigstop": "SIGSTOP to the rank's process (frozen: a wedged node, a paused container)",
    "exit": "the rank exits with status 13 at the check's start (the injector's crash)",
    "oom": "a memory cgroup limit just above the rank's use: the kernel's OOM killer kills it",
    "hang": "the rank hangs in Python before arriving at the check (the injector's hang)",
    "stall": "the rank enters a collective and its call never returns (the injector's stall)",
    "slow_rank": "a cgroup CPU quota of 15 % of a core on the rank's process",
    "slow_link": "tc htb: 200 mbit on one link (both ends, by destination address)",
    "slow_node": "tc tbf: 200 mbit on every link of one node (both directions)",
    "dead_link": "iptables DROP between two nodes (both ends)",
    "dead_node": "iptables DROP of the node's subnet traffic (in and out)",
    "blackhole": "iptables drops packets over 1,200 bytes on one link (both ends): "
                 "small messages pass, large ones vanish",
    "lossy_link": "iptables drops 3 % of the packets between two nodes at random, where they "
                  "arrive, both ways (a bad cable or optic: TCP sends again, nothing errors)",
    "lossy_one_way": "the same, only the first end's packets to the other (a fault in one "
                     "direction)",
    "flapping_link": "iptables drops every packet between two nodes, where they arrive, for 1 s, "
                     "then none for 1 s, over and over (a flapping port)",
    "slow_rail": "tc tbf: 200 mbit on the node's rail 1 (eth1, local rank 1's under the "
                 "worker's rails: [eth0, eth1]), both directions",
    "dead_rail": "iptables DROP of everything in and out of the node's rail 1 (eth1): a dead "
                 "NIC or cable",
    "store_killed": "SIGKILL to the process that holds the coordination store",
    "disk_full": "the report folder is a tmpfs filled to the last byte",
    "read_only": "the report folder is a tmpfs remounted read-only",
    "dup_hostname": "two machines (nodes) with the same hostname",
    "sdc": "silent data corruption: the rank's seeded product is off by one unit in the last "
           "place in one element (the injector's sdc: no CPU corrupts on demand)",
    "missing_interface": "the node's interface is named ens7, not the eth0 the launcher names "
                         "(GLOO_SOCKET_IFNAME): its address and routes unchanged",
    "gpu_xid79": "the node's GPUs are a recorded node's (DDP_SMOKE_HEALTH_REPLAY on that node "
                 "only: tests/data/health/xid79_kernel_log.json): its kernel log says XID 79, "
                 "a GPU fallen off the bus",
    "gpu_off_bus": "the same with h200_gpu_off_bus.json: GPU 1 of 8 H200s stops answering on "
                   "PCIe during the run (XID 79, then 154)",
    "gpu_remap_pending": "the same with remap_pending.json: a GPU with a row remap pending "
                         "(uncorrectable ECC errors; a reset is due)",
    "gpu_nvlink_down": "the same with v100_nvlink_inactive.json: 2 of a V100's 6 NVLinks down",
    "gpu_faults_per_gpu": "the same with h200_faults_per_gpu.json: 7 of 8 H200s each with its "
                          "own fault (remaps, ECC, an NVLink, HW slowdown, PCIe width, MIG)",
    "hca_port_down": "the node's HCAs are a recorded node's (hca_ports.json: two RoCE ports "
                     "ACTIVE, an InfiniBand port DOWN/Disabled), on a cluster that names its "
                     "GPU-traffic ports (NCCL_IB_HCA=mlx4_0 on every node)",
    "torch_skew": "the node runs another torch install, one that says it is 2.12.0+cpu (this "
                  "machine's torch linked, its version.py its own: no second CPU wheel here), "
                  "on its PYTHONPATH",
}


@dataclasses.dataclass(frozen=True)
class Recording:
    """A recorded GPU node (tests/data/health, PROVENANCE.md), replayed on the fault's node:
    its file, the words of a finding, and the faulty GPUs where the kit can tell which local
    rank owns each (local rank i uses GPU i, by the recording's UUIDs; none: a recording
    without them, named on the node)."""
    file: str
    words: str
    gpus: tuple = ()


REPLAYED = {"gpu_xid79": Recording("xid79_kernel_log.json", "XID 79"),
            "gpu_off_bus": Recording("h200_gpu_off_bus.json", "no longer answers on PCIe", (1,)),
            "gpu_faults_per_gpu": Recording("h200_faults_per_gpu.json", "row remap pending",
                                            (0, 1, 2, 3, 5, 6, 7)),
            "gpu_remap_pending": Recording("remap_pending.json", "row remap pending"),
            "gpu_nvlink_down": Recording("v100_nvlink_inactive.json", "NVLink link(s) 3, 5 down"),
            "hca_port_down": Recording("hca_ports.json", "state '1: DOWN'")}
# The cluster's own setting beside a replayed node, on every node (the GPU-traffic ports a
# down port must be one of to fail: unnamed, it may be an uncabled one, and only warns)
SITE_ENV = {"hca_port_down": {"NCCL_IB_HCA": "=mlx4_0"}}

SIGNALS = ("sigkill", "sigsegv", "sigabrt", "sigterm", "sigstop")
INSTANT = SIGNALS + ("oom", "store_killed")  # struck from outside at one moment
INJECTED = ("exit", "hang", "stall", "sdc")  # by nature in-process: the worker's own --fault
# A link bad some of the time.
LOSSY = ("lossy_link", "lossy_one_way", "flapping_link")
# One local rank's interface on every node (the worker's rails: [eth0, eth1]).
RAILS = ("slow_rail", "dead_rail")
NETWORK = ("slow_link", "slow_node", "dead_link", "dead_node", "blackhole", "dup_hostname",
           "missing_interface") + LOSSY + RAILS
FOLDER = ("disk_full", "read_only")
SLOW = ("slow_rank", "slow_link", "slow_node")
# Checks that last milliseconds on CPU whatever the configuration: an outside strike cannot be
# aimed into them (it lands before or after).
QUICK = ("environment", "ddp_step", "transport")
# Checks that issue world collectives (a stall has somewhere to stall). Not transport: on
# gloo (every cell here runs on CPUs) it reads no NCCL log and issues nothing.
COLLECTIVE = ("ddp_step", "collectives", "storage", "bandwidth")
# Checks that move messages well above one frame between nodes.
LARGE = ("collectives", "bandwidth")
CHECKS = STAGES[1:]
TIMEOUT_S = 15.0  # the worker's --timeout in every cell: a hang ends within it
STRIKE_WAIT_S = 120.0  # launch to the cell's stage, at most (Slurm and pods start slowly)


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str
    position: str
    stage: str
    launcher: str
    shape: str

    @property
    def id(self) -> str:
        return ".".join(dataclasses.astuple(self))

    @classmethod
    def parse(cls, text: str) -> "Cell":
        parts = text.split(".")
        if len(parts) != 5:
            raise ValueError(f"{text!r}: expected KIND.POSITION.STAGE.LAUNCHER.SHAPE")
        cell = cls(*parts)
        for (name, values), value in zip(DIMENSIONS.items(), parts):
            if value not in values:
                raise ValueError(f"{text!r}: {name} {value!r}; expected one of {values}")
        return cell

    @property
    def nodes(self) -> int:
        return int(self.shape.split("x")[0])

    @property
    def per_node(self) -> int:
        return int(self.shape.split("x")[1])

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def rank(self) -> int:
        """The rank the fault lands on (for node and link kinds: the first end's leader)."""
        if self.position == "rank0":
            return 0
        if self.position == "middle":
            return self.world // 2
        if self.position == "last":
            return self.world - 1
        return self.per_node - 1  # store_node: the highest rank on node 1, the store's node

    @property
    def node(self) -> int:
        """The node (0-based) the fault lands on."""
        return self.rank // self.per_node

    @property
    def peer_node(self) -> int:
        """The other end of a link fault: the next node, or the one before the last."""
        return self.node + 1 if self.node + 1 < self.nodes else self.node - 1


def impossible(c: Cell) -> str | None:
    """Why the cell cannot exist, or None."""
    if c.launcher in NODE_TIER and (why := _node_check_impossible(c)):
        return why
    if c.launcher == "smoke_local" and c.nodes > 1:
        return "make smoke-local runs on one machine"
    if c.kind in NETWORK and c.nodes == 1:
        return "one machine: its ranks talk over loopback, no network and one hostname"
    if c.kind in RAILS and c.per_node != 2:
        return ("a rail is one local rank's interface on every node: two ranks a node (the "
                "campaign's rails: [eth0, eth1])")
    if c.kind in RAILS and c.launcher != "torchrun":
        return ("the campaign gives a second interface (rail 1) to its plain-torchrun hosts "
                "only (tests/worker/test_diagnosis_rails.py runs rails there too)")
    if c.kind == "dead_rail" and c.stage != "join":
        return ("a rail dead from the start is found before the process group (the rails' "
                "probe); a link going down mid-run is dead_link's")
    if c.kind in INSTANT and c.stage in QUICK:
        return ("the check lasts milliseconds on CPU: a fault struck from outside cannot be "
                "aimed into it (the injected kinds land there)")
    if c.kind in INJECTED and c.stage == "join":
        return "the injector acts at a check, not in the join"
    if c.kind == "stall" and c.stage not in COLLECTIVE:
        return "the check issues no collective to stall in"
    if c.kind == "sdc" and c.stage != "health":
        return ("the seeded product compared bit for bit is the health check's (and the "
                "training check's first step, which the campaign's quick level does not run)")
    if c.kind == "dup_hostname" and c.stage != "join":
        return "a hostname is set before the run starts"
    if c.kind == "torch_skew" and c.stage != "join":
        return "an install is in place before the run starts"
    if c.kind == "torch_skew" and c.nodes == 1:
        return "one node, one torch install"
    if c.kind == "torch_skew" and c.launcher in (*PODS, *NODE_TIER):
        return ("a pod runs its image's torch (this machine's install is another Python's); "
                "node-check compares the ranks of one node, one install")
    if c.kind == "missing_interface" and c.stage != "join":
        return "an interface is named, and looked up, before the run starts"
    if c.kind in REPLAYED and c.stage != "health":
        return "a recorded node's GPUs are read by the health check alone"
    if c.kind == "hca_port_down" and c.nodes == 1:
        return "one node uses no fabric: the health check judges HCAs across nodes only"
    if c.kind == "store_killed" and c.position != "store_node":
        return "the store lives on one node: the store's"
    if c.kind in FOLDER and c.position != "rank0":
        return "the report folder is the writer's (rank 0's)"
    if c.stage == "health" and (c.kind == "flapping_link" or (
            c.kind == "dead_link" and 0 not in (c.node, c.peer_node))):
        return ("chance, not a cell: the last check lasts a tenth of a second on CPU, and only "
                "the beacon's bytes cross the link (or the store's, flapping: delayed, not "
                "lost); whether its first two retransmission timeouts, 0.6 s or more after the "
                "cut, fall before the check's last count is the moment's (measured: "
                "flapping_link.last.health.torchrun.3x1 passed)")
    if c.launcher == "trainjob" and c.stage == "storage":
        return ("the TrainJob has no folder every pod sees (no volume): its worker options "
                "leave the storage check out (k8s/trainer-v2)")
    if c.kind == "dup_hostname" and c.launcher in K8S_JOBS:
        return "the controller names every pod, and the pod's hostname is its name: unique"
    if c.kind == "read_only" and c.launcher in PODS and c.stage != "join":
        return ("a running pod keeps its own mount of the folder: a read-only bind made over it "
                "on the host later never reaches it (the tmpfs itself cannot be remounted "
                "read-only while a rank writes there)")
    return None


def _node_check_impossible(c: Cell) -> str | None:
    """Why a node-check cell cannot exist: each node checks itself alone, one run of a few
    checks, no rendezvous, no traffic between nodes."""
    if c.stage not in NODE_CHECK_STAGES:
        return "node-check runs the environment, collectives, bandwidth and health checks alone"
    if c.kind == "dup_hostname":
        return ("each node-check is one node alone, named by Slurm's NodeName: a hostname "
                "another node shares is no finding any one node can make (an acceptance run's "
                "rendezvous makes it)")
    if c.kind in NETWORK and c.kind != "missing_interface":
        return ("node-check's ranks are one node's, over its loopback: no traffic between "
                "nodes to cut, slow or lose")
    if c.kind in INSTANT or c.kind == "slow_rank":
        return ("node-check's checks last about a second each on CPU ranks, its join "
                "milliseconds: a fault struck from outside (the campaign polls the node's store "
                "from another namespace) lands inside one by chance, not aim (measured: 3 of 8 "
                "struck cells missed their stage); the node tier's claims are its readings of "
                "a fault in place before it runs")
    if c.kind in INJECTED:
        return ("node-check refuses --fault among its worker options (it sets them): a health "
                "probe injects no practice faults")
    if c.kind == "hca_port_down":
        return "each node-check is one node alone: the health check judges HCAs across nodes only"
    if c.kind in FOLDER and c.stage != "join":
        return ("node-check's report folder is its run's, made new under the node's report "
                "root at each check's start: a root filled or made read-only meets the next "
                "check at its start (the join)")
    return None


def all_cells() -> list[Cell]:
    return [Cell(*v) for v in itertools.product(*DIMENSIONS.values())]


def _pairs(c: Cell) -> list[tuple]:
    v = dataclasses.astuple(c)
    return [(i, v[i], j, v[j]) for i, j in itertools.combinations(range(5), 2)]


@dataclasses.dataclass
class Cover:
    cells: list          # the covering set, in run order
    impossible_pairs: dict  # (dim, value, dim, value) -> why no possible cell holds it
    pairs: int           # pairs covered


def cells_in(table: str) -> list[Cell]:
    """The possible cells a campaign table (docs/campaign.md) lists, in its order."""
    out = []
    for cols in _rows(table):
        try:
            c = Cell.parse(cols[0])
        except (ValueError, TypeError):
            continue  # the header, or a cell of a dimension value no longer there
        if impossible(c) is None:
            out.append(c)
    return out


def cover(seed: int = 0, kept: list[Cell] = ()) -> Cover:
    """The pairwise covering set: ``kept`` in it (the cells a table already ran: a new kind
    or value adds cells, the measured ones stay), then greedy, most newly covered pairs per
    expected second."""
    why_not = {c: impossible(c) for c in all_cells()}
    possible = [c for c, why in why_not.items() if why is None]
    wanted = {p for c in possible for p in _pairs(c)}
    names = list(DIMENSIONS)
    reasons: dict[tuple, list] = {}  # a pair no possible cell holds -> its cells' reasons
    for c, why in why_not.items():
        for p in _pairs(c):
            if p not in wanted:
                reasons.setdefault(p, []).append(set(why.split("; ")))
    # what every cell holding the pair shares, else what most of them do (the other values'
    # own reasons, a launcher's or a shape's, are theirs, not the pair's)
    why = {(names[i], a, names[j], b): "; ".join(sorted(set.intersection(*rs) or {
        collections.Counter(r for rr in rs for r in rr).most_common(1)[0][0]}))
           for (i, a, j, b), rs in sorted(reasons.items())}
    rng = random.Random(seed)
    rng.shuffle(possible)
    chosen = [c for c in dict.fromkeys(kept) if why_not.get(c, "unknown") is None]
    left = wanted - {p for c in chosen for p in _pairs(c)}
    pairs_of = [_pairs(c) for c in possible]
    cost = [cost_s(c) for c in possible]
    # lazy greedy: a cell's gain only falls as pairs get covered, so a stale score is a bound
    heap = [(-len(p) / t, i) for i, (p, t) in enumerate(zip(pairs_of, cost))]
    heapq.heapify(heap)
    while left and heap:
        _, i = heapq.heappop(heap)
        score = sum(p in left for p in pairs_of[i]) / cost[i]
        if heap and score < -heap[0][0]:
            heapq.heappush(heap, (-score, i))
            continue
        if score > 0:
            chosen.append(possible[i])
            left -= set(pairs_of[i])
    order = {name: i for i, name in enumerate(LAUNCHERS)}
    chosen.sort(key=lambda c: (order[c.launcher], c.shape, c.kind, c.stage, c.position))
    return Cover(chosen, why, len(wanted))


# Each launcher's start on a loaded 2-core machine, to its first rank (seconds)
# (node_check: slurmctld's first ask, within its health interval)
START_S = {"torchrun": 10, "smoke_local": 10, "slurm": 18, "image": 16, "submit": 18,
           "pytorchjob": 18, "indexed_job": 18, "trainjob": 18, "node_check": 12,
           "daemonset": 16}


def cost_s(c: Cell) -> float:
    """Expected seconds of one cell on a loaded 2-core machine (start-up, the checks up to
    the stage, the fault's own bound, the launcher's ending)."""
    t = START_S[c.launcher] + 4 * c.world + (6 if c.nodes > 1 else 0)
    t += 1.5 * STAGES.index(c.stage)
    if c.kind in ("hang", "stall", "dead_link", "dead_node", "blackhole") or (
            c.kind == "sigstop" and c.stage in COLLECTIVE):
        t += TIMEOUT_S
    if c.kind == "sigstop" and c.launcher in ("torchrun", "smoke_local", *PODS):
        t += 30  # torchrun gives a stopped worker 30 s after SIGTERM before SIGKILL
    if c.kind in SLOW:
        t += 10
    if c.kind in LOSSY or c.kind in RAILS:
        t += 5
    return t


def commit_seed() -> str:
    """CI's seed: ``CAMPAIGN_SEED``, else this checkout's commit (``git rev-parse HEAD``)."""
    import os
    import subprocess
    if os.environ.get("CAMPAIGN_SEED"):
        return os.environ["CAMPAIGN_SEED"]
    here = os.path.dirname(os.path.abspath(__file__))
    got = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
    return got.stdout.strip() or "0"


def _rows(table: str):
    """A campaign table's rows, each as its columns (the cell's id first)."""
    for line in table.splitlines():
        cols = line.split("|")[1:-1]
        if line.startswith("| ") and len(cols) > 2:
            yield [c.strip() for c in cols]


def right_in(table: str) -> set[str]:
    """The cells a campaign table (docs/campaign.md) shows right in their latest row."""
    return {cols[0] for cols in _rows(table) if cols[-1] == "right"}


def measured_in(table: str) -> dict[str, float]:
    """Each cell's measured seconds in a campaign table (its latest row's "cell (s)")."""
    out = {}
    for cols in _rows(table):
        try:
            out[cols[0]] = float(cols[-2])
        except ValueError:
            continue
    return out


def sample(cells: list[Cell], seed: str, budget_s: float, cost=cost_s) -> list[Cell]:
    """CI's sample: cells drawn in an order seeded by ``seed`` (the commit), taken while
    their time (``cost(cell)``: by default the model's :func:`cost_s`) fits ``budget_s``."""
    rng = random.Random(seed)
    order = list(cells)
    rng.shuffle(order)
    out, used = [], 0.0
    for c in order:
        if used + cost(c) <= budget_s:
            out.append(c)
            used += cost(c)
    return out


def select(cells: list[Cell], spec: str) -> list[Cell]:
    """A named slice: ``kind=sigkill,launcher=torchrun`` (values joined by ``+`` for several:
    ``shape=3x1+4x1``). ValueError for an unknown dimension or value."""
    want = {}
    for part in filter(None, spec.split(",")):
        name, _, values = part.partition("=")
        if name not in DIMENSIONS:
            raise ValueError(f"{part!r}: dimension {name!r}; expected one of {list(DIMENSIONS)}")
        vals = set(values.split("+"))
        bad = vals - set(DIMENSIONS[name])
        if bad:
            raise ValueError(f"{part!r}: {sorted(bad)} not among {DIMENSIONS[name]}")
        want[name] = vals
    return [c for c in cells if all(getattr(c, k) in v for k, v in want.items())]


# -- the expected outcome ------------------------------------------------------------------------

PASS, FAIL, BAD_INPUT, LOST, NONE = "pass", "fail", "bad_input", "lost", "none"
REPORT_BOUND_S = TIMEOUT_S + 20  # fault to report (or to the last rank's word), at most
END_BOUND_S = 120.0  # fault to the launcher's own end, at most (torchrun's 30 s grace included)


def report_bound_s(c: Cell) -> float:
    """A cell's bound from its fault to the report: REPORT_BOUND_S, and for a fault there
    before the launch (stage ``join``) its launcher's start too (measured: a Slurm cell's
    cloned host names reported after 36.3 s under a loaded suite, its ranks up after ~18)."""
    if c.stage != "join":
        return REPORT_BOUND_S
    # a link or node slowed from the start slows every check after it: the report comes at the
    # run's end (CI's load: lossy_link.last.join.torchrun.2x2 reported 46.9 s after its start,
    # 22 s in the table)
    slowed = c.kind in SLOW + LOSSY + RAILS
    return REPORT_BOUND_S + START_S[c.launcher] + (TIMEOUT_S if slowed else 0)


@dataclasses.dataclass(frozen=True)
class Expect:
    """A cell's right outcome.

    Attributes:
        verdict: ``pass``, ``fail``, ``bad_input`` (one line, no report), ``lost`` (the
            store is gone: no report, every rank's own word in ``lost/``) or ``none`` (no rank
            ever started: no report, the launcher's own error says why).
        culprits: the exact set: ``("rank", r)``, ``("link", a, b)`` (a < b), ``("job",)``.
        words: each must appear in the culprits' reasons (bad input, lost: in the output).
        writers: who may have written the report (its ``written_by``; ``stderr`` when the
            folder took no report and it went to stderr as one JSON line).
        why: why this is right, where it is not obvious.
    """

    verdict: str
    culprits: frozenset = frozenset()
    words: tuple = ()
    writers: frozenset = frozenset({"rank 0"})
    why: str = ""
    lost: int = 0  # lost: how many ranks left their word in lost/ (every one still alive)
    ends: bool = True  # the launcher ends by itself within END_BOUND_S

    def exits(self, launcher: str) -> set:
        """The launcher's exit statuses for this verdict (``make`` reports the kit's status
        as ``Error N``; plain torchrun turns every worker failure into 1)."""
        if "stderr" in self.writers:
            return {1}  # the report was lost: the ranks say fail whatever it held
        if self.verdict == PASS:
            return {0}
        if self.verdict == BAD_INPUT:
            return {1} if launcher == "torchrun" else {2}
        if self.verdict == LOST:
            return {1, -9, 137}  # the ranks' own 1, or the store's process killed under us
        return {1}


def _store_node_survives(c: Cell) -> bool:
    """Whether the coordination store outlives rank 0's death: every launcher but plain
    torchrun across nodes hosts it apart from the ranks (on one node torchrun's agent holds
    it and outlives its workers; across nodes node 1's agent leaves with its only worker, and
    with several it first stops the others, which it gives up to 30 s: rank 1 takes over)."""
    return not (c.launcher == "torchrun" and c.nodes > 1 and c.per_node == 1)


TOOK_OVER = "rank 1 (took over from rank 0)"


def _writer_after(c: Cell, gone: int) -> frozenset:
    if gone != 0:
        return frozenset({"rank 0"})
    if c.nodes > 1 and c.launcher in (*PODS, "slurm"):
        # node 2's agent may stop rank 1 first: its rendezvous store was node 1's agent
        return frozenset({TOOK_OVER, "store host"})
    return frozenset({TOOK_OVER})


_AGENTS = ("torchrun", "slurm", *PODS)  # torchrun's agents, on node 1's rendezvous store
_AGENT_WAIT = ("torchrun's agents then wait for their rendezvous store across the cut, within "
               "torchrun's own timeouts (read 30 s, exit barrier 300 s): theirs, not the kit's")


def _agents_wait(c: Cell) -> bool:
    """A cut that torchrun's agents' own traffic crosses: their end is theirs."""
    return c.launcher in _AGENTS and (c.kind == "dead_node" or 0 in (c.node, c.peer_node))


def _before_rendezvous(c: Cell) -> bool:
    """A cut between a node and node 0, where plain torchrun's agents meet (its rendezvous
    store) before any rank starts."""
    return c.launcher == "torchrun" and (c.kind == "dead_node" or 0 in (c.node, c.peer_node))


def _link(c: Cell) -> tuple:
    a, b = sorted((c.node * c.per_node, c.peer_node * c.per_node))
    return ("link", a, b)


def _slow_rank(c: Cell, me: frozenset) -> Expect:
    """Checks up to compute measure the rank's pace; the health check after them names the
    rank's node too when the rank is its node's local rank 0, which reads the CPU quota on
    its own cgroups (checks/health/cpu.py); a run aborted at a deadline the slow rank
    outlasted names the node from the same reading, in the abort's forensics."""
    if STAGES.index(c.stage) > STAGES.index("compute"):
        return Expect(PASS, why="no check after it measures a rank's pace, and the quota "
                                "lands with the health check's own reading")
    if c.rank % c.per_node:
        return Expect(FAIL, me, why="the health check reads its node's local rank 0's cgroups")
    return Expect(FAIL, me | {("host", c.rank // c.per_node)}, ("CPU quota",),
                  why="the health check's CPU quota finding names the slow rank's node")


def _lossy(c: Cell) -> Expect:
    """A lossy link, in place from the stage to the run's end: the bandwidth check's round
    trips and every check's TCP retransmissions name it (docs/diagnosis.md)."""
    if c.kind == "flapping_link":  # by its timeouts, or by the probes of a run it stopped
        return Expect(FAIL, frozenset({_link(c)}))
    if STAGES.index(c.stage) <= STAGES.index("bandwidth"):
        return Expect(FAIL, frozenset({_link(c)}))
    return Expect(PASS, why="after the bandwidth check little crosses the link: a few lost "
                            "segments stay below every threshold")


def _rail(c: Cell) -> Expect:
    """Rail 1 of one node, slow or dead, on two nodes: one pair per rail, so its two ends
    cannot be told apart (docs/rails.md): the link between local ranks 1, named on the rail;
    the run goes on without a dead rail (its ranks send on the default interface)."""
    ends = ("link", *sorted(n * c.per_node + 1 for n in (c.node, c.peer_node)))  # local 1s
    if c.kind == "dead_rail":
        return Expect(FAIL, frozenset({ends}), ("carries no connection",))
    if STAGES.index(c.stage) > STAGES.index("bandwidth"):
        return Expect(PASS, why="no check after it measures a link")
    return Expect(FAIL, frozenset({ends}), ("below the reference",))


def _black_hole_to_the_host(c: Cell) -> Expect:
    """Large packets dropped between a node and node 0 from the start. A node's hello to the
    rendezvous host (a pod's) passes, the 64 KiB after it do not: both
    ends' preflight name the node before torchrun starts (without it torchrun's rendezvous
    waited out its join timeout once two nodes had joined: its state no longer fit the path).
    Under Slurm, srun's own launch of the node's task crosses the link first."""
    cut = c.node or c.peer_node
    if c.launcher == "image":  # bare pods: each writes its own report of its preflight
        return Expect(FAIL, frozenset({("host", cut)}), ("drops large packets",),
                      frozenset({"docker launcher"}), ends=False, why=(
                          "the node's preflight and the rendezvous host's (by the node's "
                          "name) fail naming it before torchrun starts; the other pods wait "
                          "in torchrun's rendezvous for the host that never starts it: "
                          "theirs, not the kit's"))
    if c.launcher in ("slurm", "submit"):
        return Expect(FAIL, frozenset({("host", cut)}), ("task launch failed",),
                      frozenset({f"{'submitit' if c.launcher == 'submit' else 'slurm'} "
                                 "launcher"}), why=(
                          "srun's launch of the node's task carries more than the black hole "
                          "passes: Slurm names the node before any preflight (submit: its "
                          "tasks' stderr holds srun's word; before, it waited forever for the "
                          "unlaunched task's result file, Slurm here keeping no accounting)"))
    return Expect(NONE, words=("drops large packets", f"node rank {cut} "), writers=frozenset(),
                  ends=False, why=(
                      "the rendezvous host's preflight names the node in its log and "
                      "termination message before any rank starts (a job's pods gather no "
                      "report); the other pods wait in torchrun's rendezvous for the host that "
                      "never starts it: theirs, not the kit's"))


def _node_check(c: Cell) -> Expect:
    """The cluster's word after each node of the cell checked itself once with
    ``--act slurm-drain`` (the DaemonSet's ``--act k8s-label``): the fault's node drained with
    node-check's reason, its first finding (labelled fail with it as an annotation), the other
    nodes left up (labelled pass); a pass drains none. One node of four failing stays
    under the circuit breaker's share (fleet.drain_max_share, 0.5): the breaker's refusal
    needs most of the cluster failing, which no position of one fault makes."""
    node = frozenset({("host", c.node)})
    by = frozenset({"node-check"})
    k = c.kind
    if k in FOLDER:
        said = "No space left" if k == "disk_full" else "Read-only"
        return Expect(FAIL, node, (said,), by, why=(
            "node-check's preflight checks the report folder on the node's own disk: a node "
            "that cannot write there is drained"))
    if k in REPLAYED:
        first = {"gpu_off_bus": "does not answer"}.get(k, REPLAYED[k].words)
        return Expect(FAIL, node, (first,), by, why=(
            "the node's health check reads the recorded GPUs: a node's own fault, wherever "
            "on it the kit names it; the drain reason is its first finding (+N more): the "
            "off-bus GPU's NVML silence comes before its PCIe evidence"))
    if k == "missing_interface":
        return Expect(FAIL, node, ("no interface eth0",), by, why=(
            "node-check's preflight names the interface before any rank starts"))
    raise ValueError(f"no expectation for {c.id}")


def expect(c: Cell) -> Expect:
    """The right outcome of a possible cell."""
    r, k, s = c.rank, c.kind, c.stage
    if c.launcher in NODE_TIER:
        return _node_check(c)
    me = frozenset({("rank", r)})
    if k in ("sigkill", "sigsegv", "sigabrt", "oom", "exit"):
        if r == 0 and not _store_node_survives(c):
            return Expect(LOST, writers=frozenset(), lost=c.world - 1,
                          why="plain torchrun across nodes: node 1's agent holds the store "
                              "and leaves with its only worker")
        local = c.per_node > 1  # a live rank on the dead rank's node reads that node's word
        in_pod = k == "oom" and c.launcher in PODS
        words = {"sigkill": ("SIGKILL",) if c.launcher == "smoke_local" else ("died",),
                 "sigsegv": ("SIGSEGV",), "sigabrt": ("SIGABRT",),
                 "oom": ("OOM killer",) if local and not in_pod else ("died",),
                 "exit": ("status 13",) if c.launcher == "smoke_local" else ("died",)}[k]
        return Expect(FAIL, me, words, _writer_after(c, r), why=(
            "in a pod, the node's word cannot say OOM: the memory cgroup the kill came from is "
            "the campaign's, outside the pod's cgroup namespace, and a container reads no "
            "kernel log" if in_pod else ""))
    if k == "sigterm":
        return Expect(FAIL, me, ("terminated by SIGTERM",))
    if k == "sigstop":
        if r == 0 and not _store_node_survives(c):
            return Expect(FAIL, me, ("no heartbeat",), frozenset({TOOK_OVER}), why=(
                "node 1's agent sees its worker alive: the store stays"))
        return Expect(FAIL, me, ("stopped",) if c.per_node > 1 else ("no heartbeat",),
                      _writer_after(c, r))
    if k == "hang":
        return Expect(FAIL, me, (f"did not arrive at {s}",))
    if k == "stall":
        return Expect(FAIL, me, ("never issued",))
    if k == "sdc":
        if c.world == 2:
            return Expect(FAIL, frozenset({("rank", 0), ("rank", 1)}), ("no majority",),
                          why="two ranks disagree and neither is the majority: both suspect")
        return Expect(FAIL, me, ("silent data corruption", "drain and RMA"))
    if k == "slow_rank":
        return _slow_rank(c, me)
    if k in ("slow_link", "slow_node"):
        if STAGES.index(s) > STAGES.index("bandwidth"):
            return Expect(PASS, why="no check after it measures a link")
        if c.nodes == 2:
            return Expect(PASS, why=(
                "two nodes make one pair, the reference of itself: slow against nothing (a "
                "profile's busbw floor, --profile, names it; the campaign runs none)"))
        if k == "slow_link":
            return Expect(FAIL, frozenset({_link(c)}), ("below the reference",))
        return Expect(FAIL, frozenset({("rank", c.node * c.per_node)}),
                      ("slow with every partner",))
    if k in ("dead_link", "dead_node") and s == "join" and c.launcher in K8S_JOBS and (
            k == "dead_node" or 0 in (c.node, c.peer_node)):
        unheard = [c.node] if c.node else list(range(1, c.nodes))
        if k == "dead_link":
            unheard = [c.node or c.peer_node]
        return Expect(NONE, words=(f"node rank(s) {', '.join(map(str, unheard))} never "
                                   "joined",), writers=frozenset(), ends=False, why=(
            "the rendezvous host's preflight never hears the cut node's hello and names it, in "
            "its log and termination message, before any rank starts; the pods that said "
            "hello wait in torchrun's rendezvous for the host that never starts it, within "
            "torchrun's own join timeout: theirs, not the kit's"))
    if k in ("dead_link", "dead_node") and s == "join" and _before_rendezvous(c):
        return Expect(NONE, words=("The connection to the C10d store has failed",),
                      writers=frozenset(), why=(
                          "plain torchrun: a node cut from the rendezvous host before the start "
                          "never starts a rank, so no part of the kit runs to report; torchrun's "
                          "own error on that node says so (Slurm's and the image's launchers "
                          "name the node in their report)"))
    if k == "blackhole" and s == "join" and c.launcher in (*PODS, "slurm", "submit") and 0 in (
            c.node, c.peer_node):
        return _black_hole_to_the_host(c)
    if k in ("blackhole", "dead_link", "dead_node"):
        ends, why = not _agents_wait(c), _AGENT_WAIT if _agents_wait(c) else ""
        # The store lives on node 0: its link carries every rank's records there, and a
        # check's observation (its figures) is larger than the 1,200 bytes a black hole passes.
        carries_store = 0 in (c.node, c.peer_node)
        if k == "blackhole" and STAGES.index(s) > max(STAGES.index(x) for x in LARGE):
            if not carries_store:
                return Expect(PASS, ends=ends, why=(
                    "no check after it sends large messages over that link; " + why))
            why = ("after the last large check, a rank's observation to the store on node 0 "
                   "still crosses it and never arrives: the link stops the run; " + why)
        if k == "blackhole":
            return Expect(FAIL, frozenset({_link(c)}), ("drops large ones",), ends=ends, why=why)
        if k == "dead_node":
            return Expect(FAIL, frozenset({("rank", c.node * c.per_node)}), ("cut off",),
                          ends=ends, why=why)
        if STAGES.index(s) > max(STAGES.index(x) for x in COLLECTIVE) and not carries_store:
            return Expect(FAIL, frozenset({_link(c)}), ("retransmission timeout",), ends=ends,
                          why="no check after it sends over the link: the beacon's bytes "
                              "time out; " + why)
        return Expect(FAIL, frozenset({_link(c)}), ("does not carry",), ends=ends, why=why)
    if k in LOSSY:
        return _lossy(c)
    if k in RAILS:
        return _rail(c)
    if k == "store_killed":
        return Expect(LOST, writers=frozenset(), lost=c.world)
    if k in FOLDER:
        said = "No space left" if k == "disk_full" else "Read-only"
        if s == "join":
            return Expect(BAD_INPUT, words=(said,), writers=frozenset())
        if k == "disk_full":  # the room the writer kept for the report takes it
            if STAGES.index(s) <= STAGES.index("storage") and c.launcher != "trainjob":
                return Expect(FAIL, frozenset({("job",)}), (said,), why=(
                    "every rank's storage writes fail alike: the folder, not a rank; the report "
                    "goes into the room rank 0 kept for it at its start"))
            return Expect(PASS, why=(
                "every check passed (the TrainJob runs no storage check); the report goes "
                "into the room rank 0 kept for it at its start (before, it went to stderr, "
                "where the Slurm template's ranks write into the full folder too: cut)"))
        if STAGES.index(s) <= STAGES.index("storage"):
            return Expect(FAIL, frozenset({("job",)}), (said,), frozenset({"stderr"}), why=(
                "every rank's storage writes fail alike: the folder, not a rank"))
        return Expect(PASS, words=(said,), writers=frozenset({"stderr"}), why=(
            "every check passed; the report goes to stderr as one JSON line, exit 1"))
    if k in REPLAYED:
        rec = REPLAYED[k]
        owned = {("rank", c.node * c.per_node + g) for g in rec.gpus if g < c.per_node}
        unowned = not rec.gpus or any(g >= c.per_node for g in rec.gpus)
        return Expect(FAIL, frozenset(owned | ({("host", c.node)} if unowned else set())),
                      (rec.words,), why=(
                          "the health check reads the recorded node on that node: a faulty GPU "
                          "is named on the local rank that owns it (local rank i uses GPU i), "
                          "on the node where no rank there does (a recording without UUIDs, "
                          "or fewer ranks than GPUs)"))
    if k == "missing_interface":
        if c.launcher == "torchrun":
            return Expect(FAIL, frozenset({("rank", c.node * c.per_node + i)
                                           for i in range(c.per_node)}),
                          ("Unable to find address for: eth0",), why=(
                "plain torchrun runs no preflight: the node's ranks fail to create the process "
                "group on an interface that is not there, and say so"))
        if c.launcher == "submit":  # a task per rank: the node's tasks are named
            return Expect(FAIL, frozenset({("rank", c.node * c.per_node + i)
                                           for i in range(c.per_node)}), ("no interface eth0",),
                          frozenset({"submitit launcher"}), why=(
                              "each task's preflight, before its rank starts"))
        if c.launcher in K8S_JOBS:
            return Expect(NONE, words=("no interface eth0",) + (
                (f"node rank {c.node} ",) if c.node else ()), writers=frozenset(), ends=False,
                why=("the pod's preflight names its node in its log and termination message, "
                     "and says so in its hello: the rendezvous host's preflight fails at once "
                     "naming it, before any rank starts (a job's pods gather no report); the "
                     "other pods wait in torchrun's rendezvous for the host that never starts "
                     "it, within torchrun's own join timeout: theirs, not the kit's"))
        if c.launcher in PODS:  # pods started alone, as Kubernetes starts them
            return Expect(FAIL, frozenset({("host", c.node)}), ("no interface eth0",),
                          frozenset({"docker launcher"}), ends=False, why=(
                              "the pod's preflight names its node before torchrun starts; the "
                              "other pods' agents then wait for it at the rendezvous (or fail to "
                              "reach the rendezvous it hosted), within torchrun's own timeouts: "
                              "theirs, not the kit's"))
        return Expect(FAIL, frozenset({("host", c.node)}), ("no interface eth0",),
                      frozenset({"slurm launcher"}), why=(
                          "the template's preflight step on every node names the node before "
                          "any rank starts"))
    if k == "torch_skew":
        if c.nodes == 2:
            return Expect(FAIL, frozenset({("job",)}), ("no majority",), why=(
                "two nodes, two installs: which one is odd is nobody's to say (the "
                "environment check names the job, each version's ranks in its reason)"))
        return Expect(FAIL, frozenset({("rank", c.node * c.per_node + i)
                                       for i in range(c.per_node)}), ("torch 2.12.0",), why=(
            "the environment check compares every rank's versions: the node's ranks are the "
            "minority"))
    if k == "dup_hostname":
        return Expect(FAIL, frozenset({("rank", c.node * c.per_node),
                                       ("rank", c.peer_node * c.per_node)}),
                      ("same hostname",))
    raise ValueError(f"no expectation for {c.id}")
