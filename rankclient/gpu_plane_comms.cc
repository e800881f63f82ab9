// GpuDataPlane's NCCL communicators: the caller's (Options::comm, checked against the job) or
// two created through hostd's rendezvous, one per direction so parameter and gradient
// collectives never order against each other.
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/nccl_status.h"
#include "rankclient/gpu_plane.h"
#include "rankclient/gpu_plane_internal.h"
#include "spdlog/spdlog.h"

namespace slidedp::rankclient {
using cuda::NcclStatus;

absl::Status GpuDataPlane::InitComms() {
  Impl& m = *impl_;
  if (options_.comm != nullptr) {
    int n = 0, r = 0;
    RETURN_IF_ERROR(NcclStatus(ncclCommCount(options_.comm, &n), "ncclCommCount"));
    RETURN_IF_ERROR(NcclStatus(ncclCommUserRank(options_.comm, &r), "ncclCommUserRank"));
    if (static_cast<uint32_t>(n) != client_->world_size() ||
        static_cast<uint32_t>(r) != client_->rank()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "comm: the communicator has ", n, " ranks and this process is rank ", r,
          "; the job expects ", client_->world_size(), " ranks and rank ", client_->rank()));
    }
    m.param_comm = options_.comm;
    m.grad_comm = options_.comm;
    return absl::OkStatus();
  }
  // NVLink multicast (NVLS) can take GPUs out of service on shared hosts; off unless the user
  // set it explicitly.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  const auto t0 = Clock::now();
  const auto timeout = std::chrono::milliseconds(120000);
  auto make = [&](uint64_t generation) -> absl::StatusOr<cuda::NcclComm> {
    ncclUniqueId id;
    if (client_->rank() == 0) {
      RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
      RETURN_IF_ERROR(client_->PublishCommId(
          std::string(reinterpret_cast<const char*>(&id), sizeof(id)), generation, timeout));
    } else {
      ASSIGN_OR_RETURN(std::string bytes, client_->FetchCommId(generation, timeout));
      if (bytes.size() != sizeof(id)) {
        return absl::InternalError(absl::StrCat("hostd handed out a ", bytes.size(),
                                                "-byte NCCL id; expected ", sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    return WithContext(
        cuda::NcclComm::InitRank(static_cast<int>(client_->world_size()), id,
                                 static_cast<int>(client_->rank())),
        absl::StrCat("NCCL communicator of generation ", generation, " on device ", m.device));
  };
  ASSIGN_OR_RETURN(m.owned_param_comm, make(options_.comm_generation));
  m.param_comm = m.owned_param_comm.get();
  ASSIGN_OR_RETURN(m.owned_grad_comm, make(options_.comm_generation + 1));
  m.grad_comm = m.owned_grad_comm.get();
  const double nccl_init_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  {
    absl::MutexLock l(&m.mu);
    m.stats.nccl_init_seconds = nccl_init_seconds;
  }
  spdlog::info("rank {}: NCCL communicators ready in {:.3f} s", client_->rank(), nccl_init_seconds);
  return absl::OkStatus();
}

}  // namespace slidedp::rankclient
