"""HTTP basic authentication against bcrypt hashes, in constant time.

bcrypt is deliberately slow (about 0.1–0.3 s per check at cost 10–12), and
Prometheus sends the same credentials on every scrape, so a successful check
is cached under a keyed digest of (user, password); the password itself is
never kept. Unknown users are checked against a dummy hash so that response
time does not reveal which user names exist.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading

import bcrypt


def _dummy_hash_like(hashes: list[bytes]) -> bytes:
    """A valid bcrypt hash of a random password, at the cost of the configured ones.

    Unknown users are checked against it so that they cost the same as known ones.
    Made only when users are configured: at about 0.1 s, it used to be most of
    the node agent's start-up time as a module-level constant.
    """
    rounds = 10
    for hashed in hashes:
        parts = hashed.split(b"$")  # b"", b"2b", b"12", salt+digest
        if len(parts) == 4 and parts[2].isdigit():
            rounds = max(rounds, min(int(parts[2]), 16))
    return bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(rounds=rounds))


def parse_basic_authorization(header: str | None) -> tuple[str, str] | None:
    """``Basic <base64 user:password>`` -> (user, password); None when absent or malformed."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


class BasicAuthenticator:
    """Checks credentials against ``basic_auth_users`` from the web config."""

    def __init__(self, users: dict[str, bytes]) -> None:
        self._users = dict(users)
        self._dummy_hash = _dummy_hash_like(list(self._users.values())) if users else b""
        self._cache_key = secrets.token_bytes(32)
        self._verified: set[bytes] = set()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def check(self, authorization: str | None) -> bool:
        """True when the Authorization header carries a configured user's password."""
        if not self._users:
            return True
        creds = parse_basic_authorization(authorization)
        if creds is None:
            return False
        user, password = creds
        hashed = self._users.get(user)
        digest = hmac.new(self._cache_key, b"\0".join(
            [user.encode(), password.encode(), hashed or b""]), hashlib.sha256).digest()
        with self._lock:
            if digest in self._verified:
                return True
        ok = bcrypt.checkpw(password.encode(), hashed or self._dummy_hash) and hashed is not None
        if ok:
            with self._lock:
                if len(self._verified) > 1024:  # bound memory under credential churn
                    self._verified.clear()
                self._verified.add(digest)
        return ok


def constant_time_equals(given: str | None, expected: str) -> bool:
    """Compare a presented secret (a bearer token, say) without leaking its prefix."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())
