// NCCL return codes as absl::Status, wrapped at the call site (STYLE.md: foreign codes are
// translated where they occur, with what was being done), like cuda_status.h for CUDA:
//   RETURN_IF_ERROR(NcclStatus(ncclAllGather(...), "ncclAllGather of layer ", l));
// Header-only; needs nccl.h (link slidedp_nccl).
#pragma once

#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace slidedp::cuda {

// INVALID_ARGUMENT for NCCL's argument and usage errors, INTERNAL otherwise; the message holds
// `what`, the code, NCCL's text for it and NCCL's last error message (which names the cause).
inline absl::Status NcclStatus(ncclResult_t r, absl::string_view what) {
  if (r == ncclSuccess) return absl::OkStatus();
  const absl::StatusCode code = r == ncclInvalidArgument || r == ncclInvalidUsage
                                    ? absl::StatusCode::kInvalidArgument
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": NCCL error ", static_cast<int>(r), " (",
                                         ncclGetErrorString(r), "): ", ncclGetLastError(nullptr)));
}

}  // namespace slidedp::cuda
