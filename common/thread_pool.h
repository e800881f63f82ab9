// A fixed pool of worker threads for data-parallel loops over contiguous ranges (the update
// worker, casts, benchmarks). Threads are started once, optionally pinned one per CPU, and joined
// by the destructor.
//
// ParallelFor splits [0, n) into one contiguous range per thread with boundaries at multiples of
// `align`, so for element-wise kernels the result is bit-identical for any thread count.
//
// Thread safety: ParallelFor may be called from one thread at a time (it is serialized by an
// internal mutex); the callback runs concurrently on every worker thread and on no other thread.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp {

class ThreadPool {
 public:
  struct Options {
    int num_threads = 1;
    // If non-empty, thread i is pinned to cpus[i % cpus.size()]; the binding is read back and
    // Create fails with FAILED_PRECONDITION if it did not take.
    std::vector<int> cpus;
    std::string name = "slidedp-worker";
  };

  // Starts the threads. INVALID_ARGUMENT if num_threads < 1 or a cpu id is out of range.
  static absl::StatusOr<std::unique_ptr<ThreadPool>> Create(const Options& options);

  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const;

  // Calls fn(begin, end, thread_index) for each non-empty range of the fixed split of [0, n)
  // and returns when all calls have returned. `align` >= 1.
  void ParallelFor(size_t n, size_t align,
                   const std::function<void(size_t begin, size_t end, int thread)>& fn);

  // The range of thread t of `threads` under the fixed split (also used by callers that need
  // to know the partition in advance, e.g. to size per-thread partial results).
  static void SplitRange(size_t n, size_t align, int threads, int t, size_t* begin, size_t* end);

 private:
  struct Impl;
  explicit ThreadPool(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace slidedp
