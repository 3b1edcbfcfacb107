"""The fault campaign in CI: the matrix's rules (pure), and a sample of real cells.

The sample is drawn from the cells docs/campaign.md shows right (CI guards what the campaign
has shown right; ``make campaign`` runs the rest and finds what is still wrong), seeded by the
commit (``git rev-parse HEAD``; ``CAMPAIGN_SEED`` overrides), so the cells CI runs are exactly
those ``python -m tests.campaign --sample <commit>`` runs before a push, and each commit samples
other cells. The sample takes cells while their times in that table fit ``SAMPLE_BUDGET_S``
(tests/campaign/__main__.py). A wrong cell fails with the command that reruns it alone.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from tests.campaign import matrix
from tests.campaign.__main__ import SAMPLE_BUDGET_S, TABLE, ci_sample, covering

SEED = matrix.commit_seed()
COVER = covering()
SAMPLE, SAMPLE_COST = ci_sample(SEED, SAMPLE_BUDGET_S)


# -- the matrix (pure) -------------------------------------------------------------------------

def test_every_pair_a_possible_cell_holds_is_in_the_covering_set():
    held = {p for c in COVER.cells for p in matrix._pairs(c)}
    possible = {p for c in matrix.all_cells() if matrix.impossible(c) is None
                for p in matrix._pairs(c)}
    assert held == possible and len(held) == COVER.pairs
    assert all(matrix.impossible(c) is None for c in COVER.cells)


def test_the_cells_a_table_ran_stay_and_new_values_only_add_cells():
    table = TABLE.read_text()
    listed = matrix.cells_in(table)
    assert listed and all(c in COVER.cells for c in listed)
    ran = listed[:40]
    kept = matrix.cover(kept=ran)
    assert set(ran) <= set(kept.cells) and kept.pairs == COVER.pairs
    gone = "| wobbly_link.rank0.storage.torchrun.3x1 | pass {-} | pass {-} | - | 16.1 | right |"
    assert matrix.cells_in(gone) == []  # a kind no longer in the matrix: not a cell


def test_every_pair_left_out_says_why_and_really_cannot_exist():
    names = list(matrix.DIMENSIONS)
    holders: dict[tuple, list] = {}  # (one pass over the 71,280 cells, not one a pair)
    for c in matrix.all_cells():
        for i, a, j, b in matrix._pairs(c):
            holders.setdefault((names[i], a, names[j], b), []).append(c)
    for pair, why in COVER.impossible_pairs.items():
        assert why, pair
        assert holders.get(pair) and all(matrix.impossible(c) for c in holders[pair]), pair
    assert set(names) == {"kind", "position", "stage", "launcher", "shape"}


def test_each_cell_has_one_exact_expectation_and_parses_back():
    for c in COVER.cells:
        e = matrix.expect(c)
        assert e.verdict in (matrix.PASS, matrix.FAIL, matrix.BAD_INPUT, matrix.LOST,
                             matrix.NONE), c
        assert (e.verdict == matrix.FAIL) == bool(e.culprits), c
        assert matrix.Cell.parse(c.id) == c
    with pytest.raises(ValueError, match="shape"):
        matrix.Cell.parse("sigkill.middle.compute.torchrun.9x9")


def test_the_sample_is_the_commits_own_and_fits_its_budget():
    again = ci_sample(SEED, SAMPLE_BUDGET_S)
    assert SAMPLE and again == (SAMPLE, SAMPLE_COST)
    assert sum(SAMPLE_COST.values()) <= SAMPLE_BUDGET_S
    assert {c.id for c in SAMPLE} <= matrix.right_in(TABLE.read_text())  # shown right
    measured = matrix.measured_in(TABLE.read_text())  # each costed at its measured time
    assert all(SAMPLE_COST[c.id] == measured[c.id] for c in SAMPLE), SAMPLE_COST
    other = matrix.sample(COVER.cells, SEED + "x", SAMPLE_BUDGET_S)
    assert other != SAMPLE  # another commit, other cells
    assert matrix.select(COVER.cells, "kind=sigkill,shape=1x3+3x1") == [
        c for c in COVER.cells if c.kind == "sigkill" and c.shape in ("1x3", "3x1")]


def test_positions_land_where_they_say():
    cells = [matrix.Cell("sigkill", p, "compute", "torchrun", s)
             for p, s in itertools.product(matrix.POSITIONS, matrix.SHAPES)]
    at = {(c.position, c.shape): (c.rank, c.node, c.peer_node) for c in cells}
    assert at[("middle", "3x1")] == (1, 1, 2) and at[("last", "4x1")] == (3, 3, 2)
    assert at[("middle", "1x3")][:2] == (1, 0)  # one node: no link, no peer node
    assert at[("store_node", "1x4")][:2] == (3, 0) and at[("store_node", "3x1")] == (0, 0, 1)
    # two nodes of two: the middle is node 1's speaker, the last its mate
    assert at[("middle", "2x2")] == (2, 1, 0) and at[("last", "2x2")] == (3, 1, 0)
    assert at[("store_node", "2x2")] == (1, 0, 1)
    assert all(0 <= c.rank < c.world for c in cells)
    assert dataclasses.astuple(cells[0]) == tuple(cells[0].id.split("."))


# -- real cells --------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", SAMPLE, ids=[c.id for c in SAMPLE])
def test_sampled_cell_is_right(cell, parts, tmp_path):
    from tests.campaign import runner
    row = runner.run(cell, parts, tmp_path / "cell")
    print(f"\ncampaign seed {SEED}: {cell.id} in {row.wall_s:.1f} s: {row.got}")
    assert row.ok, (f"{cell.id} (seed {SEED}): {'; '.join(row.problems)}; reasons: "
                    f"{row.got.text[:1500]}\nrerun it alone: python -m tests.campaign "
                    f"--cell {cell.id}")
