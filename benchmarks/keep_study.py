"""Keep a study's record in the repository: its ``plan.json`` and ``study.db``, machine paths out.

A long measurement (the capacity grids under ``benchmarks/data/``) is committed as it goes, so
that a stop loses at most the trial in flight. The copy is taken with SQLite's backup API (a
consistent snapshot while the study writes), and every text value of every table, like
``plan.json``, has the study folder's path replaced by ``<out>`` and each ``--strip`` prefix (the
checkout the study ran from) by ``<repo>``::

    python -m benchmarks.keep_study runs/capacity-grid-v3/r1 benchmarks/data/capacity-grid-v3/r1 \\
        --strip "$PWD"

Prints how many trials the copy holds and how many values were rewritten.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

__all__ = ["keep", "main", "scrub_text"]


def scrub_text(text: str, replacements: list[tuple[str, str]]) -> str:
    """``text`` with every ``(old, new)`` replaced, longest ``old`` first."""
    for old, new in sorted(replacements, key=lambda p: -len(p[0])):
        text = text.replace(old, new)
    return text


def _scrub_db(db: Path, replacements: list[tuple[str, str]]) -> int:
    changed = 0
    con = sqlite3.connect(db)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            cols = [r[1] for r in con.execute(f'PRAGMA table_info("{table}")')]
            for col in cols:
                rows = con.execute(
                    f'SELECT rowid, "{col}" FROM "{table}" WHERE typeof("{col}") = \'text\''
                ).fetchall()
                for rowid, value in rows:
                    new = scrub_text(value, replacements)
                    if new != value:
                        con.execute(
                            f'UPDATE "{table}" SET "{col}" = ? WHERE rowid = ?', (new, rowid)
                        )
                        changed += 1
        con.commit()
        con.execute("VACUUM")
    finally:
        con.close()
    return changed


def keep(src: Path, dest: Path, strip: list[str]) -> tuple[int, int]:
    """Copy ``src``'s plan.json and study.db to ``dest``, paths replaced; (trials, rewritten)."""
    src = src.resolve()
    replacements = [(str(src), "<out>")] + [(str(Path(p).resolve()), "<repo>") for p in strip]
    dest.mkdir(parents=True, exist_ok=True)
    plan = (src / "plan.json").read_text()
    (dest / "plan.json").write_text(scrub_text(plan, replacements))
    target = dest / "study.db"
    tmp = target.with_suffix(".db.tmp")
    tmp.unlink(missing_ok=True)
    source = sqlite3.connect(f"file:{src / 'study.db'}?mode=ro", uri=True)
    try:
        copy = sqlite3.connect(tmp)
        source.backup(copy)
        copy.close()
    finally:
        source.close()
    changed = _scrub_db(tmp, replacements)
    with sqlite3.connect(tmp) as con:
        trials = int(con.execute("SELECT COUNT(*) FROM trials").fetchone()[0])
    con.close()
    tmp.replace(target)
    return trials, changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="the study folder")
    ap.add_argument("dest", type=Path, help="where its record is kept")
    ap.add_argument("--strip", action="append", default=[], help="a path prefix to hide")
    ns = ap.parse_args(argv)
    trials, changed = keep(ns.src, ns.dest, ns.strip)
    print(f"{trials} trials kept in {ns.dest} ({changed} values rewritten)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
