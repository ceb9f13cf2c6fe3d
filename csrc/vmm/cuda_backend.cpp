// Placeholder until the CUDA backend lands: reports CUDA as unavailable.
#include <string>

#include "../backend.h"
#include "../errors.h"

namespace vpaged {
bool built_with_cuda() { return false; }
std::string cuda_unavailable_reason(int) { return "vpaged was built without CUDA"; }
size_t cuda_granularity(int) { return 0; }
int cuda_device_count() { return 0; }
std::shared_ptr<Backend> make_cuda_backend(int device, size_t, size_t, size_t) {
  throw BackendUnavailable(cuda_unavailable_reason(device));
}
}  // namespace vpaged
