// What the Checkpointer's files share (checkpointer.cc: the writer and the update hook;
// snapshot_pool.cc: the snapshot buffers and their preparation). Not part of checkpoint.h's API.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace slidedp::hostd::checkpoint_internal {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The threads the writer copies a layer with and the preparer faults a buffer in with.
inline constexpr uint64_t kWriterCopyThreads = 4;

// fn(0) .. fn(kWriterCopyThreads - 1), each on a thread (part 0 on the caller's): the writer's
// copies and the preparer's page faults, off the update pool, which is the worker's.
template <typename Fn>
void InParts(const Fn& fn) {
  std::vector<std::thread> helpers;
  for (uint64_t part = 1; part < kWriterCopyThreads; ++part) helpers.emplace_back(fn, part);
  fn(uint64_t{0});
  for (std::thread& t : helpers) t.join();
}

}  // namespace slidedp::hostd::checkpoint_internal
