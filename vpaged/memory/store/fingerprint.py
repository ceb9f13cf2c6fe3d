"""StoreFingerprint: what makes two KV pages of the same tokens interchangeable, and the chain keys of pages.

Note (why the key chains a fingerprint). A page store is shared by processes that may serve different models,
dtypes, KV formats or page sizes. The bytes of a KV page depend on all of them, not only on the token ids, so
a key is the chain hash of (fingerprint digest; the token ids of every page before it; this page's token ids):

    key[0] = H(digest(fingerprint), tokens of page 0)
    key[d] = H(key[d - 1],          tokens of page d)

The same token ids under another fingerprint give other keys from the first page on: a process can never hit
(and so never map) a page it did not ask for. H is blake2b with a 32-byte digest (a collision is not a
practical concern at that size; the store keeps no token ids to compare), with a personalization string per
use so a key is never confused with a digest. The digest of a fingerprint is stable across processes,
restarts and Python versions: its fields are encoded canonically (sorted JSON), never with hash().
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ...errors import InvalidArgumentError
from .layout import KEY_BYTES

_FORMAT = 1  # bump if the encoding below changes: old keys then miss instead of meaning something else


@dataclass(frozen=True)
class StoreFingerprint:
    """The identity of the KV a page holds. weights: the model weights' identity (a content digest or a name
    with its revision); num_layers / num_kv_heads / head_dim: the KV geometry; layout: how rows lie in a page
    (the cache's layout name); page_bytes: the KV page size; kv_format: the element format ("fp32", "bf16",
    "int8", ...); scales: the identity of the quantization scales, "" where the format has none; extra: any
    further (key, value) strings that change the bytes (a rope scaling, a tokenizer revision)."""

    weights: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    page_bytes: int
    kv_format: str
    scales: str = ""
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self):
        for name in ("weights", "layout", "kv_format", "scales"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(f"StoreFingerprint.{name} is a str, got {getattr(self, name)!r}")
        if not self.weights:
            raise InvalidArgumentError("StoreFingerprint.weights names the model weights; got an empty string")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"StoreFingerprint.{name} is a positive int, got {value!r}")
        try:
            extra = tuple(sorted((str(k), str(v)) for k, v in dict(self.extra).items()))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"StoreFingerprint.extra is (key, value) pairs, got {self.extra!r}") from None
        object.__setattr__(self, "extra", extra)

    def digest(self) -> bytes:
        """32 bytes naming this fingerprint, the same in every process and run."""
        fields = asdict(self)
        fields["extra"] = [list(p) for p in self.extra]
        text = json.dumps({"format": _FORMAT, **fields}, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES, person=b"vpaged-kv-fp").digest()

    def keys(self, tokens: Sequence[int], tokens_per_page: int) -> list[bytes]:
        """The key of each complete page of `tokens` where a page holds exactly tokens_per_page tokens (the
        partial last page has none: it is not a page of the store until it is full)."""
        if not isinstance(tokens_per_page, int) or isinstance(tokens_per_page, bool) or tokens_per_page <= 0:
            raise InvalidArgumentError(f"tokens_per_page is a positive int, got {tokens_per_page!r}")
        full = len(tokens) // tokens_per_page
        return chain_keys(self, (tokens[i * tokens_per_page : (i + 1) * tokens_per_page] for i in range(full)))


def chain_keys(fingerprint: StoreFingerprint, windows: Iterable[Sequence[int]]) -> list[bytes]:
    """The chained key of each page whose token ids are the successive `windows` (the token ids with bytes in
    that page, as the prefix index cuts them: kvcache/virtual/prefix.py, where a straddling token belongs to
    two windows)."""
    if not isinstance(fingerprint, StoreFingerprint):
        raise InvalidArgumentError(f"chain_keys needs a StoreFingerprint, got {type(fingerprint).__name__}")
    out, parent = [], fingerprint.digest()
    for window in windows:
        ids = np.asarray(window, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidArgumentError(f"a page's token window is a non-empty 1-d sequence of ids, got {window!r}")
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"vpaged-kv-page")
        h.update(ids.astype("<i8", copy=False).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


def page_key(block_key: bytes, part: int) -> bytes:
    """The store key of page `part` of a block whose chain key is block_key: a block that spans several pages
    (one per layer, one per run of a cache slot) has one key per page, each derived from the block's."""
    h = hashlib.blake2b(block_key, digest_size=len(block_key), person=b"vpaged-kv-run")
    h.update(int(part).to_bytes(8, "little"))
    return h.digest()


def tail_key(fingerprint: StoreFingerprint, parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a block that is not full: the last block of one exact prompt, after the full blocks whose
    last chain key is `parent` (None: there are none). A personalization of its own keeps it apart from every
    full block's key; a prefill hands such a block to the decode instance of the same request (the vLLM
    connector), no other prompt ever asks for it."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidArgumentError(f"a tail block's token ids are a non-empty 1-d sequence, got {tokens!r}")
    h = hashlib.blake2b(parent or fingerprint.digest(), digest_size=KEY_BYTES, person=b"vpaged-kv-tail")
    h.update(ids.astype("<i8", copy=False).tobytes())
    return h.digest()
