"""report.json against the package's schema (job/ddp_smoke/outputs/report.schema.json).

Every report the suite produces is checked: the readers (``read``) validate what they load, and
``tests/conftest.py`` validates every ``report.json`` a test leaves under its ``tmp_path``,
whoever read it. A test that plants a report.json the kit did not write (a stale or fake one)
marks itself ``@pytest.mark.planted_report``.
"""
from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

import jsonschema


@cache
def validator() -> jsonschema.Draft202012Validator:
    """The schema shipped in the package (package data), checked itself first."""
    text = resources.files("ddp_smoke.outputs").joinpath("report.schema.json").read_text()
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def problems(report: dict) -> list[str]:
    """Each way report differs from the schema, as `path: message` (empty when it conforms)."""
    errors = sorted(validator().iter_errors(report), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message[:300]}"
            for e in errors]


def validate(report: dict, where: str = "report") -> dict:
    """Returns report when it conforms; raises AssertionError listing every difference."""
    found = problems(report)
    assert not found, f"{where} does not match report.schema.json:\n  " + "\n  ".join(found)
    return report


def read(path: Path | str) -> dict:
    """Loads a report.json the kit wrote and validates it."""
    return validate(json.loads(Path(path).read_text()), str(path))
