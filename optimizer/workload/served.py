"""What a running server serves: the token ids a replay's prompts may use.

A replay against a server it did not start (``replay --url``) must still send token ids the
served model knows: vLLM rejects a prompt with an id past its vocabulary (HTTP 400, ``Token
id N is out of vocabulary``), so a wrong guess fails every request. :func:`served_token_range`
asks the server: ``/v1/models`` names the model's folder (``root``); when that folder is
readable here, its ``config.json`` gives the range (:func:`~optimizer.workload.prompts.model_info`,
the rule the tuner uses for servers it starts). Otherwise the largest id the server accepts is
found by bisection with one-token, one-output-token completions (about 20 tiny requests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from optimizer.errors import ConfigError, ReplayError
from optimizer.workload.prompts import TokenRange

__all__ = ["served_token_range"]

# Ids below 256 are the byte tokens of byte-level tokenizers (and of the project's generated
# models); prompts start above them, as prompts.model_info does.
_LOW = 256
_MAX_ID = 1 << 22


def _model_root(client: httpx.Client, model: str) -> str | None:
    response = client.get("/v1/models")
    if response.status_code != 200:
        return None
    try:
        cards: list[dict[str, Any]] = list(response.json().get("data") or [])
    except (ValueError, AttributeError):
        return None
    card = next((c for c in cards if c.get("id") == model), None)
    if card is None and len(cards) == 1:
        card = cards[0]
    root = card.get("root") if card else None
    return str(root) if root else None


def _accepts(client: httpx.Client, model: str, token_id: int) -> bool:
    """True when the server accepts a one-token prompt ``[token_id]``."""
    body = {"model": model, "prompt": [token_id], "max_tokens": 1, "temperature": 0.0}
    response = client.post("/v1/completions", json=body)
    if response.status_code == 200:
        return True
    if response.status_code == 400:
        return False
    raise ReplayError(
        f"probing the vocabulary: HTTP {response.status_code} for token id {token_id}: "
        f"{response.text[:200]}"
    )


def served_token_range(
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 60.0,
) -> tuple[TokenRange, str]:
    """Token ids a prompt may use on the server at ``url``, and where that came from.

    Args:
        url: Base URL of the server.
        model: Served model name.
        api_key: Bearer token, when the server wants one.
        transport: httpx transport (a seam for tests).
        timeout_s: Timeout of each request.

    Returns:
        The range and a sentence saying how it was found.

    Raises:
        ReplayError: The server cannot be asked, or accepts no id at all.
    """
    from optimizer.workload.prompts import model_info

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(
            base_url=url, headers=headers, transport=transport, timeout=timeout_s, trust_env=False
        ) as client:
            root = _model_root(client, model)
            if root is not None and (Path(root) / "config.json").is_file():
                try:
                    info = model_info(root)
                except ConfigError:
                    pass
                else:
                    return (
                        TokenRange(info.prompt_low, info.prompt_high),
                        f"token ids [{info.prompt_low}, {info.prompt_high}) from the model "
                        f"folder the server names ({root}, vocabulary {info.vocab_size})",
                    )
            if not _accepts(client, model, _LOW):
                raise ReplayError(f"{url} rejects a prompt of token id {_LOW}")
            good, bad = _LOW, _LOW * 2
            while bad < _MAX_ID and _accepts(client, model, bad):
                good, bad = bad, bad * 2
            while bad - good > 1:
                middle = (good + bad) // 2
                if _accepts(client, model, middle):
                    good = middle
                else:
                    bad = middle
    except httpx.HTTPError as exc:
        from optimizer.workload.replay_client import describe_error

        raise ReplayError(f"cannot ask {url} for its vocabulary: {describe_error(exc)}") from exc
    return (
        TokenRange(_LOW, good + 1),
        f"token ids [{_LOW}, {good + 1}): the largest id the server accepts is {good} "
        "(found by probing it)",
    )
