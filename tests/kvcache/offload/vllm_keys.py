"""What the differential tests against vLLM's offloading managers share: chunk keys (key
`10 * depth + variant`, so prefixes are shared) as vLLM's offload keys, their end positions
in tokens, and a request's context. Imports vLLM: use from a module that skips without it."""

from __future__ import annotations

from vllm.v1.kv_offload import base as vbase

TOKENS_PER_CHUNK = 16


def vkey(key: int) -> bytes:
    return vbase.make_offload_key(key.to_bytes(8, "big"), 0)


def vkeys(keys: list[int]) -> list[bytes]:
    return [vkey(k) for k in keys]


def positions(keys: list[int]) -> list[int]:
    """Each key's chunk end, in tokens (its depth + 1 chunks)."""
    return [(k // 10 + 1) * TOKENS_PER_CHUNK for k in keys]


def keys_of(variants: list[int]) -> list[int]:
    """The keys of a request's chunks: depth d takes variant `variants[d]`."""
    return [10 * d + v for d, v in enumerate(variants)]


def context(rid: str, keys: list[int]) -> vbase.ReqContext:
    """vLLM's context of a request with these chunks (as RequestOffloadState.update_offload_keys)."""
    ctx = vbase.ReqContext(req_id=rid)
    for key, pos in zip(keys, positions(keys), strict=True):
        ctx.set_offload_key_position(vkey(key), pos)
    return ctx
