"""Config: defaults < file < flags, every key validated, one-line errors."""
import pytest

from ddp_smoke.checks import REGISTRY
from ddp_smoke.config.args import parse_config
from ddp_smoke.config import defaults, resolve
from ddp_smoke.errors import ConfigError
from ddp_smoke.config.faults import Fault, parse_faults


def test_defaults_are_valid_and_select_every_registered_check():
    cfg = resolve({}, {})
    assert cfg == defaults()
    assert cfg["checks"] == list(REGISTRY)
    assert 60 <= cfg["timeout"] <= 120  # minutes-long PyTorch defaults are wrong here


def test_flag_beats_file_beats_default(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("timeout: 30\nbackend: gloo\n")
    cfg = parse_config(["--config", str(f), "--timeout", "5"])
    assert (cfg["timeout"], cfg["backend"]) == (5.0, "gloo")


@pytest.mark.parametrize("text, words", [
    ("timeot: 3\n", ["unknown key 'timeot'", "; did you mean 'timeout'? valid keys"]),
    ("compute: {block: 0.1}\n", ["unknown key 'compute.block'",
                                  "did you mean 'compute.blocks'?"]),
    ("timeout: fast\n", ["'timeout'", "'fast'", "expected a float", "got str"]),
    ("timeout: -1\n", ["'timeout'", "-1", "> 0"]),
    ("backend: mpi\n", ["'backend'", "'mpi'", "auto, gloo, nccl"]),
    ("node_speaker: on\n", ["'node_speaker'", "expected a str, got bool", "quote it"]),
    ("checks: [environment, nope]\n", ["unknown check 'nope'", "registered checks"]),
    ("checks: environment\n", ["'checks'", "expected a list"]),
    ("expect_nodes: 0\n", ["'expect_nodes'", ">= 1"]),
    ("fault: 1:explode@ddp_step\n", ["'fault'", "RANK:KIND@CHECK"]),
    ("- a\n- b\n", ["expected a mapping", "got list"]),
    ("timeout: [\n", ["not valid YAML", "line"]),
])
def test_mistakes_name_the_key_and_value(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(f)])
    message = str(e.value)
    assert "\n" not in message
    for w in words:
        assert w in message


def test_bad_flag_is_a_config_error_not_a_usage_exit():
    with pytest.raises(ConfigError, match="--timeout"):
        parse_config(["--timeout", "soon"])
    with pytest.raises(ConfigError, match="unknown check 'nope'"):
        parse_config(["--checks", "environment,nope"])


def test_fault_spec_parses_and_must_name_a_selected_check():
    assert parse_faults("1:hang@ddp_step,0:slow=2.5@ddp_step", ["ddp_step"]) == [
        Fault(1, "hang", "ddp_step"), Fault(0, "slow", "ddp_step", 2.5)]
    with pytest.raises(ConfigError, match="not among the selected checks"):
        parse_faults("1:crash@ddp_step", ["environment"])


def test_levels_lay_their_values_under_file_and_flags(tmp_path):
    assert resolve({}, {})["level"] == "standard"  # the worker's (cluster) default: defaults.yaml
    quick = parse_config(["--level", "quick"])
    assert quick["bandwidth"]["step_factor"] == 32 and quick["bandwidth"]["warmup_iters"] == 0
    assert quick["checks"] == list(REGISTRY)  # every level runs every check
    long = parse_config(["--level", "long"])
    assert long["bandwidth"]["step_factor"] == 2 and len(long["bandwidth"]["collectives"]) == 5
    assert long["bandwidth"]["max_bytes_cpu"] >= resolve({}, {})["bandwidth"]["max_bytes_cpu"]
    f = tmp_path / "c.yaml"
    f.write_text("level: quick\nbandwidth: {step_factor: 8}\n")
    cfg = parse_config(["--config", str(f)])
    assert (cfg["level"], cfg["bandwidth"]["step_factor"]) == ("quick", 8)  # file beats level
    assert cfg["compute"]["blocks"] == 3  # the level's other values stand
    assert parse_config(["--config", str(f), "--level", "long"])["compute"]["blocks"] == 10


def test_unknown_level_is_one_line():
    with pytest.raises(ConfigError, match="'level' = 'fast': expected one of quick, standard"):
        resolve({"level": "fast"}, {})
    with pytest.raises(ConfigError, match="--level"):
        parse_config(["--level", "fast"])
