// The seam between rankclient's protocol and the memory the caller computes with. The protocol
// (version gate, ring slots, headers, aborts) is the same for every backend; a backend only
// moves bytes between the shared-memory mappings and the caller's buffers:
//   CPU backend  - plain copies into and out of host memory (this file);
//   CUDA backend - registered mappings, H2D into GPU window slots and D2H out of them on the
//                  backend's own streams (issue #4).
//
// Thread safety: a backend is used by the one thread that drives its RankClient.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace slidedp::rankclient {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::string_view name() const = 0;
  // Copies `bytes` of a layer's BF16 parameters from the params mapping (`src`) to `dst`, the
  // caller's destination in this backend's memory. Returns when `dst` may be used.
  virtual absl::Status CopyParams(void* dst, const void* src, size_t bytes) = 0;
  // Copies `bytes` of a gradient chunk from `src`, the caller's memory in this backend, into a
  // ring slot of the grads mapping (`slot`). Returns when the slot holds the data.
  virtual absl::Status CopyGradChunk(void* slot, const void* src, size_t bytes) = 0;
};

// Host memory: plain copies.
std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace slidedp::rankclient
