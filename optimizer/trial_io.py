"""Per-request records on disk: gzip-compressed JSON lines, one record a line."""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict
from pathlib import Path

from optimizer.types import RequestRecord

__all__ = ["read_records", "write_records"]


def write_records(records: tuple[RequestRecord, ...] | list[RequestRecord], path: Path) -> None:
    """Per-request records as gzip-compressed JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for r in records:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    """Read records written by :func:`write_records`."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            d = json.loads(line)
            d["chunk_times_s"] = tuple(d["chunk_times_s"])
            out.append(RequestRecord(**d))
    return out
