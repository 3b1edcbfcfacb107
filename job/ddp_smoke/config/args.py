"""The worker's command line: its options, parsed into the effective config.

Every entry point that takes worker options parses them here — the worker (``python -m
ddp_smoke``), the local launcher, the submitit path, each submitit task — so a mistake reads
the same everywhere: one line, exit status 2 (:class:`Parser`). The choices a flag offers are
the config's own (levels, backends, profiles, fault kinds, actions): nothing is typed twice.
No torch here.
"""
from __future__ import annotations

import argparse
import difflib
from typing import Callable

from ..errors import ConfigError
from . import levels, load_file, profiles, resolve, rules
from .faults import KINDS


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one line and exit 2, like every other
    bad input, instead of argparse's usage block. ``manual``, when given, is called for the
    description only when help is printed (building it reads files). ``after_dashes``: the
    options of the worker a command passes everything after ``--`` to (node-check): one of
    them given before ``--`` is said so."""

    def __init__(self, manual: Callable[[], str] | None = None,
                 after_dashes: Callable[[], list[str]] | None = None, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self._manual, self._after_dashes = manual, after_dashes

    def format_help(self) -> str:
        if self._manual is not None:
            self.description, self._manual = self._manual(), None
        return super().format_help()

    def error(self, message: str):
        raise ConfigError(message + did_you_mean(
            message, list(self._option_string_actions),
            self._after_dashes() if self._after_dashes else [], self.prog))


def did_you_mean(message: str, options: list[str], worker: list[str] = (),
                 prog: str = "") -> str:
    """'; did you mean --checks?' for the first unrecognized --option close to a real one;
    closer to one of ``worker`` (the options that go after ``--``): where it goes instead."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    for word in message.split(": ", 1)[1].split():
        if not word.startswith("--"):
            continue
        name = word.split("=")[0]
        mine, theirs = (difflib.get_close_matches(name, o, n=1) for o in (options, worker))
        if theirs and theirs[0] not in options and (not mine or _likeness(name, theirs[0])
                                                     > _likeness(name, mine[0])):
            return (f"; did you mean the worker's {theirs[0]}? it goes after --: "
                    f"{prog} [options] -- {theirs[0]} …")
        if mine:
            return f"; did you mean {mine[0]}?"
    return ""


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def worker_parser(manual: Callable[[], str] | None = None) -> Parser:
    """The worker's options (``python -m ddp_smoke --help``)."""
    p = Parser(manual=manual, prog="python -m ddp_smoke")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where rank 0 writes report.json and junit.xml (default reports/<run id>)")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="YAML merged over the defaults; flags win over it")
    p.add_argument("--checks", metavar="A,B,…",
                   help=f"checks to run, in order (default: all: {','.join(rules.CHECKS)})")
    p.add_argument("--timeout", metavar="SECONDS", type=float,
                   help="bound on every wait: init, arrival, work, gather (default 90)")
    p.add_argument("--level", choices=tuple(levels.LEVELS),
                   help="how much the performance checks measure: quick (make smoke-local), "
                        "standard (default), long (full sweep); every level runs every check "
                        "but training (not at quick)")
    p.add_argument("--backend", choices=rules.BACKENDS,
                   help="auto = nccl when CUDA is usable, else gloo (default auto)")
    p.add_argument("--expect-nodes", metavar="N", type=int,
                   help="fail unless the ranks span exactly N hosts")
    p.add_argument("--expect-world-size", metavar="N", type=int,
                   help="fail unless WORLD_SIZE is N")
    p.add_argument("--storage-dir", metavar="DIR",
                   help="directory every node should share (default REPORT_DIR/storage)")
    p.add_argument("--profile", metavar="NAME|FILE.yaml",
                   help=f"pass floors for bandwidth and compute: {profiles.DEFAULT} (default, "
                        f"figures only), {', '.join(n for n in profiles.names() if n != profiles.DEFAULT)}, "
                        "or a profile file")
    p.add_argument("--expect-transport", metavar="ib|socket|PLUGIN",
                   help="fail a multi-node run whose NCCL used another network (transport "
                        "check; default: the profile's, else any one network on every node)")
    p.add_argument("--rails", metavar="DEV0,DEV1,…",
                   help="the site's rails, one network device per rail: local rank i sends on "
                        "the i-th (modulo their count); gloo: the interface each rank binds; "
                        "nccl: the NIC NCCL should pick (docs/rails.md; default: one network)")
    p.add_argument("--fault", metavar="RANK:KIND@CHECK",
                   help=f"inject a fault to test alerting (practice: every output says so); "
                        f"KIND one of {', '.join(KINDS)} (slow=F: F times slower, default 4); "
                        "several separated by commas; @CHECK#I or #I-J: only in those "
                        "iterations of --repeat. What each kind does: pydoc "
                        "ddp_smoke.config.faults")
    p.add_argument("--repeat", metavar="N", type=int,
                   help="run the checks N times in one process group; a fault seen in some "
                        "iterations only is flagged intermittent (default 1)")
    p.add_argument("--duration", metavar="SECONDS", type=float,
                   help="instead of --repeat: keep starting iterations for this long")
    p.add_argument("--act", choices=rules.ACTS,
                   help="after the report, drain the bad hosts' Slurm nodes with scontrol "
                        "(default: only print the commands)")
    p.add_argument("--node-speaker", choices=rules.NODE_SPEAKER,
                   help="ranks beat, arrive and post through one rank of their node: auto "
                        "(beyond 2,500 ranks, the default), on, off")
    p.add_argument("--progress", choices=rules.PROGRESS,
                   help="rank 0's lines on stderr while the run runs: the join, each check as "
                        "it is judged, who a long wait awaits; auto (default) = plain, none")
    p.add_argument("--prometheus", metavar="FILE",
                   help="also write the verdict and key figures as a node_exporter textfile")
    return p


def parse_config(argv: list[str] | None = None, parser: Parser | None = None) -> dict:
    """Flags and ``--config`` into the effective config; ConfigError on any mistake."""
    args = (parser or worker_parser()).parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    for key in ("checks", "rails"):  # comma-separated lists
        if flags[key] is not None:
            flags[key] = [c.strip() for c in flags[key].split(",") if c.strip()]
    file_values = load_file(args.config) if args.config else {}
    return resolve(file_values, flags, source=args.config or "config")
