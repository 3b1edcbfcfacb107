"""The registry of checks: name → module, in the default order, imported lazily.

A check is one module ``ddp_smoke.checks.<name>`` whose docstring is its manual (what it
proves, the culprit it can name, when it skips) and which defines two functions:

``run(ctx) -> dict``
    Runs on every rank, collectives included, and returns this rank's observation as
    JSON-able data. ``ctx`` is a :class:`ddp_smoke.checks.api.Context` (rank, world size, device,
    config section, fault injector …). Exceptions are the harness's business: it records them,
    names the rank and stops the run.
``judge(ev) -> CheckResult``
    Runs on rank 0 only, with every rank's observation (:class:`ddp_smoke.checks.api.Evidence`),
    and decides status, summary, figures and culprits. Pure: no collectives, no I/O.

``begin(ctx)`` (optional)
    Called by the harness on every rank once the process group is up, before the first check
    runs: a check that watches the whole run (``health``: start readings, a sampler thread
    while compute and bandwidth load the GPUs) starts watching here.

A check's options live in ``config/defaults.yaml`` under a section named after it, so their
types and ranges are validated like every other key (``config/rules.py``) before any rank
connects. The check names, in default order, are ``config.rules.CHECKS``.
"""
import importlib

from ..config.rules import CHECKS

REGISTRY = {name: f"{__name__}.{name}" for name in CHECKS}


def load(name: str):
    """Import and return the module of check ``name``."""
    return importlib.import_module(REGISTRY[name])


def load_all(names: list[str]) -> None:
    """Import the modules of checks ``names``: seconds (DDP pulls in torch._dynamo). A
    launcher that forks its ranks does it once, before (:mod:`ddp_smoke.launch_local`)."""
    for name in names:
        load(name)
