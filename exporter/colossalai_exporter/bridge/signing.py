"""Standard Webhooks signatures (https://www.standardwebhooks.com/).

Headers ``webhook-id``, ``webhook-timestamp`` (Unix seconds) and
``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``. A
secret written ``whsec_<base64>`` is base64-decoded first, as the Standard
Webhooks libraries do; any other secret is used as its UTF-8 bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac


def signing_key(secret: bytes) -> bytes:
    if secret.startswith(b"whsec_"):
        try:
            return base64.b64decode(secret[len(b"whsec_"):], validate=True)
        except binascii.Error:
            pass
    return secret


def signature(secret: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(signing_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(secret: bytes, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, message_id, timestamp, body),
    }


def verify(secret: bytes, message_id: str, timestamp: int, body: bytes, header: str) -> bool:
    """True when one of the space-separated signatures in ``header`` is valid."""
    expected = signature(secret, message_id, timestamp, body)
    return any(hmac.compare_digest(expected, given) for given in header.split())
