"""What the trackers' backends share: a key per tag that the tracker accepts, and the families of
tags whose x axis is declared as the optimizer step."""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable

STEP_METRIC = "optimizer/step"
"""The key that carries the monitor's x axis in the rows of trackers that take several x axes."""


def digest(tag: str) -> str:
    """8 hex digits of the SHA-1 of ``tag``."""
    return hashlib.sha1(tag.encode()).hexdigest()[:8]


def shorten(key: str, tag: str, limit: int) -> str:
    """``key`` itself if it has at most ``limit`` characters, else its beginning (5/8 of the room)
    and end joined by ``-``, 8 hex digits of ``tag``'s SHA-1 and ``-``: ``limit`` characters that
    stay apart for tags that differ only in the middle."""
    if len(key) <= limit:
        return key
    head = (limit - 10) * 5 // 8
    return f"{key[:head]}-{digest(tag)}-{key[len(key) - (limit - 10 - head):]}"


class Keys:
    """The key of each tag in one run: the same at every step, and no other tag's.

    ``valid(tag)`` makes a key the tracker accepts (at most ``limit`` characters); a key that an
    earlier tag already has gets ``-`` and 8 hex digits of the later tag's SHA-1 instead of its end.

    Example: ``Keys(lambda tag: tag.replace("@", "_"), 250)("fc.weight@group1")`` is ``"fc.weight_group1"``.
    """

    def __init__(self, valid: Callable[[str], str], limit: int) -> None:
        self._valid, self._limit = valid, limit
        self._keys: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, tag: str) -> str:
        key = self._keys.get(tag)
        if key is None:
            key = self._valid(tag)
            if key in self._taken:
                key = f"{key[:self._limit - 9]}-{digest(tag)}"
            self._keys[tag] = key
            self._taken.add(key)
        return key

    def rename(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` under their keys."""
        return {self(tag): value for tag, value in metrics.items()}


class Families:
    """The families of keys (``update_to_data`` of ``update_to_data/fc1.weight``) seen so far, so that
    each family's x axis is declared once, before its first row."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def new(self, keys: Iterable[str]) -> list[str]:
        """The families of ``keys`` not seen before, sorted; they count as seen from now on."""
        families = {key.split("/", 1)[0] for key in keys if "/" in key} - self._seen
        self._seen |= families
        return sorted(families)
