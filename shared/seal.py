"""Sealed reasoning: the opaque blob that carries a model's reasoning through a stateless client.

Owns: `Sealer` (seal a reasoning span's text; open a blob a client sent back) and key generation.
Anthropic's thinking `signature` and Responses' `encrypted_content` are both this blob: the text,
encrypted and authenticated with AES-256-GCM (the `cryptography` library) under the deployment's key.
A client that sends the blob back (Codex runs with `store: false`; Claude Code sends thinking blocks
back in its history, with `display: "omitted"` even without their text) gets that reasoning restored
into the prompt; a tampered, foreign or stale-key blob opens to None and its block is dropped from the
prompt (never a 400). Encryption rather than a bare HMAC because an omitted-display block has no text
to verify: the blob must carry it.
Must not: do I/O. The key lives in Redis (`shared.keys.SEAL_KEY`, created once by whichever role starts
first), so every API node and worker of a deployment seals and opens alike.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import replace
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shared.ir import Message, Request

_MAGIC = b"met1"  # format version; a blob without it is not ours
_AAD = b"metrale-reasoning"
_NONCE = 12


def new_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


class Sealer:
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, text: str) -> str:
        nonce = os.urandom(_NONCE)
        blob = _MAGIC + nonce + self._aead.encrypt(nonce, text.encode(), _AAD)
        return base64.b64encode(blob).decode()

    def open(self, sealed: str) -> str | None:
        """The sealed text, or None when the blob is not one of this key's."""
        try:
            blob = base64.b64decode(sealed.encode(), validate=True)
        except (binascii.Error, ValueError):
            return None
        if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _NONCE + 16:
            return None
        nonce, body = blob[len(_MAGIC) : len(_MAGIC) + _NONCE], blob[len(_MAGIC) + _NONCE :]
        try:
            return self._aead.decrypt(nonce, body, _AAD).decode()
        except (InvalidTag, UnicodeDecodeError):
            return None


async def load_sealer(redis: Any, key_name: str) -> Sealer:
    """The deployment's sealer: the key in Redis, created by the first role to ask (SET NX)."""
    await redis.set(key_name, new_key(), nx=True)
    return Sealer(bytes(await redis.get(key_name)))


def open_reasoning(request: Request, sealer: Sealer | None) -> Request:
    """Sealed reasoning the client sent back → `Message.reasoning`. A blob that does not open with this
    deployment's key, or whose shown text differs from what it seals, is dropped (its reasoning does not
    reach the prompt); with no sealer every sealed span is dropped."""
    if not any(m.sealed_reasoning for m in request.messages):
        return request
    messages = tuple(_opened(m, sealer) if m.sealed_reasoning else m for m in request.messages)
    return replace(request, messages=messages)


def _opened(message: Message, sealer: Sealer | None) -> Message:
    texts = [message.reasoning] if message.reasoning else []
    for shown, blob in message.sealed_reasoning:
        text = sealer.open(blob) if sealer is not None else None
        if text is not None and (not shown or shown == text):
            texts.append(text)
    return replace(message, reasoning="".join(texts) or None, sealed_reasoning=())
