"""Issue 42, item 5: what a submission may cost the service is bounded, against the real
FastAPI app on the real JobService (a FAKE driver launcher; a FAKE slow plan check where the
test needs one held).

- A search space's checks are linear in its size: an inline categorical of 10,000 choices (a
  59 KB body) took 20 s of CPU to accept, as the distinct-choices check compared each choice
  with every earlier one (50 million comparisons); a ``when`` list against it did the same.
  The tests count the comparisons (no wall clock: this machine may be busy), and the count is
  capped so that the quadratic version fails at once instead of running for minutes.
- Submissions checked at once are bounded per team and in all: the next one is a 429 with a
  Retry-After, and nothing of it is stored.
"""

from __future__ import annotations

import json
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from optimizer.config import JobConfig
from optimizer.service.api import create_app
from optimizer.service.auth import TokenEntry, hash_token
from optimizer.service.facade import JobService
from optimizer.service.scheduler import Scheduler
from optimizer.service.settings import ServiceSettings
from optimizer.service.store import JobStore
from search_spaces import schema
from tests.unit.test_api import AUTH
from tests.unit.test_jobs import TRACES, FakeLauncher, job_doc, make_service

CHOICES = 10_000


class _TooManyComparisons(Exception):
    pass


@pytest.fixture
def comparisons(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the search-space schema's value comparisons (``_same``); past 20 per choice of
    the largest space a test submits it raises, so a quadratic check fails in a moment."""
    count = [0]
    same = schema._same

    def counted(a: Any, b: Any) -> bool:
        count[0] += 1
        if count[0] > 20 * CHOICES:
            raise _TooManyComparisons(count[0])
        return same(a, b)

    monkeypatch.setattr(schema, "_same", counted)
    return count


def _big_space(when_values: int = 0) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max-num-seqs": {"type": "categorical", "choices": list(range(1, CHOICES + 1))}
    }
    if when_values:
        params["block-size"] = {
            "type": "categorical",
            "choices": [16, 32],
            "when": {"max-num-seqs": list(range(1, when_values + 1))},
        }
    return {"name": "big", "params": params}


@pytest.mark.parametrize("when_values", [0, 9_000], ids=["choices", "choices-and-when"])
def test_a_categorical_of_10000_choices_is_accepted_in_linear_comparisons(
    tmp_path: Path, comparisons: list[int], when_values: int
) -> None:
    """The whole submission, the real plan check included: accepted, with a number of value
    comparisons that grows with the choices (before: 50 million, 20 s of CPU); with a `when`
    list of 9,000 values against them too (a body holds at most 20,000 values)."""
    svc = make_service(tmp_path, FakeLauncher(), real_check=True)
    client = TestClient(create_app(svc), raise_server_exceptions=False)
    body = json.dumps(job_doc("big", search_space=_big_space(when_values)))
    assert len(body) > 50_000
    r = client.post(
        "/v1/studies", content=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert r.status_code == 201, r.text[:300]
    assert comparisons[0] <= 2 * CHOICES, comparisons[0]


def test_comparisons_double_when_the_choices_double(comparisons: list[int]) -> None:
    """Loading a space of n, then 2n choices (a `when` list of as many values against it):
    the comparisons at most double (they were n^2 / 2: they quadrupled)."""
    counts = []
    for n in (CHOICES // 4, CHOICES // 2):
        comparisons[0] = 0
        space = {
            "name": "n",
            "params": {
                "max-num-seqs": {"type": "categorical", "choices": list(range(n))},
                "block-size": {
                    "type": "categorical",
                    "choices": [16, 32],
                    "when": {"max-num-seqs": list(range(n))},
                },
            },
        }
        schema.load_space(space)
        counts.append(comparisons[0])
    assert counts[1] <= 2 * counts[0] + 10, counts


_VALUES: list[Any] = [
    True, False, 1, 0, 1.0, 0.0, -0.0, 2, 2.5, None, "1", "true", "", "a",
    2**53, float(2**53), 2**53 + 1, math.inf, -math.inf, math.nan,
]  # fmt: skip


def test_distinct_choices_mean_what_they_meant() -> None:
    """The set-based check agrees with ``_same`` on every pair: 1 and 1.0 are one value,
    ``true`` is not 1, NaN equals nothing; the first repeat is the one named."""
    for a in _VALUES:
        for b in _VALUES:
            same = schema._same(a, b)
            param = {"type": "categorical", "choices": [a, b]}
            if same:
                with pytest.raises(schema.SearchSpaceError, match="listed twice"):
                    schema.load_space({"name": "s", "params": {"max-num-seqs": param}})
            else:
                loaded = schema.load_space({"name": "s", "params": {"max-num-seqs": param}})
                choices = loaded.params["max-num-seqs"]
                assert isinstance(choices, schema.CategoricalParam)
                assert choices.outside([a, b]) == [v for v in (a, b) if v != v]  # NaN: none
    with pytest.raises(schema.SearchSpaceError, match=r"choice 1\.0 is listed twice"):
        schema.load_space(
            {"name": "s", "params": {"x": {"type": "categorical", "choices": [True, 1, 1.0]}}}
        )


# --- concurrent plan checks --------------------------------------------------------------------


class FakeSlowPlanCheck:
    """A FAKE plan check that holds every submission until :meth:`release`; counts those
    inside it."""

    def __init__(self) -> None:
        self.inside = 0
        self._lock = threading.Lock()
        self._entered = threading.Condition(self._lock)
        self._go = threading.Event()

    def __call__(self, _job: JobConfig, _base: Path) -> None:
        with self._lock:
            self.inside += 1
            self._entered.notify_all()
        assert self._go.wait(60), "never released"

    def wait_inside(self, n: int) -> None:
        with self._lock:
            assert self._entered.wait_for(lambda: self.inside >= n, timeout=60), self.inside

    def release(self) -> None:
        self._go.set()


TOKENS = {"alpha": "tok-alpha", "beta": "tok-beta"}


def _headers(team: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[team]}"}


@pytest.fixture
def held(tmp_path: Path) -> tuple[TestClient, JobService, FakeSlowPlanCheck]:
    """Two teams on a service that checks at most 2 submissions of a team and 3 in all."""
    settings = ServiceSettings(
        database_url=f"sqlite:///{tmp_path / 'service.db'}",
        data_dir=str(tmp_path / "data"),
        trace_roots=(str(TRACES),),
        tokens=tuple(TokenEntry(hash_token(t), team) for team, t in TOKENS.items()),
        allow_hub_models=True,
        max_plan_checks=3,
        max_plan_checks_per_team=2,
    )
    store = JobStore(settings.database_url)
    check = FakeSlowPlanCheck()
    svc = JobService(settings, store, Scheduler(store, FakeLauncher()), check_plan=check)
    return TestClient(create_app(svc), raise_server_exceptions=False), svc, check


def test_a_teams_next_concurrent_plan_check_is_a_429_with_retry_after(
    held: tuple[TestClient, JobService, FakeSlowPlanCheck],
) -> None:
    client, svc, check = held

    def submit(team: str) -> Any:
        return client.post("/v1/studies", json=job_doc(f"{team}-job"), headers=_headers(team))

    with ThreadPoolExecutor(4) as pool:
        running: list[Future[Any]] = [pool.submit(submit, "alpha") for _ in range(2)]
        check.wait_inside(2)
        try:
            r = submit("alpha")  # the team's third at once
            assert r.status_code == 429, r.text[:300]
            assert int(r.headers["Retry-After"]) >= 1
            assert "team alpha" in r.json()["detail"] and "at most 2" in r.json()["detail"]
            running.append(pool.submit(submit, "beta"))  # another team still gets in
            check.wait_inside(3)
            r = submit("beta")  # the service's fourth at once
            assert r.status_code == 429 and "Retry-After" in r.headers, r.text[:300]
            assert "3 in all" in r.json()["detail"]
            assert svc.checks.running() == 3 and svc.checks.running("alpha") == 2
        finally:
            check.release()
        assert [f.result().status_code for f in running] == [201, 201, 201]
    assert svc.checks.running() == 0
    assert sorted(rec.owner for rec in svc.store.records()) == ["alpha", "alpha", "beta"]
    assert submit("alpha").status_code == 201  # the slots are given back


def test_a_refused_submission_gives_its_slot_back(
    held: tuple[TestClient, JobService, FakeSlowPlanCheck],
) -> None:
    client, svc, check = held
    check.release()
    for _ in range(3):
        r = client.post("/v1/studies", json=job_doc("bad", trials=0), headers=_headers("alpha"))
        assert r.status_code == 422, r.text[:300]
    assert svc.checks.running() == 0
    r = client.post("/v1/studies", json=job_doc("ok"), headers=_headers("alpha"))
    assert r.status_code == 201, r.text[:300]
