"""Who is asking: bearer tokens that belong to teams, kept as SHA-256 digests.

A token file holds one token a line, as ``TEAM DIGEST_OR_TOKEN [admin]``:

.. code-block:: text

    # team   token (sha256:HEX: its digest, so the file never holds the token)   role
    search   sha256:<64 hex digits>
    ranking  sha256:<64 hex digits>
    ops      sha256:<64 hex digits> admin

A line with a single word is a token of the team ``default`` (the file format of earlier
versions), as is every token of ``$VLLM_AUTOTUNE_TOKENS`` (comma separated; ``TEAM:TOKEN``
names the team). A team sees, cancels and exports its own studies; an ``admin`` token sees
all. ``vllm-autotune token --team NAME`` makes a token and prints its line.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from optimizer.errors import ConfigError

__all__ = [
    "DEFAULT_TEAM",
    "Principal",
    "TokenEntry",
    "authenticate",
    "hash_token",
    "parse_token_env",
    "parse_token_lines",
    "read_token_file",
]

DEFAULT_TEAM = "default"
_TEAM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")


def hash_token(token: str) -> str:
    """SHA-256 hex digest of a bearer token (what the service keeps)."""
    return hashlib.sha256(token.strip().encode()).hexdigest()


@dataclass(frozen=True)
class TokenEntry:
    """One accepted token.

    Attributes:
        digest: SHA-256 hex digest of the token.
        team: The team it belongs to.
        admin: It sees every team's studies.
    """

    digest: str
    team: str = DEFAULT_TEAM
    admin: bool = False


@dataclass(frozen=True)
class Principal:
    """The caller of a request.

    Attributes:
        team: Its team (the owner of what it submits).
        admin: It sees, cancels and exports every study.
    """

    team: str
    admin: bool = False

    def may_see(self, owner: str) -> bool:
        """This caller may read and act on a study owned by ``owner``."""
        return self.admin or owner == self.team


def _entry(team: str, secret: str, role: str | None, where: str) -> TokenEntry:
    if not _TEAM.match(team):
        raise ConfigError(f"{where}: team names are letters, digits, '_', '.', '-' (<= 64)")
    if role not in (None, "admin"):
        raise ConfigError(f"{where}: the third word may only be 'admin'")
    m = _DIGEST.match(secret)
    digest = m.group(1).lower() if m else hash_token(secret)
    return TokenEntry(digest=digest, team=team, admin=role == "admin")


def parse_token_lines(text: str, source: str = "token file") -> list[TokenEntry]:
    """Entries of a token file (see the module's doc).

    Raises:
        ConfigError: A line of more than three words, a bad team name or role (the message
            gives the line number, never the line).
    """
    entries: list[TokenEntry] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{source}, line {number}"
        if len(words) == 1:
            entries.append(_entry(DEFAULT_TEAM, words[0], None, where))
        elif len(words) in (2, 3):
            entries.append(_entry(words[0], words[1], words[2] if len(words) == 3 else None, where))
        else:
            raise ConfigError(f"{where}: expected TEAM TOKEN [admin]")
    return entries


def read_token_file(path: str | Path) -> list[TokenEntry]:
    """:func:`parse_token_lines` of a file.

    Raises:
        ConfigError: The file cannot be read, or a line is malformed.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the token file ({exc.strerror})") from exc
    return parse_token_lines(text, str(path))


def parse_token_env(value: str | None) -> list[TokenEntry]:
    """Entries of ``$VLLM_AUTOTUNE_TOKENS``: ``TOKEN`` or ``TEAM:TOKEN``, comma/space separated."""
    entries: list[TokenEntry] = []
    for number, item in enumerate((t for t in re.split(r"[\s,]+", value or "") if t), 1):
        team, sep, secret = item.partition(":")
        where = f"VLLM_AUTOTUNE_TOKENS, item {number}"
        if sep and not secret.startswith("sha256") and _TEAM.match(team):
            entries.append(_entry(team, secret, None, where))
        else:
            entries.append(_entry(DEFAULT_TEAM, item, None, where))
    return entries


def authenticate(presented: str | None, entries: Iterable[TokenEntry]) -> Principal | None:
    """The caller a token belongs to, or None (constant-time comparisons against every entry)."""
    if not presented:
        return None
    mine = hash_token(presented)
    found: TokenEntry | None = None
    for entry in entries:
        # Compare against every digest so the time does not say which one matched.
        if hmac.compare_digest(mine, entry.digest) and found is None:
            found = entry
    return Principal(team=found.team, admin=found.admin) if found is not None else None
