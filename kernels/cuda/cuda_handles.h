// Move-only owners of CUDA and NCCL handles (STYLE.md: every driver handle has one owner):
//   CudaStream       cudaStreamCreateWithPriority / cudaStreamDestroy
//   CudaEvent        cudaEventCreateWithFlags     / cudaEventDestroy
//   DeviceBuffer     cudaMalloc                   / cudaFree
//   PinnedBuffer     cudaHostAlloc                / cudaFreeHost
//   HostRegistration cudaHostRegister             / cudaHostUnregister
//   NcclComm         ncclCommInitRank             / ncclCommDestroy
//
// Each factory returns the owner or the CUDA/NCCL error as a Status naming the call and its
// arguments (codes as in cuda_status.h / nccl_status.h); callers add what the handle was for.
// A default-constructed or moved-from owner is empty: its destructor does nothing. A destructor
// never throws; it checks its teardown call and logs a failure (the first few of the process,
// so a device fault does not log once per handle) instead of reporting it, since there is no
// one to report it to. Teardown does not wait for work that still uses the handle: the owner of
// the work synchronizes first (e.g. a stream before the buffers its copies touch are freed).
// Declare owners in acquisition order so they are torn down in reverse.
//
// Thread safety: an owner is a value; moving or destroying one is the owner thread's business.
// Using the handle (get()) follows CUDA's and NCCL's own rules.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"

namespace slidedp::cuda {

namespace internal {
// Logs a failed teardown call (`what` names it). Rate-limited per process.
void LogTeardownError(const char* what, cudaError_t e);
void LogTeardownError(const char* what, ncclResult_t r);
}  // namespace internal

class CudaStream {
 public:
  CudaStream() = default;
  // Takes ownership of `stream` (null: empty).
  explicit CudaStream(cudaStream_t stream) : stream_(stream) {}
  // A stream on the current device (cudaStreamCreateWithPriority).
  static absl::StatusOr<CudaStream> Create(unsigned int flags, int priority);

  CudaStream(CudaStream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream() { Reset(); }

  cudaStream_t get() const { return stream_; }
  explicit operator bool() const { return stream_ != nullptr; }
  // Gives up ownership: the caller destroys the returned stream.
  [[nodiscard]] cudaStream_t release() { return std::exchange(stream_, nullptr); }
  // Destroys the stream, if any; the owner is empty afterwards.
  void Reset();

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  // An event on the current device (cudaEventCreateWithFlags).
  static absl::StatusOr<CudaEvent> Create(unsigned int flags);

  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() { Reset(); }

  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }
  [[nodiscard]] cudaEvent_t release() { return std::exchange(event_, nullptr); }
  void Reset();

 private:
  cudaEvent_t event_ = nullptr;
};

// Device memory from cudaMalloc on the current device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Takes ownership of `data` (from cudaMalloc, `size_bytes` long; null: empty).
  DeviceBuffer(void* data, uint64_t size_bytes) : data_(data), size_bytes_(size_bytes) {}
  // RESOURCE_EXHAUSTED when the device is out of memory.
  static absl::StatusOr<DeviceBuffer> Allocate(uint64_t size_bytes);

  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_bytes_(std::exchange(other.size_bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  uint64_t size_bytes() const { return size_bytes_; }
  explicit operator bool() const { return data_ != nullptr; }
  [[nodiscard]] void* release();
  void Reset();

 private:
  void* data_ = nullptr;
  uint64_t size_bytes_ = 0;
};

// Page-locked host memory from cudaHostAlloc (cudaHostAllocDefault: what cudaMallocHost
// allocates).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(void* data, uint64_t size_bytes) : data_(data), size_bytes_(size_bytes) {}
  static absl::StatusOr<PinnedBuffer> Allocate(uint64_t size_bytes,
                                               unsigned int flags = cudaHostAllocDefault);

  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_bytes_(std::exchange(other.size_bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Reset(); }

  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  uint64_t size_bytes() const { return size_bytes_; }
  explicit operator bool() const { return data_ != nullptr; }
  [[nodiscard]] void* release();
  void Reset();

 private:
  void* data_ = nullptr;
  uint64_t size_bytes_ = 0;
};

// A host range registered with CUDA (cudaHostRegister); the memory itself stays the caller's
// and must outlive the registration.
class HostRegistration {
 public:
  HostRegistration() = default;
  // Takes ownership of an existing registration of [data, data + size_bytes).
  HostRegistration(void* data, uint64_t size_bytes) : data_(data), size_bytes_(size_bytes) {}
  static absl::StatusOr<HostRegistration> Register(void* data, uint64_t size_bytes,
                                                   unsigned int flags);

  HostRegistration(HostRegistration&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_bytes_(std::exchange(other.size_bytes_, 0)) {}
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration() { Reset(); }

  void* get() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  explicit operator bool() const { return data_ != nullptr; }
  // Gives up ownership: the caller unregisters the returned address.
  [[nodiscard]] void* release();
  void Reset();

 private:
  void* data_ = nullptr;
  uint64_t size_bytes_ = 0;
};

// An NCCL communicator, destroyed with ncclCommDestroy; synchronize the streams its collectives
// were enqueued on first.
class NcclComm {
 public:
  NcclComm() = default;
  explicit NcclComm(ncclComm_t comm) : comm_(comm) {}
  // This process's rank `rank` of `nranks` in the clique named by `id` (ncclCommInitRank, on the
  // current device; blocks until every rank has joined).
  static absl::StatusOr<NcclComm> InitRank(int nranks, const ncclUniqueId& id, int rank);

  NcclComm(NcclComm&& other) noexcept : comm_(std::exchange(other.comm_, nullptr)) {}
  NcclComm& operator=(NcclComm&& other) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() { Reset(); }

  ncclComm_t get() const { return comm_; }
  explicit operator bool() const { return comm_ != nullptr; }
  [[nodiscard]] ncclComm_t release() { return std::exchange(comm_, nullptr); }
  void Reset();

 private:
  ncclComm_t comm_ = nullptr;
};

}  // namespace slidedp::cuda
