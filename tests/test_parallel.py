"""`make test` runs modules side by side (pytest-xdist, tests/conftest.py parallel_group): two
sandboxes that may be up at once must not share a name prefix (their namespaces, links and
/etc/hosts block) or a subnet (two bridges with one subnet on one machine route to either).
A shared part's modules run one after another in one worker: they may share its names."""
import re
from pathlib import Path

from tests.conftest import ROOT, SHARED_GROUPS, parallel_group

TESTS = ROOT / "tests"
_PAIR = re.compile(r'"([a-z][a-z0-9]{1,5})",\s*"(10\.\d+\.\d+\.0/\d+)"')  # prefix, subnet
_SUBNET = re.compile(r'"(10\.\d+\.\d+\.0/\d+)"')
# The shared parts' own modules: their default names belong to their group. hosts.py's
# defaults (dsh) are the command line's, for a person, never a test's.
_PART_MODULES = {"tests/sandbox/slurm.py": "slurm", "tests/sandbox/docker.py": "docker"}


def _group(path: Path) -> str | None:
    rel = path.relative_to(ROOT).as_posix()
    if rel in _PART_MODULES:
        return _PART_MODULES[rel]
    if rel.startswith("tests/campaign/") or path.name.startswith("test_"):
        return parallel_group(path)
    return None


def _names() -> dict[str, dict[str, set[str]]]:
    """prefix or subnet -> group -> the files naming it."""
    seen: dict[str, dict[str, set[str]]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        group = _group(path)
        if group is None or path == Path(__file__):
            continue
        text = path.read_text()
        names = {p for p, _ in _PAIR.findall(text)} | set(_SUBNET.findall(text))
        for name in names:
            seen.setdefault(name, {}).setdefault(group, set()).add(path.name)
    return seen


def test_no_two_groups_share_a_sandbox_prefix_or_subnet():
    seen = _names()
    assert {"dss", "dsd", "dcp", "10.231.2.0/24"} <= set(seen), sorted(seen)  # the scan works
    shared = {name: groups for name, groups in seen.items() if len(groups) > 1}
    assert not shared, f"names two parallel groups both use: {shared}"


def test_the_shared_parts_are_grouped_and_the_rest_is_per_module():
    def group(rel):
        return parallel_group(ROOT / rel)
    assert group("tests/launchers/test_slurm.py") == \
        group("tests/launchers/test_submit_slurm.py") == "slurm"
    assert group("tests/launchers/test_submit.py") == "tests/launchers/test_submit.py"
    assert group("tests/launchers/test_k8s_run.py") == group("tests/launchers/test_docker.py") \
        == "docker"
    assert group("tests/campaign/test_four_faults.py") == "campaign"
    assert group("tests/worker/test_diagnosis.py") == "tests/worker/test_diagnosis.py"
    assert set(SHARED_GROUPS) == {"campaign", "slurm", "docker"}
