// C++ exception types of the core. bindings/module.cpp translates each into the Python class of the same
// name in vpaged/errors.py, so Python code sees one hierarchy whatever layer raised.
#pragma once
#include <stdexcept>
#include <string>

namespace vpaged {

struct OutOfPages : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The host refused another mapping (vm.max_map_count) or address space ran out.
struct MappingLimit : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The process cannot reserve that much virtual address space (a subclass: code catching MappingLimit
// still catches it).
struct AddressSpace : MappingLimit {
  using MappingLimit::MappingLimit;
};
// A backend (OS or driver) call failed; the message names the call and the reason.
struct BackendFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The device cannot be waited for because a stream is capturing a CUDA graph (the driver returned one of the
// CUDA_ERROR_STREAM_CAPTURE_* errors). A subclass: code catching BackendFailure still catches it.
struct CaptureActive : BackendFailure {
  using BackendFailure::BackendFailure;
};
// A backend that cannot be used on this machine or build (no driver, no device, built without CUDA).
struct BackendUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A page of a range cannot be unmapped or remapped while a tensor view reads it.
struct ViewsAlive : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Caller error detected in the core (bad index, unmapped view request, ...).
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace vpaged
