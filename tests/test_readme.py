"""README.md as a newcomer reads it: short, every link leads somewhere, and every one-machine
command in it runs as written, from the checkout, with what it says it does.

The commands are the lines of README's fenced blocks that start with ``make smoke-local`` or
``.venv/bin/`` (``make test`` runs this very suite and is left out). Each runs through bash in
the repository, as a user would paste it; a practice fault must fail with its rank named.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
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
            assert run.returncode == 0 or _paced_only(said), \
                f"{command} exited {run.returncode}\n{said[-3000:]}"


def _paced_only(said: str) -> bool:
    """The run failed on pace alone, its checks otherwise passing: a rank the others waited
    for, or a compute rank below the others' pace on cores it shares with them. On the
    suite's two loaded cores that is the scheduler's (seen in a clean-clone rehearsal: make
    smoke-local's rank 1 sustained 35 % of rank 0's rate beside three busy test workers); the
    tests of pace do not take it for a pass."""
    found = re.findall(r" · report (\S+/report\.json)", said)
    if not found or not (REPO / found[-1]).exists():
        return False
    checks = json.loads((REPO / found[-1]).read_text())["checks"]
    failed = [c for c in checks if c["status"] == "fail"]
    paced = failed and all(c["culprits"] and all(
        " waited for rank " in k["reason"] or "of the other ranks' pace" in k["reason"]
        for k in c["culprits"]) for c in failed)
    if paced:
        print(f"\nfailed on pace alone, taken for a pass: {[c['summary'] for c in failed]}")
    return bool(paced)


def _headings(path: Path) -> set[str]:
    return {m.strip() for m in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _printed_and_written() -> dict[str, str]:
    """What points readers elsewhere: --help of the worker and node-check, the Makefile, and
    every page under docs/ with README."""
    said = {f"{' '.join(words)} --help": subprocess.run(
        [sys.executable, "-m", "ddp_smoke", *words, "--help"], cwd=REPO,
        capture_output=True, text=True, timeout=60).stdout for words in ([], ["node-check"])}
    said["Makefile"] = (REPO / "Makefile").read_text()
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        said[page.relative_to(REPO).as_posix()] = page.read_text()
    return said


def test_every_cross_reference_printed_or_written_leads_to_its_section():
    """`docs/options.md, "Measurement levels"`, `README "…"`, a `docs/….md` named in --help
    or the Makefile, a link with an #anchor: the file exists and so does the section (issue
    49: --help sent readers to a README section that had moved)."""
    said, wrong = _printed_and_written(), []
    assert all(said.values()), [k for k, v in said.items() if not v]
    for where, text in said.items():
        here = (REPO / where).parent if where.endswith(".md") else REPO
        for name, section in re.findall(r'((?:docs/)?[\w.-]+\.md|README),? "([^"]+)"', text):
            path = REPO / "README.md" if name == "README" else (
                REPO / name if (REPO / name).exists() else here / name)
            if not path.exists() or section not in _headings(path):
                wrong.append(f"{where}: {name}, {section!r}")
        if not where.endswith(".md"):
            wrong += [f"{where}: {name}" for name in re.findall(r"\bdocs/[\w.-]+\.md", text)
                      if not (REPO / name).exists()]
        for name, anchor in re.findall(r"\]\(([^)#\s]*\.md)#([^)\s]+)\)", text):
            if anchor not in {_slug(h) for h in _headings(here / name)}:
                wrong.append(f"{where}: {name}#{anchor}")
    assert wrong == [], wrong
