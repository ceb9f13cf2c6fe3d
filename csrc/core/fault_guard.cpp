#include "core/fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>

namespace vpaged {
namespace {

struct GuardedSpan {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint32_t> faults{0};
};

GuardedSpan g_spans[kMaxGuardedSpans];
std::atomic<int> g_high{0};   // slots below this may be in use: the handler scans no further
struct sigaction g_previous;  // the handler found when ours went in; faults outside our spans go there
uintptr_t g_page_size = 4096;

void chain(int sig, siginfo_t* info, void* context) {
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // No handler before ours: the default action. A fault re-executes the instruction and dies of it; a SIGBUS
  // sent by kill() is re-raised, blocked until this handler returns.
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  if (info == nullptr || info->si_code <= 0) raise(sig);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {  // raised by the kernel for an access, not sent by a process
    const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
    const int high = g_high.load(std::memory_order_acquire);
    for (int i = 0; i < high; ++i) {
      GuardedSpan& s = g_spans[i];
      const uintptr_t b = s.begin.load(std::memory_order_acquire);
      if (b == 0 || addr < b || addr >= s.end.load(std::memory_order_acquire)) continue;
      void* page = reinterpret_cast<void*>(addr & ~(g_page_size - 1));
      // mmap is a plain system call here (no allocation, no lock): safe in a handler in practice.
      if (mmap(page, g_page_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) !=
          MAP_FAILED) {
        s.faults.fetch_add(1, std::memory_order_acq_rel);
        return;
      }
      break;
    }
  }
  chain(sig, info, context);
}

void install_handler() {
  struct sigaction current{};
  sigaction(SIGBUS, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
  g_page_size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction ours{};
  ours.sa_sigaction = on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  g_previous = current;
  sigaction(SIGBUS, &ours, nullptr);
}

}  // namespace

int guard_span(uintptr_t begin, uintptr_t end) {
  install_handler();
  for (int i = 0; i < kMaxGuardedSpans; ++i) {
    if (g_spans[i].begin.load(std::memory_order_acquire) != 0) continue;
    // end first, then begin: the handler reads begin and only then end.
    g_spans[i].end.store(end, std::memory_order_release);
    g_spans[i].faults.store(0, std::memory_order_release);
    uintptr_t expected = 0;
    if (!g_spans[i].begin.compare_exchange_strong(expected, begin, std::memory_order_acq_rel)) continue;
    int high = g_high.load(std::memory_order_acquire);
    while (high < i + 1 && !g_high.compare_exchange_weak(high, i + 1, std::memory_order_acq_rel)) {
    }
    return i;
  }
  return -1;
}

void unguard_span(int slot) {
  if (slot >= 0 && slot < kMaxGuardedSpans) g_spans[slot].begin.store(0, std::memory_order_release);
}

uint32_t span_faults(int slot) {
  if (slot < 0 || slot >= kMaxGuardedSpans) return 0;
  return g_spans[slot].faults.load(std::memory_order_acquire);
}

}  // namespace vpaged
