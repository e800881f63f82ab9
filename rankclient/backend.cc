#include "rankclient/backend.h"

#include <cstring>

namespace slidedp::rankclient {
namespace {

class CpuBackend final : public Backend {
 public:
  absl::string_view name() const override { return "cpu"; }
  absl::Status CopyParams(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyGradChunk(void* slot, const void* src, size_t bytes) override {
    std::memcpy(slot, src, bytes);
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace slidedp::rankclient
