"""The store's liveness off the request path (:mod:`optimizer.service.liveness`): ``/healthz``
reads the last answer, with no I/O, while the liveness thread runs (issue 42: ``/healthz``
under 100 ms throughout); without the thread it asks the store itself, as before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from optimizer.service.api import create_app
from optimizer.service.facade import JobService
from optimizer.service.liveness import StoreLiveness
from tests.unit.test_jobs import FakeLauncher, make_service


class FakeClock:
    """A monotonic clock the test moves (a fake)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingCheck:
    """A store check that counts its calls and fails while ``down`` (a fake)."""

    def __init__(self) -> None:
        self.calls = 0
        self.down = False

    def __call__(self) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("database is gone")


def test_without_its_thread_every_read_asks_the_store() -> None:
    check = CountingCheck()
    live = StoreLiveness(check)
    assert live.ok() and live.ok()
    assert check.calls == 2
    check.down = True
    assert not live.ok()
    assert "database is gone" in live.last_error


def test_with_its_thread_a_read_asks_nothing_and_a_stale_answer_reads_as_down() -> None:
    check, clock = CountingCheck(), FakeClock()
    live = StoreLiveness(check, every_s=3600, stale_s=5, clock=clock)
    live.start()
    try:
        assert live.running and check.calls == 1  # asked once, at the start
        assert all(live.ok() for _ in range(50))
        assert check.calls == 1
        clock.now += 2
        assert live.ok() and live.age_s() == 2
        clock.now += 3.1  # no answer for longer than stale_s (a check that hangs)
        assert not live.ok()
    finally:
        live.stop()
    assert not live.running


def test_the_thread_records_a_store_that_goes_down_and_comes_back() -> None:
    check = CountingCheck()
    live = StoreLiveness(check, every_s=0.02, stale_s=60)
    live.start()
    try:
        check.down = True
        deadline = time.monotonic() + 5
        while live.ok() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not live.ok() and "database is gone" in live.last_error
        check.down = False
        while not live.ok() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.ok() and live.last_error == ""
    finally:
        live.stop()


ServiceAndClient = tuple[JobService, TestClient]


@pytest.fixture
def service_and_client(tmp_path: Path) -> Iterator[ServiceAndClient]:
    svc = make_service(tmp_path, FakeLauncher())
    yield svc, TestClient(create_app(svc))
    svc.close()


def test_healthz_reads_the_liveness_thread_and_does_not_ask_the_store(
    service_and_client: ServiceAndClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, client = service_and_client
    check = CountingCheck()
    monkeypatch.setattr(svc, "liveness", StoreLiveness(check, every_s=3600))
    svc.liveness.start()
    for _ in range(20):
        doc = client.get("/healthz").json()
        assert doc["ok"] is True and doc["database"] is True
        assert 0 <= doc["database_age_s"] < 60
    assert check.calls == 1  # the thread's first check: no probe asked the store
    svc.close()
    assert not svc.liveness.running


def test_healthz_without_the_thread_asks_the_real_store(
    service_and_client: ServiceAndClient,
) -> None:
    svc, client = service_and_client
    assert not svc.liveness.running
    assert client.get("/healthz").json()["database"] is True
    svc.store.engine.dispose()
    svc.store.engine = sa.create_engine("sqlite:////nonexistent/dir/x.db")  # a store gone
    doc = client.get("/healthz").json()
    assert doc["ok"] is False and doc["database"] is False and doc["database_age_s"] is None
