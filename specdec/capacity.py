"""Cache capacity: how many KV slots per sequence a request gets.

A fixed-shape forward is built for one cache (its capacity S is part of its shapes), so with static
shapes the decoder keeps one ``KVCache`` per (batch size, capacity) and picks capacities from a few
buckets: the smallest of ``cache_buckets`` (default ``default_cache_buckets``) that holds
``need = longest prompt + max_new_tokens + tree_size`` slots, or ``max_cache_len`` when given, or
(dynamic shapes and neither option) exactly ``need``. A shared prompt's rows and its batch-1 prompt
cache get their capacities by the same rule. ``CacheCapacity`` holds these rules for ``SpecDecoder``;
``warmup`` uses them to list what later calls will get.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from specdec import hf

__all__ = ["MIN_CACHE_BUCKET", "CacheCapacity", "checked_buckets", "default_cache_buckets"]

#: The smallest KV capacity (slots per sequence) of the default cache buckets.
MIN_CACHE_BUCKET = 1024
_UNBOUNDED_TOP = 1 << 20  # the largest default bucket of a target that declares no context length

_log = logging.getLogger("specdec.engine")


def default_cache_buckets(max_positions: int | None, tree_size: int) -> tuple[int, ...]:
    """The default KV capacities (slots per sequence) a decoder with static shapes picks from.

    Powers of two from ``MIN_CACHE_BUCKET`` below the target's context length ``max_positions``,
    then ``max_positions + tree_size`` (the most a request can need: the context plus one tree);
    for a target without a declared context, powers of two up to 2**20. E.g. a 32768-position
    target at ``tree_size=64``: 1024, 2048, 4096, 8192, 16384, 32832; a 4096-position one: 1024,
    2048, 4160. A request uses the smallest bucket it fits, so it allocates at most about twice the
    slots it needs, and a decoder meets at most ``log2(context / 1024) + 1`` capacities, each
    captured / compiled once.
    """
    if max_positions is not None and (not isinstance(max_positions, int) or max_positions < 1):
        raise ValueError(f"max_positions: expected None or an int >= 1, got {max_positions!r}")
    if not isinstance(tree_size, int) or tree_size < 0:
        raise ValueError(f"tree_size: expected an int >= 0, got {tree_size!r}")
    limit = _UNBOUNDED_TOP if max_positions is None else max_positions
    out = []
    size = MIN_CACHE_BUCKET
    while size < limit:
        out.append(size)
        size *= 2
    out.append(size if max_positions is None else max_positions + tree_size)
    return tuple(out)


def checked_buckets(buckets, least: int) -> tuple[int, ...]:
    """``cache_buckets`` sorted, or ValueError unless it is a non-empty sequence of ints >= least."""
    ok = isinstance(buckets, Sequence) and not isinstance(buckets, str) and len(buckets) > 0 and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= least for b in buckets)  # fmt: skip
    if not ok:
        raise ValueError(
            f"cache_buckets: expected a non-empty sequence of ints >= {least} (tree_size + 2), got {buckets!r}"
        )
    return tuple(sorted(set(buckets)))


class CacheCapacity:
    """The capacity rules of ``SpecDecoder`` (a base class of it): reads the decoder's
    ``max_cache_len``, ``cache_buckets``, ``tree_size``, ``static_shapes``, ``shared_prefix`` and
    ``target``."""

    def _capacity(self, need: int, arg: str = "max_new_tokens",
                  what: str = "prompt + max_new_tokens + tree_size") -> int:  # fmt: skip
        """The cache capacity of a request needing ``need`` slots per sequence (ValueError naming
        ``arg`` if none fits)."""
        if self.max_cache_len is not None:
            if need > self.max_cache_len:
                raise ValueError(
                    f"{arg}: {what} needs {need} cache slots per sequence, max_cache_len is {self.max_cache_len}"
                )
            return self.max_cache_len
        if self.cache_buckets is None:
            return need
        for capacity in self.cache_buckets:
            if need <= capacity:
                return capacity
        raise ValueError(
            f"{arg}: {what} needs {need} cache slots per sequence, the largest of cache_buckets is "
            f"{self.cache_buckets[-1]}"
        )

    def _shared_capacities(self, prompts: list[torch.Tensor], copies: int, max_new_tokens: int,
                           need: int) -> tuple[int, int] | None:  # fmt: skip
        """``(C, S)`` when a call of ``prompts`` x ``copies`` sequences needing ``need`` positions each
        decodes on the shared prompt -- ``shared_prefix`` on, one prompt of >= 2 tokens, ``copies >
        1``, and a target the cascade serves over the call's context (``need``; with static shapes
        ``C + S``, the slots the fixed-shape forward reads) --, else None (the copy layout; with
        ``shared_prefix=True`` an unserved context raises). C: the capacity of the prompt's batch-1
        cache (for its ``len - 1`` tokens), S: of the rows' cache (``1 + max_new_tokens + tree_size``)."""
        if not self.shared_prefix or copies == 1 or len(prompts) != 1 or len(prompts[0]) == 1:
            return None
        prompt_cap = self._capacity(len(prompts[0]) - 1, "input_ids", "the shared prompt but its last token")
        rows_cap = self._capacity(1 + max_new_tokens + self.tree_size,
                                  what="1 + max_new_tokens + tree_size (a shared prompt's rows)")  # fmt: skip
        context = prompt_cap + rows_cap if self.static_shapes else need
        obstacle = hf.shared_prefix_obstacle(self.target, context)
        if obstacle is not None and self._shared_required:
            raise ValueError(f"shared_prefix: True needs a target the cascade attention serves over this call's "
                             f"{context} positions, got one with {obstacle}")
        if obstacle is not None:
            _log.info("specdec: %d sequences of one prompt keep a copy of it each: the target has %s", copies, obstacle)
            return None
        return prompt_cap, rows_cap

    def _warm_capacities(self, max_len: int | None, min_len: int | None = None) -> list[int]:
        """The cache capacities requests of ``min_len`` (None: any) to ``max_len`` (None: any) tokens
        per sequence can get: the same rule as ``generate``'s (``_capacity`` of the tokens + tree_size)."""
        if max_len is None:
            if self.max_cache_len is not None:
                return [self.max_cache_len]
            if self.cache_buckets is None:
                return [self.tree_size + 2 if min_len is None else min_len + self.tree_size]
            caps = list(self.cache_buckets)
        else:
            top = self._capacity(max_len + self.tree_size, "max_len", "max_len + tree_size")
            if self.cache_buckets is None:
                return [top]
            caps = [c for c in self.cache_buckets if c <= top]
        if min_len is not None:
            low = self._capacity(min_len + self.tree_size, "min_len", "min_len + tree_size")
            caps = [c for c in caps if c >= low]
        return caps

    def _warm_shared_capacities(self, max_len: int | None, min_len: int | None,
                                new_tokens: int) -> tuple[int, list[int]]:  # fmt: skip
        """``(S, [C, ...])`` of calls with ``max_new_tokens = new_tokens`` over one shared prompt of
        ``min_len - new_tokens`` (None: 2) to ``max_len - new_tokens`` (None: up to the target's context)
        tokens: the rows' capacity and every prompt capacity, by ``generate``'s rule
        (``_shared_capacities``); prompt capacities whose pair the cascade does not serve are left out."""
        rows_cap = self._capacity(1 + new_tokens + self.tree_size, "new_tokens",
                                  "1 + new_tokens + tree_size (a shared prompt's rows)")  # fmt: skip
        what = "the shared prompt but its last token"
        low = 1 if min_len is None else max(min_len - new_tokens - 1, 1)  # P = prompt length - 1
        if max_len is not None:
            high = max_len - new_tokens - 1
            if high < 1:  # one-token prompts only: nothing to share
                return rows_cap, []
            top = self._capacity(high, "max_len", what)
        else:
            limit = hf.max_positions(self.target)
            high = None if limit is None else max(limit - new_tokens - 1, 1)
            top = None
        if self.max_cache_len is not None:
            caps = [self.max_cache_len]
        elif self.cache_buckets is None:  # exact sizes (nothing kept): one prompt of the longest length
            caps = [top if top is not None else (high or low)]
        else:
            least = self._capacity(low, "min_len", what)
            caps = [c for c in self.cache_buckets if c >= least and (top is None or c <= top)]
        served = [c for c in caps if hf.shared_prefix_obstacle(self.target, c + rows_cap) is None]
        if len(served) < len(caps):
            _log.info("specdec warmup: no shared-prompt forward over prompt caches of %s slots: the cascade does not "
                      "serve their context (those calls keep a copy of the prompt per sequence)",
                      sorted(set(caps) - set(served)))  # fmt: skip
        return rows_cap, served
