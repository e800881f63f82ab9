#include "kernels/cuda/cuda_handles.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/nccl_status.h"
#include "spdlog/spdlog.h"

namespace slidedp::cuda {
namespace internal {
namespace {

// After a device fault every teardown call fails; a plane owns hundreds of events, so only the
// first failures are worth a line each.
constexpr int kMaxTeardownLogs = 8;
std::atomic<int> teardown_logs{0};

bool ShouldLog() {
  const int n = teardown_logs.fetch_add(1, std::memory_order_relaxed);
  if (n == kMaxTeardownLogs) {
    spdlog::warn("further CUDA/NCCL teardown errors are not logged");
  }
  return n < kMaxTeardownLogs;
}

}  // namespace

void LogTeardownError(const char* what, cudaError_t e) {
  // At process exit the runtime may be unloaded before static owners go; the driver reclaims
  // everything then, so that is not worth a warning.
  if (e == cudaSuccess || e == cudaErrorCudartUnloading || !ShouldLog()) return;
  spdlog::warn("{}: CUDA error {} ({}: {})", what, static_cast<int>(e), cudaGetErrorName(e),
               cudaGetErrorString(e));
}

void LogTeardownError(const char* what, ncclResult_t r) {
  if (r == ncclSuccess || !ShouldLog()) return;
  spdlog::warn("{}: NCCL error {} ({})", what, static_cast<int>(r), ncclGetErrorString(r));
}

}  // namespace internal

absl::StatusOr<CudaStream> CudaStream::Create(unsigned int flags, int priority) {
  cudaStream_t s = nullptr;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithPriority(&s, flags, priority),
                       "cudaStreamCreateWithPriority(flags ", flags, ", priority ", priority, ")");
  return CudaStream(s);
}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    Reset();
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void CudaStream::Reset() {
  if (stream_ == nullptr) return;
  internal::LogTeardownError("cudaStreamDestroy", cudaStreamDestroy(stream_));
  stream_ = nullptr;
}

absl::StatusOr<CudaEvent> CudaEvent::Create(unsigned int flags) {
  cudaEvent_t e = nullptr;
  RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&e, flags), "cudaEventCreateWithFlags(", flags,
                       ")");
  return CudaEvent(e);
}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    Reset();
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void CudaEvent::Reset() {
  if (event_ == nullptr) return;
  internal::LogTeardownError("cudaEventDestroy", cudaEventDestroy(event_));
  event_ = nullptr;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(uint64_t size_bytes) {
  void* p = nullptr;
  RETURN_IF_CUDA_ERROR(cudaMalloc(&p, size_bytes), "cudaMalloc of ", size_bytes, " bytes");
  return DeviceBuffer(p, size_bytes);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void* DeviceBuffer::release() {
  size_bytes_ = 0;
  return std::exchange(data_, nullptr);
}

void DeviceBuffer::Reset() {
  if (data_ != nullptr) internal::LogTeardownError("cudaFree", cudaFree(data_));
  data_ = nullptr;
  size_bytes_ = 0;
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(uint64_t size_bytes, unsigned int flags) {
  void* p = nullptr;
  RETURN_IF_CUDA_ERROR(cudaHostAlloc(&p, size_bytes, flags), "cudaHostAlloc of ", size_bytes,
                       " bytes (flags ", flags, ")");
  return PinnedBuffer(p, size_bytes);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void* PinnedBuffer::release() {
  size_bytes_ = 0;
  return std::exchange(data_, nullptr);
}

void PinnedBuffer::Reset() {
  if (data_ != nullptr) internal::LogTeardownError("cudaFreeHost", cudaFreeHost(data_));
  data_ = nullptr;
  size_bytes_ = 0;
}

absl::StatusOr<HostRegistration> HostRegistration::Register(void* data, uint64_t size_bytes,
                                                            unsigned int flags) {
  RETURN_IF_CUDA_ERROR(cudaHostRegister(data, size_bytes, flags), "cudaHostRegister of ",
                       size_bytes, " bytes (flags ", flags, ")");
  return HostRegistration(data, size_bytes);
}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void* HostRegistration::release() {
  size_bytes_ = 0;
  return std::exchange(data_, nullptr);
}

void HostRegistration::Reset() {
  if (data_ != nullptr) internal::LogTeardownError("cudaHostUnregister", cudaHostUnregister(data_));
  data_ = nullptr;
  size_bytes_ = 0;
}

absl::StatusOr<NcclComm> NcclComm::InitRank(int nranks, const ncclUniqueId& id, int rank) {
  ncclComm_t c = nullptr;
  const absl::Status s =
      NcclStatus(ncclCommInitRank(&c, nranks, id, rank),
                 absl::StrCat("ncclCommInitRank (", nranks, " ranks, rank ", rank, ")"));
  if (!s.ok()) return s;
  return NcclComm(c);
}

NcclComm& NcclComm::operator=(NcclComm&& other) noexcept {
  if (this != &other) {
    Reset();
    comm_ = std::exchange(other.comm_, nullptr);
  }
  return *this;
}

void NcclComm::Reset() {
  if (comm_ == nullptr) return;
  internal::LogTeardownError("ncclCommDestroy", ncclCommDestroy(comm_));
  comm_ = nullptr;
}

}  // namespace slidedp::cuda
