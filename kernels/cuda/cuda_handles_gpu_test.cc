// cuda_handles.h on a device: every factory yields a working handle; a copy round trip through
// a registered host range, a device buffer and a pinned buffer on an owned stream, ordered by
// an owned event; move-assignment over a live owner frees the old buffer; a one-rank NCCL
// communicator; allocation and NCCL argument errors as Status codes.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_handles.h"

namespace slidedp::cuda {
namespace {

#define ASSERT_CUDA(expr)                                                              \
  do {                                                                                 \
    const cudaError_t cuda_err_ = (expr);                                              \
    ASSERT_EQ(cuda_err_, cudaSuccess) << #expr << ": " << cudaGetErrorName(cuda_err_); \
  } while (0)

TEST(CudaHandlesGpuTest, CopyRoundTripThroughOwnedHandles) {
  ASSERT_CUDA(cudaSetDevice(0));
  constexpr uint64_t kBytes = 1 << 20;
  void* host = std::aligned_alloc(4096, kBytes);
  ASSERT_NE(host, nullptr);
  auto* words = static_cast<uint32_t*>(host);
  std::iota(words, words + kBytes / 4, 7u);
  {
    absl::StatusOr<HostRegistration> reg =
        HostRegistration::Register(host, kBytes, cudaHostRegisterPortable);
    ASSERT_TRUE(reg.ok()) << reg.status();
    EXPECT_EQ(reg->get(), host);
    EXPECT_EQ(reg->size_bytes(), kBytes);
    absl::StatusOr<CudaStream> stream = CudaStream::Create(cudaStreamNonBlocking, 0);
    ASSERT_TRUE(stream.ok()) << stream.status();
    ASSERT_TRUE(*stream);
    absl::StatusOr<CudaEvent> done = CudaEvent::Create(cudaEventDisableTiming);
    ASSERT_TRUE(done.ok()) << done.status();
    absl::StatusOr<DeviceBuffer> device = DeviceBuffer::Allocate(kBytes);
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ(device->size_bytes(), kBytes);
    absl::StatusOr<PinnedBuffer> pinned = PinnedBuffer::Allocate(kBytes);
    ASSERT_TRUE(pinned.ok()) << pinned.status();
    std::memset(pinned->get(), 0, kBytes);

    ASSERT_CUDA(
        cudaMemcpyAsync(device->get(), host, kBytes, cudaMemcpyHostToDevice, stream->get()));
    ASSERT_CUDA(cudaMemcpyAsync(pinned->get(), device->get(), kBytes, cudaMemcpyDeviceToHost,
                                stream->get()));
    ASSERT_CUDA(cudaEventRecord(done->get(), stream->get()));
    ASSERT_CUDA(cudaEventSynchronize(done->get()));
    EXPECT_EQ(std::memcmp(pinned->get(), host, kBytes), 0);

    // The registration is live: registering the range again fails.
    EXPECT_EQ(cudaHostRegister(host, kBytes, cudaHostRegisterPortable),
              cudaErrorHostMemoryAlreadyRegistered);
    (void)cudaGetLastError();
  }
  // The owners are gone: the range registers again (and is unregistered by hand).
  ASSERT_CUDA(cudaHostRegister(host, kBytes, cudaHostRegisterPortable));
  ASSERT_CUDA(cudaHostUnregister(host));
  std::free(host);
}

// cudaFree'd memory is unknown to CUDA again (cudaMemoryTypeUnregistered); the process makes
// no other allocation in between, so the address cannot be taken again meanwhile.
cudaMemoryType TypeOf(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) return cudaMemoryTypeUnregistered;
  return attr.type;
}

TEST(CudaHandlesGpuTest, MoveAssignmentReleasesTheOldBuffer) {
  ASSERT_CUDA(cudaSetDevice(0));
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(1 << 20);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(1 << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  void* const first = a->get();
  void* const second = b->get();
  ASSERT_EQ(TypeOf(first), cudaMemoryTypeDevice);
  *a = std::move(*b);  // frees `first`
  EXPECT_FALSE(*b);
  EXPECT_EQ(a->get(), second);
  EXPECT_EQ(TypeOf(first), cudaMemoryTypeUnregistered);
  EXPECT_EQ(TypeOf(second), cudaMemoryTypeDevice);
  a->Reset();
  EXPECT_EQ(TypeOf(second), cudaMemoryTypeUnregistered);
  (void)cudaGetLastError();
}

TEST(CudaHandlesGpuTest, OneRankNcclComm) {
  ASSERT_CUDA(cudaSetDevice(0));
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  absl::StatusOr<NcclComm> comm = NcclComm::InitRank(1, id, 0);
  ASSERT_TRUE(comm.ok()) << comm.status();
  int n = 0;
  ASSERT_EQ(ncclCommCount(comm->get(), &n), ncclSuccess);
  EXPECT_EQ(n, 1);
  NcclComm moved = std::move(*comm);
  EXPECT_FALSE(*comm);
  EXPECT_TRUE(moved);
}

TEST(CudaHandlesGpuTest, BadArgumentsComeBackAsStatus) {
  ASSERT_CUDA(cudaSetDevice(0));
  absl::StatusOr<DeviceBuffer> huge = DeviceBuffer::Allocate(uint64_t{1} << 62);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  (void)cudaGetLastError();
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  absl::StatusOr<NcclComm> comm = NcclComm::InitRank(1, id, 5);  // rank outside 0..nranks-1
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument) << comm.status();
}

}  // namespace
}  // namespace slidedp::cuda
