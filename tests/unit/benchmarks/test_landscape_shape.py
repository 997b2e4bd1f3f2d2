"""benchmarks/landscape_shape.py: how peaked and noisy a table is, and whether its best joint
configuration is each parameter's best alone (on SYNTHETIC tables: the code, never a result)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.landscape_shape import main, shape_of
from benchmarks.search_table import load_table
from tests.unit.benchmarks.test_search_table import _entry

# Capacity (x 6 req/s) by (a, b): the best is (1, 2), but a = 2 and b = 2 are each the better
# value on average, and (2, 2) together carries a third of the best.
CAPS = {(1, 1): 1.0, (1, 2): 6.0, (2, 1): 5.5, (2, 2): 2.0, (1, 3): 0.5}


def _doc(refused: tuple[tuple[int, int], ...] = ((2, 3),), caps: dict | None = None) -> dict:
    doc: dict = {"configs": {}, "refused": {}}
    for (a, b), cap in (caps or CAPS).items():
        params = {"a": a, "b": b}
        doc["configs"][json.dumps(params)] = _entry(params, cap, baseline=False)
    doc["configs"]["base"] = _entry({"a": 9}, 1.5, baseline=True)
    for a, b in refused:
        doc["refused"][f"{a},{b}"] = {"params": {"a": a, "b": b}, "message": "invalid"}
    return doc


def test_the_shape_reads_how_peaked_how_noisy_and_the_parameters_alone() -> None:
    shape = shape_of(load_table(_doc()))
    assert (shape.points, shape.refused) == (5, 1)
    assert shape.best == {"a": 1, "b": 2} and shape.best_rps == pytest.approx(36.0)
    assert shape.baseline_rps == pytest.approx(9.0)
    assert shape.median_over_best == pytest.approx(2.0 / 6.0)  # of 6, 5.5, 2, 1, 0.5
    assert shape.median_over_best_all == pytest.approx(1.5 / 6.0)  # and the refused label's 0
    assert shape.near_best == 1  # 5.5 is under 95 % of 6
    # Two repeats at x0.97 and x1.03 each: a CV of 0.03 * sqrt(2).
    assert shape.repeated == 5 and shape.median_cv == pytest.approx(0.03 * math.sqrt(2))
    # a = 2 averages 3.75 against a = 1's 2.5; b = 2 averages 4 against 3.25 and 0.5.
    assert shape.alone == {"a": 2, "b": 2}
    assert shape.alone_rps == pytest.approx(12.0) and shape.alone_rank == 3
    assert shape.differs == ["a"]


def test_a_refused_combination_of_the_best_values_alone_has_no_capacity() -> None:
    caps = {k: v for k, v in CAPS.items() if k != (2, 2)}
    shape = shape_of(load_table(_doc(refused=((2, 2), (2, 3)), caps=caps)))
    assert shape.alone == {"a": 2, "b": 2}  # 5.5 against (1 + 6 + 0.5) / 3; 6 against 3.25
    assert shape.alone_rps is None and shape.alone_rank is None


def test_the_command_prints_tables_side_by_side_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "one.json", tmp_path / "two.json"
    first.write_text(json.dumps(_doc()))
    second.write_text(json.dumps(_doc(refused=((2, 2), (2, 3)), caps={
        k: v for k, v in CAPS.items() if k != (2, 2)
    })))  # fmt: skip
    assert main([str(first), str(second), "--json", str(tmp_path / "shape.json")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split("|")[1:] == [" one ", " two"]
    assert "| 33 % | 54 %" in next(line for line in out.splitlines() if line.startswith("median /"))
    saved = json.loads((tmp_path / "shape.json").read_text())
    assert saved["two"]["alone_rps"] is None and saved["one"]["alone_rank"] == 3


def test_a_table_that_is_not_json_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit, match=r"bad\.json"):
        main([str(bad)])


def test_agreement_reads_the_ranks_ratio_and_top_decile_on_the_shared_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.landscape_shape import agreement

    # The second measured four of the first's five points (not (1, 3)); its ranks differ but
    # its best, (1, 2), is the first's too.
    caps = {(1, 1): 3.0, (1, 2): 3.6, (2, 1): 0.6, (2, 2): 1.2}
    first, second = load_table(_doc()), load_table(_doc(caps=caps), partial=True)
    ag = agreement(first, second)
    assert ag.common == 4 and (ag.top, ag.top_shared) == (1, 1)
    # Ranks (1, 4, 3, 2) against (3, 4, 1, 2): 1 - 6 * 8 / (4 * 15).
    assert ag.spearman == pytest.approx(0.2)
    assert ag.median_ratio == pytest.approx(0.6)  # of 3.0, 0.6, 0.6 / 5.5 and 0.6
    # Fewer than three shared points: named, not a correlation of two.
    with pytest.raises(SystemExit, match="share 2 measured grid points"):
        agreement(first, load_table(_doc(caps={(1, 1): 1.0, (1, 2): 2.0}), partial=True))
    a, b = tmp_path / "one.json", tmp_path / "two.json"
    a.write_text(json.dumps(_doc()))
    b.write_text(json.dumps(_doc(caps=caps)))
    assert main([str(a), str(b), "--agree", "--partial"]) == 0
    assert "two against one on the 4 points both measured: Spearman 0.20" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exactly two"):
        main([str(a), "--agree"])
