"""served_token_range: the model folder the server names, else probing what it accepts."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from optimizer.errors import ReplayError
from optimizer.workload.served import served_token_range


def vllm_like(vocab: int, root: str, probes: list[int]) -> httpx.MockTransport:
    """Answers /v1/models and rejects ids past ``vocab`` as vLLM does (HTTP 400)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served", "root": root}]})
        token = json.loads(request.content)["prompt"][0]
        probes.append(token)
        if token >= vocab:
            message = f"Token id {token} is out of vocabulary"
            return httpx.Response(400, json={"error": {"message": message}})
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    return httpx.MockTransport(handle)


def test_reads_the_model_folder_the_server_names(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096, "eos_token_id": 4094}))
    probes: list[int] = []
    token_range, how = served_token_range(
        "http://s", "served", transport=vllm_like(4096, str(tmp_path), probes)
    )
    assert (token_range.low, token_range.high) == (256, 4094)
    assert str(tmp_path) in how and probes == []


@pytest.mark.parametrize("vocab", [4096, 32_000, 151_936, 257])
def test_probes_the_largest_accepted_id_when_the_folder_is_elsewhere(vocab: int) -> None:
    probes: list[int] = []
    token_range, how = served_token_range(
        "http://s", "served", transport=vllm_like(vocab, "/not/here", probes)
    )
    assert (token_range.low, token_range.high) == (256, vocab)
    assert "probing" in how and len(probes) < 45


def test_a_server_that_accepts_nothing_is_an_error() -> None:
    with pytest.raises(ReplayError, match="rejects"):
        served_token_range("http://s", "served", transport=vllm_like(10, "/x", []))

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(ReplayError, match="ConnectError"):
        served_token_range("http://s", "served", transport=httpx.MockTransport(broken))
