"""A study folder is self-contained: what ``plan.json`` and ``review/mlflow.json`` record about
files inside the folder is recorded relative to it, and read back against the folder it is in
now, so a copied or moved folder works (and never reads another study at the old path).

- An SQLite storage inside the folder is recorded as its path relative to the folder
  (``study.db``: no ``://``); any other URL (PostgreSQL, a shared SQLite file elsewhere,
  ``journal://``) is recorded as given.
- Folders written before this rule recorded absolute paths: a recorded SQLite file that lay in
  the folder's old location (``job.out``) is read from the folder it is in now.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["portable_path", "portable_url", "resolve_path", "resolve_url", "storage_url_of"]

_SQLITE = "sqlite:///"


def _inside(path: Path, folder: Path) -> str | None:
    """``path`` relative to ``folder`` (posix), or None when it is not inside it."""
    try:
        return Path(path).resolve().relative_to(Path(folder).resolve()).as_posix()
    except ValueError:
        return None


def portable_url(url: str, out: Path) -> str:
    """What ``plan.json`` records for a storage (or MLflow) URL of a study written to ``out``."""
    if url.startswith(_SQLITE):
        rel = _inside(Path(url[len(_SQLITE) :]), out)
        if rel is not None:
            return rel
    return url


def portable_path(path: str | Path, out: Path) -> str:
    """A file or folder inside ``out`` as a relative path; anything else as given."""
    rel = _inside(Path(path), out)
    return str(path) if rel is None else rel


def _relocated(recorded: Path, folder: Path, old_out: str | None) -> Path:
    if recorded.is_absolute():
        if old_out and Path(old_out).is_absolute():
            rel = _inside(recorded, Path(old_out))
            if rel is not None:
                return (folder / rel).resolve()
        return recorded
    return (folder / recorded).resolve()


def resolve_url(recorded: str, folder: Path, old_out: str | None = None) -> str:
    """The URL to open for a recorded storage (or MLflow) URL of the study now in ``folder``.

    Args:
        recorded: What ``plan.json`` (or ``mlflow.json``) holds.
        folder: Where the study folder is now.
        old_out: The folder the study was written to (``plan.json``'s ``job.out``), for folders
            that recorded absolute paths.
    """
    if "://" not in recorded:
        return f"{_SQLITE}{(Path(folder) / recorded).resolve()}"
    if recorded.startswith(_SQLITE):
        return f"{_SQLITE}{_relocated(Path(recorded[len(_SQLITE) :]), Path(folder), old_out)}"
    return recorded


def resolve_path(recorded: str, folder: Path, old_out: str | None = None) -> Path:
    """The path to use for a recorded file or folder of the study now in ``folder``."""
    return _relocated(Path(recorded), Path(folder), old_out)


def storage_url_of(plan: dict[str, object], folder: Path) -> str:
    """The Optuna storage to open for a study folder's ``plan.json`` document."""
    job = plan.get("job")
    old_out = job.get("out") if isinstance(job, dict) else None
    return resolve_url(str(plan["storage"]), folder, old_out if isinstance(old_out, str) else None)
