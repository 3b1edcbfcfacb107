"""The training check's judge on made-up observations: who is named, and for what (pure)."""
from __future__ import annotations

import copy

from ddp_smoke import config
from ddp_smoke.checks import training
from ddp_smoke.checks.api import Evidence
from ddp_smoke.config import profiles

REFERENCE = [6.279, 12.5, 301.25]  # loss, squared gradient norm, weight sum after AdamW


def _obs(world: int = 4, change: dict | None = None) -> list[dict]:
    one = {"device_type": "cpu", "layout": "fsdp", "mesh": [world], "layout_note": "",
           "model": {"vocab": 512, "dim": 192, "layers": 4, "heads": 4, "ffn": 512,
                     "seq_len": 64, "micro_batch": 2, "params": 1967808,
                     "params_non_embedding": 1869504},
           "flops_per_token": 11806848, "tokens_per_step": 128,
           "step_s": [0.1, 0.11, 0.1, 0.12, 0.1], "compute_s": [0.02] * 5,
           "job_losses": [6.28, 6.0, 5.8, 5.5, 5.3, 5.2], "peak_memory_bytes": 3 << 27,
           "checked": {"loss": REFERENCE[0], "reference": list(REFERENCE), "grad_diff": 0.0,
                       "param_diff": 0.0},
           "threads": 1, "cores": 8, "profile": profiles.load("cpu")}
    out = [copy.deepcopy(one) for _ in range(world)]
    for r, o in enumerate(out):
        o.update((change or {}).get(r, {}))
    return out


def _judge(obs: list[dict]):
    ranks = [{"rank": r, "host": f"node{r}"} for r in range(len(obs))]
    return training.judge(Evidence("training", obs, ranks, config.resolve({}, {})))


def _named(result) -> list:
    return [k.rank for k in result.culprits]


def test_healthy_ranks_pass_with_tokens_per_second_and_no_mfu_on_cpu():
    result = _judge(_obs())
    assert result.status == "pass", result.summary
    rank = result.figures["ranks"][0]
    assert rank["tokens_per_s"] == 128 / 0.1 and rank["mfu"] is None
    assert rank["exposed_comm_s"] == 0.08 and rank["step_s_p90"] == 0.12
    assert result.figures["tokens_per_s"] == 4 * 128 / 0.1


def test_the_rank_whose_reference_is_odd_is_named_not_the_ranks_its_gradients_spoiled():
    odd = {"checked": {"loss": 6.2877, "reference": [6.2877, 12.6, 301.3], "grad_diff": 0.3,
                       "param_diff": 0.1}}
    spoiled = {"checked": {"loss": REFERENCE[0], "reference": list(REFERENCE),
                           "grad_diff": 0.3, "param_diff": 0.1}}
    result = _judge(_obs(4, {0: spoiled, 1: odd, 2: spoiled, 3: spoiled}))
    assert _named(result) == [1]
    assert "silent data corruption" in result.culprits[0].reason


def test_a_reduction_wrong_on_every_rank_names_no_rank_and_one_wrong_shard_names_its_rank():
    wrong = {"checked": {"loss": REFERENCE[0], "reference": list(REFERENCE), "grad_diff": 0.5,
                         "param_diff": 0.0}}
    every = _judge(_obs(4, {r: copy.deepcopy(wrong) for r in range(4)}))
    assert _named(every) == [None] and "not one rank" in every.culprits[0].reason
    one = _judge(_obs(4, {2: {"checked": {**wrong["checked"], "grad_diff": None}}}))
    assert _named(one) == [2]


def test_a_loss_that_does_not_fall_fails_with_no_rank_named():
    result = _judge(_obs(4, {r: {"job_losses": [6.2, 6.3]} for r in range(4)}))
    assert _named(result) == [None] and "did not fall" in result.culprits[0].reason


def test_the_rank_behind_in_every_compute_block_is_the_one_the_step_waits_for():
    result = _judge(_obs(4, {3: {"compute_s": [0.08] * 5}}))
    assert _named(result) == [3]
    assert "waits for it" in result.culprits[0].reason
    assert result.figures["ranks"][3]["pace"] == 0.25


def test_on_shared_cores_a_rank_behind_is_named_only_when_something_held_it_back():
    """Ranks that fill their host's cores: which one the scheduler gave less time is not a
    finding (a healthy rank kept 51 % of the others' pace beside a loaded suite), a rank a CPU
    quota or an injected slowdown held back for diagnosis.waits_min_total_s (0.3 s) is."""
    shared = {r: {"cores": 1} for r in range(4)}
    behind = {**shared, 3: {"cores": 1, "compute_s": [0.04] * 5, "held_s": 0.0}}
    unheld = _judge(_obs(4, behind))
    assert _named(unheld) == [] and unheld.figures["scheduler_chose"] == [3], unheld.summary
    assert unheld.figures["ranks"][3]["held_s"] == 0.0
    held = _judge(_obs(4, {**behind, 3: {**behind[3], "held_s": 2.5}}))
    assert _named(held) == [3] and held.figures["scheduler_chose"] == []
    assert "held back 2.5 s in the check" in held.culprits[0].reason
    own_cores = _judge(_obs(4, {3: {"compute_s": [0.04] * 5, "held_s": 0.0}}))
    assert _named(own_cores) == [3]  # cores of its own: behind is a finding


def test_mfu_against_the_profiles_peak_and_its_floor():
    gpu = profiles.load("h100-8gpu")
    gpu["training"]["min_mfu"] = 0.3
    fast = {"device_type": "cuda", "profile": gpu, "step_s": [0.01] * 5,
            "compute_s": [0.005] * 5}
    obs = _obs(2, {0: dict(fast), 1: {**fast, "step_s": [1.0] * 5}})
    for o in obs:
        o["profile"], o["device_type"] = gpu, "cuda"
    result = _judge(obs)
    ranks = result.figures["ranks"]
    assert ranks[0]["mfu"] == round(128 / 0.01 * 11806848 / 989e12, 6)
    assert _named(result) == [0, 1]  # this tiny model is far below 30 % of an H100 anywhere
    assert "below the profile" in result.culprits[0].reason
