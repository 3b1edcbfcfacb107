"""Silent data corruption: the same seeded fp32 product on every rank, compared bit for bit.

cuBLAS gives the same bits on GPUs of one architecture and SM count with the same software
("Results reproducibility", cuBLAS documentation); a GPU that computes a different product
from its peers is corrupting data silently (Llama 3 paper §3.3.4: 6 SDC interruptions).

Rules: a rank whose ``sdc_repeats`` products differ from each other, or whose product differs
from the majority of ranks of the same device model, SM count and software, fails: drain and
RMA. No majority (a tie) names every side as one link culprit: rerun with more ranks.
No node family: it compares ranks, and ``rank_findings(observations, lim)`` returns findings
whose ``ranks`` say whose product it is (the health check's ``judge`` calls it beside the
families).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .finding import Limits


@dataclass(frozen=True)
class RankFinding:
    """An SDC finding: one rank, or (a tie) several."""

    ranks: tuple[int, ...]
    what: str


def product(ctx, cfg: dict) -> dict:
    """The seeded product on this rank's device; the digest of each repeat's result."""
    # torch only here: the readers and rules load without it (node-check's parent, history)
    import torch

    cuda = ctx.device.type == "cuda"
    n = cfg["sdc_size_gpu" if cuda else "sdc_size_cpu"]
    gen = torch.Generator(device="cpu").manual_seed(cfg["sdc_seed"])
    a = torch.randn(n, n, generator=gen).to(ctx.device)
    b = torch.randn(n, n, generator=gen).to(ctx.device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 as written: no TF32, no choice
    digests = []
    try:
        for _ in range(cfg["sdc_repeats"]):
            c = ctx.faults.perturb_product(torch.matmul(a, b))
            digests.append(hashlib.sha256(c.cpu().numpy().tobytes()).hexdigest()[:16])
    finally:
        torch.set_float32_matmul_precision(precision)
    if cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        model = f"{props.name} ({props.multi_processor_count} SMs, CUDA {torch.version.cuda})"
    else:
        model = f"{_cpu_model()} ({torch.get_num_threads()} thread(s))"
    return {"model": f"{model}, torch {torch.__version__}", "n": n, "digests": digests}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        "cpu")
    except OSError:
        return "cpu"


def rank_findings(observations: list[dict], lim: Limits | None = None) -> list[RankFinding]:
    """Ranks whose product differs from their own repeats or from their group's majority."""
    out, groups = [], {}
    for r, o in enumerate(observations):
        d = o["sdc"]["digests"]
        if len(set(d)) > 1:
            out.append(RankFinding((r,), f"silent data corruption: the same product gave "
                                   f"{len(set(d))} different results in {len(d)} repeats "
                                   f"({o['sdc']['model']}); action: drain and RMA"))
        groups.setdefault(o["sdc"]["model"], {}).setdefault(d[0], []).append(r)
    for model, by_digest in groups.items():
        if len(by_digest) < 2:
            continue
        ranked = sorted(by_digest.values(), key=len, reverse=True)
        if len(ranked[0]) == len(ranked[1]):  # no majority: every side stays suspect
            # two ranks of one machine are no link, and "more ranks" is no advice there
            out += [RankFinding((r,), f"silent data corruption: ranks "
                                f"{sorted(r for rs in ranked for r in rs)} of {model} disagree "
                                "on the seeded product and no majority tells which is wrong; "
                                "each is suspect: run the check with one of them beside a "
                                "known-good device of the same model")
                    for r in sorted(r for rs in ranked for r in rs)]
            continue
        out += [RankFinding((r,), f"silent data corruption: the seeded {model} product "
                            f"differs from {len(ranked[0])} rank(s) of the same model "
                            "(bit-exact expected); action: drain and RMA")
                for rs in ranked[1:] for r in rs]
    return out


def summary(observations: list[dict]) -> str:
    models = {o["sdc"]["model"] for o in observations}
    return (f"SDC: {len(observations)} rank(s), {len(models)} device model(s), "
            f"{observations[0]['sdc']['n']}^2 fp32 product x "
            f"{len(observations[0]['sdc']['digests'])}")
