"""The control messages rank 0 broadcasts to the other ranks: one frozen record per kind, dispatched by type.

  Step           apply `ops`, then run the forward of this packed step (the inputs rank 0's runner built)
  MemoryRequest  apply `ops`, then send the store's StoreMemory back (stats())
  Ping           nothing: rank 0 is idle, and says so before the others' receive times out
  Stop           apply `ops`, then leave the worker loop (rank 0's engine closed)

`ops` are the store operations (mirror.py) rank 0's scheduler made since the last message, in order. Handles
are rank 0's; a replica maps them to its own. Every field is a tuple of ints (or of such tuples), so a message
pickles small and compares by value.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mirror import StoreOp


@dataclass(frozen=True)
class Step:
    """One packed step as the other ranks rebuild it."""

    ops: tuple[StoreOp, ...]
    decodes: tuple[tuple[int, int], ...]  # (handle, tokens computed) per decode row
    prefills: tuple[tuple[int, int, int], ...]  # (handle, first token, tokens) per prefill chunk
    input_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    logits_to_keep: tuple[int, ...]


@dataclass(frozen=True)
class MemoryRequest:
    ops: tuple[StoreOp, ...] = ()


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Stop:
    ops: tuple[StoreOp, ...] = ()


Message = Step | MemoryRequest | Ping | Stop
MESSAGE_TYPES = (Step, MemoryRequest, Ping, Stop)
