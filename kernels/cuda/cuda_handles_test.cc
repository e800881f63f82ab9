// cuda_handles.h without a device: empty owners tear down without a CUDA call, moves leave the
// source empty and carry the handle (and size) over, release() gives the handle up, a failed
// teardown is logged, factories return the CUDA error. Stand-in handles are released, never
// destroyed, except where no device is present; on a machine with a GPU those cases skip.
#include "kernels/cuda/cuda_handles.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace slidedp::cuda {
namespace {

template <typename H>
H Fake(uintptr_t v) {
  return reinterpret_cast<H>(v);
}

bool HasDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Captures what the default spdlog logger writes while it lives. A teardown call that fails
// logs a warning; without a device every CUDA call fails, so there an empty capture shows
// that no call was made.
class LogCapture {
 public:
  LogCapture()
      : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)),
        saved_(spdlog::default_logger()) {
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink_));
  }
  ~LogCapture() { spdlog::set_default_logger(saved_); }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
  std::shared_ptr<spdlog::logger> saved_;
};

TEST(CudaHandlesTest, DefaultOwnersAreEmptyAndTearDownWithoutACudaCall) {
  LogCapture log;
  {
    CudaStream stream;
    CudaEvent event;
    DeviceBuffer device;
    PinnedBuffer pinned;
    HostRegistration registration;
    NcclComm comm;
    EXPECT_FALSE(stream);
    EXPECT_EQ(stream.get(), nullptr);
    EXPECT_FALSE(event);
    EXPECT_EQ(event.get(), nullptr);
    EXPECT_FALSE(device);
    EXPECT_EQ(device.size_bytes(), 0u);
    EXPECT_FALSE(pinned);
    EXPECT_EQ(pinned.size_bytes(), 0u);
    EXPECT_FALSE(registration);
    EXPECT_EQ(registration.size_bytes(), 0u);
    EXPECT_FALSE(comm);
    EXPECT_EQ(comm.get(), nullptr);
    // Reset of an empty owner is a no-op too.
    stream.Reset();
    device.Reset();
    comm.Reset();
  }
  EXPECT_EQ(log.text(), "");
}

TEST(CudaHandlesTest, FailedTeardownIsLoggedNotThrown) {
  if (HasDevice()) GTEST_SKIP() << "needs a machine where every CUDA call fails";
  LogCapture log;
  { CudaEvent event(Fake<cudaEvent_t>(0x7000)); }  // cudaEventDestroy fails without a driver
  EXPECT_NE(log.text().find("cudaEventDestroy: CUDA error"), std::string::npos) << log.text();
}

TEST(CudaHandlesTest, StreamMoveLeavesSourceEmpty) {
  CudaStream a(Fake<cudaStream_t>(0x1000));
  CudaStream b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): the moved-from state is the contract
  EXPECT_EQ(b.get(), Fake<cudaStream_t>(0x1000));
  CudaStream c;
  c = std::move(b);
  EXPECT_FALSE(b);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(c.get(), Fake<cudaStream_t>(0x1000));
  CudaStream& alias = c;
  c = std::move(alias);  // self-move keeps the handle
  EXPECT_EQ(c.get(), Fake<cudaStream_t>(0x1000));
  EXPECT_EQ(c.release(), Fake<cudaStream_t>(0x1000));
  EXPECT_FALSE(c);
}

TEST(CudaHandlesTest, EventMoveLeavesSourceEmpty) {
  CudaEvent a(Fake<cudaEvent_t>(0x2000));
  CudaEvent b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move)
  CudaEvent c;
  c = std::move(b);
  EXPECT_FALSE(b);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(c.release(), Fake<cudaEvent_t>(0x2000));
  EXPECT_FALSE(c);
}

TEST(CudaHandlesTest, BufferMovesCarryTheSize) {
  DeviceBuffer a(Fake<void*>(0x3000), 4096);
  DeviceBuffer b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(a.size_bytes(), 0u);
  EXPECT_EQ(b.get(), Fake<void*>(0x3000));
  EXPECT_EQ(b.as<uint16_t>(), Fake<uint16_t*>(0x3000));
  EXPECT_EQ(b.size_bytes(), 4096u);
  DeviceBuffer c;
  c = std::move(b);
  EXPECT_FALSE(b);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.size_bytes(), 0u);
  EXPECT_EQ(c.size_bytes(), 4096u);
  EXPECT_EQ(c.release(), Fake<void*>(0x3000));
  EXPECT_FALSE(c);
  EXPECT_EQ(c.size_bytes(), 0u);

  PinnedBuffer p(Fake<void*>(0x4000), 64);
  PinnedBuffer q;
  q = std::move(p);
  EXPECT_FALSE(p);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(p.size_bytes(), 0u);
  EXPECT_EQ(q.size_bytes(), 64u);
  EXPECT_EQ(q.release(), Fake<void*>(0x4000));
  EXPECT_EQ(q.size_bytes(), 0u);
}

TEST(CudaHandlesTest, RegistrationAndCommMovesLeaveSourceEmpty) {
  HostRegistration a(Fake<void*>(0x5000), 1 << 20);
  HostRegistration b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(a.size_bytes(), 0u);
  EXPECT_EQ(b.size_bytes(), 1u << 20);
  EXPECT_EQ(b.release(), Fake<void*>(0x5000));
  EXPECT_EQ(b.size_bytes(), 0u);

  NcclComm c(Fake<ncclComm_t>(0x6000));
  NcclComm d;
  d = std::move(c);
  EXPECT_FALSE(c);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(d.release(), Fake<ncclComm_t>(0x6000));
  EXPECT_FALSE(d);
}

TEST(CudaHandlesTest, FactoriesReturnTheCudaErrorWithoutADevice) {
  if (HasDevice()) {
    GTEST_SKIP() << "a CUDA device is present; cuda_handles_gpu_test covers the factories";
  }
  absl::StatusOr<CudaStream> stream = CudaStream::Create(cudaStreamNonBlocking, 0);
  ASSERT_FALSE(stream.ok());
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kFailedPrecondition) << stream.status();
  EXPECT_NE(stream.status().message().find("cudaStreamCreateWithPriority"), absl::string_view::npos)
      << stream.status();
  absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(4096);
  ASSERT_FALSE(buffer.ok());
  EXPECT_NE(buffer.status().message().find("cudaMalloc of 4096 bytes"), absl::string_view::npos)
      << buffer.status();
  absl::StatusOr<CudaEvent> event = CudaEvent::Create(cudaEventDisableTiming);
  EXPECT_FALSE(event.ok());
}

}  // namespace
}  // namespace slidedp::cuda
