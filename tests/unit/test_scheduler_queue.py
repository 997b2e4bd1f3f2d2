"""The scheduler's pass reads a queued job's scheduling columns, not its document (issue 42:
a pass every 2 s, and one per submission, parsed every queued job whole: after 170 queued
10,000-choice jobs that held the API replica's GIL and slowed ``/healthz``). With a FAKE
driver launcher and a fake clock (tests.unit.test_jobs)."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest

from optimizer.service.store import JobRecord, JobStore
from optimizer.service.submissions import Submission
from tests.unit.test_jobs import Clock, FakeLauncher, job_doc, make_service


class RecordingLauncher(FakeLauncher):
    """The fake launcher, keeping the records it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[JobRecord] = []

    def start(self, rec: JobRecord) -> None:
        self.records.append(rec)
        super().start(rec)


def test_a_pass_parses_no_queued_jobs_document_and_starts_a_due_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, launcher = Clock(), RecordingLauncher()
    svc = make_service(tmp_path, launcher, clock=clock)
    later = clock.t + 3600
    at = datetime.fromtimestamp(later)
    waiting = [
        svc.submit(Submission(job=job_doc(f"later{i}"), not_before=at))[0].id for i in range(30)
    ]
    parsed: list[str] = []
    real = JobStore._record

    def counting(row):  # type: ignore[no-untyped-def]
        parsed.append(row._mapping["id"])
        return real(row)

    monkeypatch.setattr(JobStore, "_record", staticmethod(counting))
    for _ in range(3):
        svc.scheduler.tick()
    assert parsed == []  # 30 queued jobs, three passes: no document read
    assert launcher.started == []

    clock.t = later  # all due: the first starts (one at a time), read whole
    svc.scheduler.tick()
    assert launcher.started == [waiting[0]]
    assert parsed == [waiting[0]]
    rec = launcher.records[0]
    assert rec.state == "running" and rec.driver_starts == 1 and rec.started_at == later
    assert rec.job["name"] == "later0" and rec.job["search_space"]["params"]


def test_cancel_and_expiry_of_queued_jobs_still_apply(tmp_path: Path) -> None:
    clock, launcher = Clock(), RecordingLauncher()
    svc = make_service(tmp_path, launcher, clock=clock)
    far = datetime.fromtimestamp(clock.t + 3600)
    first = svc.submit(Submission(job=job_doc("a"), not_before=far))[0].id
    second = svc.submit(
        Submission(job=job_doc("b"), not_before=far, until=far + timedelta(seconds=60))
    )[0].id
    svc.store.update(first, cancel_requested=True)
    svc.scheduler.tick()
    assert svc.store.get(first).state == "cancelled"
    assert svc.store.get(second).state == "queued"
    clock.t += 3600 + 61  # past its window before it could start
    svc.scheduler.tick()
    assert svc.store.get(second).state == "expired"
    assert launcher.started == []
