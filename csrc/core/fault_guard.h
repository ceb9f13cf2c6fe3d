// The fault guard: shared file mappings whose file someone may truncate under them, kept from killing the process.
//
// A load or store past the end of a file mapped MAP_SHARED or MAP_PRIVATE raises SIGBUS, whose default action kills
// the process. The files vpaged maps from outside its own memory (a budget ledger, a page store's data file) can be
// truncated by anyone who may write them. So the address spans that show such a file are registered here; a SIGBUS
// at an address inside one is answered by mapping an anonymous zero page over the faulting OS page, the span is
// marked damaged, and the access completes on zeros. The owner of the span then reads damaged() and raises a typed
// error (the ledger's checksums fail; a page store's pages are given up). A fault anywhere else goes to the handler
// installed before this one (pytest's faulthandler, say), or, when there was none, kills the process as it would
// have. Wayland compositors guard their clients' shared buffers the same way.
#pragma once
#include <cstddef>
#include <cstdint>

namespace vpaged {

// Spans registered at once in a process.
constexpr int kMaxGuardedSpans = 4096;

// Registers [begin, end) and returns its slot, or -1 when kMaxGuardedSpans are registered. Installs the handler
// unless it is the current one (so a handler installed after ours is chained to, not left in front).
int guard_span(uintptr_t begin, uintptr_t end);
// The span goes; its slot may be reused. Call it before unmapping the span.
void unguard_span(int slot);
// Faults absorbed in the span since it was registered.
uint32_t span_faults(int slot);

}  // namespace vpaged
