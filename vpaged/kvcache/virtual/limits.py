"""The limits a host VirtualKVCache meets, checked when it is created rather than mid-serving.

1. Address space: a cache reserves max_seqs * max_seq_len tokens of every layer up front; a 64-bit process
   has 128 TiB of user address space. check_address_space says what was asked and what can be reserved.
2. Mappings (vm.max_map_count, 65,530 by default): the host backend maps a range once and gives a slot a
   mapping of its own only where it shows a page shared with another slot (host_backend.cpp), so pages that
   are private cost none, and a sequence sharing pages costs up to 2 mappings per page run it shares
   (a run: the pages of one region, and of one head for head_major). check_mappings warns when max_seqs
   sequences sharing at once could exceed the limit.
"""

from __future__ import annotations

import warnings

from ...errors import AddressSpaceError, MappingLimitWarning
from ...memory.limits import gib, mapping_count, mapping_limit, reservable_bytes
from .layout import Layout


def check_address_space(layout: Layout) -> None:
    """Raise AddressSpaceError, naming what was asked and what can be reserved, when the cache's range cannot
    be reserved."""
    asked = layout.total_bytes
    can = reservable_bytes()
    if asked <= can:
        return
    per_seq = layout.regions * layout.slot_bytes
    raise AddressSpaceError(
        f"the cache needs {gib(asked)} of virtual address space ({layout.max_seqs:,} sequences x "
        f"{layout.max_seq_len:,} tokens, {gib(per_seq)} reserved per sequence) but this process can reserve at most "
        f"{gib(can)} in one piece (128 TiB of user address space). Address space is reserved up front, memory is "
        f"not: lower max_seqs or max_seq_len so that max_seqs * max_seq_len <= "
        f"{can // max(1, per_seq // layout.max_seq_len):,} tokens."
    )


def worst_case_mappings(layout: Layout) -> int:
    """Host mappings of one cache when every sequence shares pages in every run (private pages cost none)."""
    return 1 + 2 * layout.max_seqs * layout.runs


def check_mappings(layout: Layout) -> None:
    """Warn (MappingLimitWarning) when max_seqs sequences sharing pages at once could exceed vm.max_map_count."""
    worst = worst_case_mappings(layout)
    limit, used = mapping_limit(), mapping_count()
    room = limit - used
    if worst <= room:
        return
    sharers = max(0, (room - 1) // (2 * layout.runs))
    warnings.warn(
        MappingLimitWarning(
            f"with the {layout.kind} layout a sequence that shares pages (fork, prefix hit, reorder) takes up to "
            f"{2 * layout.runs:,} host mappings (2 per page run; {layout.runs:,} runs per sequence), "
            f"so {layout.max_seqs:,} sharing sequences could take {worst:,} but vm.max_map_count leaves "
            f"{room:,} ({limit:,}, {used:,} in use): "
            f"about {sharers:,} sequences can share pages at once. Pages that are not shared take none. To share more: "
            f"a layout with fewer runs (per_layer: {2 * layout.num_layers:,}, interleaved: 1), fewer max_seqs, or "
            f"sysctl vm.max_map_count={worst + used:,}."
        ),
        stacklevel=3,
    )


def check_cache(layout: Layout, device) -> None:
    """The construction-time checks of a host cache (CUDA has its own address space and no mapping limit)."""
    if device.type != "cpu":
        return
    check_address_space(layout)
    check_mappings(layout)
