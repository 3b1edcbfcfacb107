"""The run's configuration: one schema, loud on mistakes.

Precedence, written once: a flag given on the command line > the ``--config`` YAML file >
the measurement level's values (``levels.py``; ``level``, itself set by flag, file or default)
> the package's ``defaults.yaml``. ``defaults.yaml`` is the schema by example: every key a user
may set is there with its default, and a user value must have the default's type (an int is
accepted where a float is expected). Keys whose default is null take the type named in
``_NULLABLE``. Sections (mappings, e.g. one per check) are checked the same way, key by key.

Any mistake raises ConfigError with one line naming the key, the value, what was expected and,
for an unknown key, the valid keys; the CLI turns it into exit status 2.
"""
from __future__ import annotations

import copy
import difflib
import os
from importlib import resources
from typing import Any

import yaml

from ..errors import ConfigError
from . import levels, profiles, rules
from .faults import parse_faults

_NULLABLE = {"report_dir": str, "storage_dir": str, "expect_nodes": int,
             "expect_world_size": int, "fault": str, "profile": str, "duration": float,
             "expect_transport": str,
             "act": str, "prometheus": str, "rails": list}


def defaults() -> dict[str, Any]:
    """The package's defaults, freshly parsed."""
    return yaml.safe_load(resources.files(__package__).joinpath("defaults.yaml").read_text())


# The diagnosis rules' thresholds as the package sets them (defaults.yaml says why each has its
# value): where a caller has no run's config at hand. A run's own are ``cfg["diagnosis"]``.
DIAGNOSIS: dict[str, Any] = defaults()["diagnosis"]


def load_file(path: str) -> dict[str, Any]:
    """Read a user YAML file; it must hold a mapping."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"--config {path}:{where} not valid YAML "
                          f"({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys, got {_kind(data)}")
    return data


def resolve(file_values: dict[str, Any], flag_values: dict[str, Any],
            source: str = "config") -> dict[str, Any]:
    """Merge defaults < level < file < flags, validate every key; return the effective config."""
    merged = defaults()
    level = flag_values.get("level") or file_values.get("level") or merged["level"]
    if level not in levels.LEVELS:
        raise ConfigError(f"key 'level' = {level!r}: expected one of {', '.join(levels.LEVELS)}")
    _merge(merged, levels.overlay(level), "level")
    _merge(merged, file_values, source)
    _merge(merged, {k: v for k, v in flag_values.items() if v is not None}, "flag")
    _validate(merged)
    return merged


def _merge(base: dict, overlay: dict, source: str, prefix: str = "") -> None:
    for key, value in overlay.items():
        name = f"{prefix}{key}"
        if key not in base:
            valid = ", ".join(sorted(base))
            close = difflib.get_close_matches(str(key), list(base), n=1)
            hint = f" did you mean {prefix + close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {name!r} ({source});{hint} valid keys: {valid}")
        default = base[key]
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"key {name!r} = {value!r} ({source}): expected a mapping, "
                                  f"got {_kind(value)}")
            _merge(default, value, source, prefix=f"{name}.")
        else:
            base[key] = copy.deepcopy(_typed(name, value, default, source))


def _typed(name: str, value: Any, default: Any, source: str) -> Any:
    expected = _NULLABLE.get(name) if default is None else type(default)
    if value is None and default is None:
        return None
    ok = isinstance(value, expected) and not (isinstance(value, bool) and expected is not bool)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if expected is list and ok and default:
        item = type(default[0])
        ok = all(isinstance(v, item) and not isinstance(v, bool) or
                 (item is float and isinstance(v, int)) for v in value)
        expected_text = f"a list of {item.__name__}"
    else:
        expected_text = f"{'an' if expected.__name__[0] in 'aeiou' else 'a'} {expected.__name__}"
    if not ok:  # (YAML 1.1, as PyYAML reads it: a bare on, off, yes or no is a boolean)
        hint = " (quote it: YAML reads a bare on/off/yes/no as true/false)" \
            if isinstance(value, bool) and expected is str else ""
        raise ConfigError(f"key {name!r} = {value!r} ({source}): expected {expected_text}, "
                          f"got {_kind(value)}{hint}")
    return value


def _validate(cfg: dict[str, Any]) -> None:
    checks = cfg["checks"]
    unknown = [c for c in checks if c not in rules.CHECKS]
    if unknown or not checks or len(set(checks)) != len(checks):
        close = difflib.get_close_matches(unknown[0], list(rules.CHECKS), n=1) if unknown else []
        problem = (f"unknown check {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)"
                                                       if close else "")
                   if unknown else "empty or repeated")
        raise ConfigError(f"key 'checks' = {','.join(checks)!r}: {problem}; "
                          f"registered checks: {', '.join(rules.CHECKS)}")
    rules.check(cfg)  # finite, inside bounds, known names: every key of defaults.yaml
    if cfg["duration"] is not None and cfg["repeat"] != 1:
        raise ConfigError("keys 'repeat' and 'duration': give one, not both")
    if cfg["expect_transport"] is not None and not cfg["expect_transport"].strip():
        raise ConfigError("key 'expect_transport' = '': expected ib, socket or a net plugin's "
                          "name (e.g. libfabric)")
    parse_faults(cfg["fault"], checks)
    for device, size in (("cpu", cfg["training"]["cpu"]), ("gpu", cfg["training"]["gpu"])):
        if size["dim"] % size["heads"] or (size["dim"] // size["heads"]) % 2:
            raise ConfigError(f"keys 'training.{device}.dim' = {size['dim']} and "
                              f"'training.{device}.heads' = {size['heads']}: expected a dim that "
                              "is the heads times an even head size (rotary positions)")
    if cfg["act"] and cfg["fault"]:  # an injected fault is no reason to take a node away
        raise ConfigError(f"keys 'act' and 'fault': --act {cfg['act']} never acts on an "
                          f"injected fault ({cfg['fault']}); drop one of them")
    if cfg["profile"]:
        profiles.load(cfg["profile"])


def report_dir(cfg: dict[str, Any], run_id: str) -> str:
    """The report directory: as configured, else reports/<run id> under the working directory."""
    return cfg["report_dir"] or os.path.join("reports", run_id)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
