"""README.md as a newcomer reads it: short, every link leads somewhere, and every one-machine
command in it runs as written, from the checkout, with what it says it does.

The commands are the lines of README's fenced blocks that start with ``make smoke-local`` or
``.venv/bin/`` (``make test`` runs this very suite and is left out). Each runs through bash in
the repository, as a user would paste it; a practice fault must fail with its rank named.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_LINES = 200


def _commands() -> list[str]:
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", README.read_text(), re.S | re.M)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.startswith(("make smoke-local", ".venv/bin/"))]


def test_readme_fits_on_a_few_screens():
    assert len(README.read_text().splitlines()) <= MAX_LINES


@pytest.mark.parametrize("page", [README, *sorted((REPO / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [x for x in links if "://" not in x and not (page.parent / x).exists()]
    assert missing == [], f"{page.name} links to files that do not exist"


def test_readme_names_its_commands():
    """The scan below must see something: these are README's promises."""
    found = _commands()
    assert "make smoke-local ARGS='--checks environment,ddp_step'" in [
        c.split("  #")[0].strip() for c in found], found
    assert any(c.startswith(".venv/bin/ddp-smoke history") for c in found), found


@pytest.mark.timeout(400)
def test_every_one_machine_command_runs_as_written():
    for command in _commands():
        run = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        said = run.stdout + run.stderr
        assert "Traceback" not in said, f"{command}\n{said[-3000:]}"
        if "--fault 1:" in command:  # practice: the run fails and names the rank it hit
            assert run.returncode != 0 and "culprit: rank 1 " in run.stdout, \
                f"{command}\n{said[-3000:]}"
        else:
            assert run.returncode == 0, f"{command} exited {run.returncode}\n{said[-3000:]}"
