"""The registry of checks: name → module, in the default order, imported lazily.

A check is one module ``ddp_smoke.checks.<name>`` whose docstring is its manual (what it
proves, the culprit it can name, when it skips) and which defines two functions:

``run(ctx) -> dict``
    Runs on every rank, collectives included, and returns this rank's observation as
    JSON-able data. ``ctx`` is a :class:`ddp_smoke.harness.Context` (rank, world size, device,
    config section, fault injector …). Exceptions are the harness's business: it records them,
    names the rank and stops the run.
``judge(ev) -> CheckResult``
    Runs on rank 0 only, with every rank's observation (:class:`ddp_smoke.harness.Evidence`),
    and decides status, summary, figures and culprits. Pure: no collectives, no I/O.

``begin(ctx)`` (optional)
    Called by the harness on every rank once the process group is up, before the first check
    runs: a check that watches the whole run (``health``: start readings, a sampler thread
    while compute and bandwidth load the GPUs) starts watching here.

A check's options live in ``defaults.yaml`` under a section named after it, so their types are
validated like every other key; an optional ``validate(section)`` raises ConfigError for bad
values, which the harness calls on every rank before connecting (exit 2, one line).
"""
import importlib

REGISTRY = {
    "environment": "ddp_smoke.checks.environment",
    "ddp_step": "ddp_smoke.checks.ddp_step",
    "sampler_epochs": "ddp_smoke.checks.sampler_epochs",
    "collectives": "ddp_smoke.checks.collectives",
    "storage": "ddp_smoke.checks.storage",
    "bandwidth": "ddp_smoke.checks.bandwidth",
    "transport": "ddp_smoke.checks.transport",
    "compute": "ddp_smoke.checks.compute",
    "health": "ddp_smoke.checks.health",
}


def load(name: str):
    """Import and return the module of check ``name``."""
    return importlib.import_module(REGISTRY[name])
