#include "common/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp {
namespace {

struct Range {
  size_t begin;
  size_t end;
  int thread;
};

std::unique_ptr<ThreadPool> MakePool(int threads, std::vector<int> cpus = {}) {
  ThreadPool::Options options;
  options.num_threads = threads;
  options.cpus = std::move(cpus);
  absl::StatusOr<std::unique_ptr<ThreadPool>> pool = ThreadPool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

std::vector<Range> Collect(ThreadPool& pool, size_t n, size_t align) {
  absl::Mutex mu;
  std::vector<Range> ranges;
  pool.ParallelFor(n, align, [&](size_t begin, size_t end, int thread) {
    absl::MutexLock lock(&mu);
    ranges.push_back({begin, end, thread});
  });
  return ranges;
}

TEST(ThreadPoolSplitRangeTest, CoversExactlyWithAlignedBoundaries) {
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{7}, size_t{64}, size_t{1000}, size_t{4097}, size_t{123457}}) {
    for (size_t align : {size_t{1}, size_t{3}, size_t{16}, size_t{4096}}) {
      for (int threads = 1; threads <= 9; ++threads) {
        size_t expected_begin = 0;
        for (int t = 0; t < threads; ++t) {
          size_t begin = 0;
          size_t end = 0;
          ThreadPool::SplitRange(n, align, threads, t, &begin, &end);
          SCOPED_TRACE(testing::Message()
                       << "n=" << n << " align=" << align << " threads=" << threads << " t=" << t);
          EXPECT_EQ(begin, expected_begin);
          EXPECT_LE(begin, end);
          EXPECT_LE(end, n);
          if (begin < n) {
            EXPECT_EQ(begin % align, 0u);
          }
          if (end < n) {
            EXPECT_EQ(end % align, 0u);
          }
          expected_begin = end;
        }
        EXPECT_EQ(expected_begin, n);
      }
    }
  }
}

TEST(ThreadPoolSplitRangeTest, BalancedToOneChunk) {
  // 10 chunks of 16 over 3 threads: 4, 3, 3 chunks.
  size_t begin = 0;
  size_t end = 0;
  ThreadPool::SplitRange(160, 16, 3, 0, &begin, &end);
  EXPECT_EQ(begin, 0u);
  EXPECT_EQ(end, 64u);
  ThreadPool::SplitRange(160, 16, 3, 1, &begin, &end);
  EXPECT_EQ(begin, 64u);
  EXPECT_EQ(end, 112u);
  ThreadPool::SplitRange(160, 16, 3, 2, &begin, &end);
  EXPECT_EQ(begin, 112u);
  EXPECT_EQ(end, 160u);
}

TEST(ThreadPoolTest, RangesMatchSplitRangeForOneToEightThreads) {
  for (int threads = 1; threads <= 8; ++threads) {
    std::unique_ptr<ThreadPool> pool = MakePool(threads);
    ASSERT_NE(pool, nullptr);
    EXPECT_EQ(pool->size(), threads);
    for (size_t n : {size_t{1}, size_t{5}, size_t{100}, size_t{4096 * 3 + 5}, size_t{1 << 20}}) {
      for (size_t align : {size_t{1}, size_t{64}, size_t{4096}}) {
        std::vector<Range> ranges = Collect(*pool, n, align);
        std::vector<bool> seen(threads, false);
        size_t covered = 0;
        for (const Range& r : ranges) {
          ASSERT_GE(r.thread, 0);
          ASSERT_LT(r.thread, threads);
          EXPECT_FALSE(seen[r.thread]) << "thread " << r.thread << " called twice";
          seen[r.thread] = true;
          size_t begin = 0;
          size_t end = 0;
          ThreadPool::SplitRange(n, align, threads, r.thread, &begin, &end);
          EXPECT_EQ(r.begin, begin);
          EXPECT_EQ(r.end, end);
          EXPECT_LT(r.begin, r.end) << "empty ranges must not be passed to fn";
          covered += r.end - r.begin;
        }
        EXPECT_EQ(covered, n) << "threads=" << threads << " n=" << n << " align=" << align;
      }
    }
  }
}

TEST(ThreadPoolTest, FewerElementsThanThreads) {
  std::unique_ptr<ThreadPool> pool = MakePool(8);
  ASSERT_NE(pool, nullptr);
  std::vector<Range> ranges = Collect(*pool, 3, 1);
  ASSERT_EQ(ranges.size(), 3u);
  std::vector<int> hits(3, 0);
  for (const Range& r : ranges) {
    ASSERT_EQ(r.end, r.begin + 1);
    ++hits[r.begin];
  }
  EXPECT_THAT(hits, testing::Each(1));
  // 3 elements with align 64 form one chunk: one call.
  EXPECT_EQ(Collect(*pool, 3, 64).size(), 1u);
}

TEST(ThreadPoolTest, ZeroElementsCallsNothing) {
  std::unique_ptr<ThreadPool> pool = MakePool(4);
  ASSERT_NE(pool, nullptr);
  EXPECT_TRUE(Collect(*pool, 0, 16).empty());
}

TEST(ThreadPoolTest, CallbackRunsOnWorkerThreadsOnly) {
  std::unique_ptr<ThreadPool> pool = MakePool(3);
  ASSERT_NE(pool, nullptr);
  const pthread_t caller = pthread_self();
  std::atomic<int> on_caller{0};
  pool->ParallelFor(300, 1, [&](size_t, size_t, int) {
    if (pthread_equal(pthread_self(), caller)) on_caller.fetch_add(1);
  });
  EXPECT_EQ(on_caller.load(), 0);
}

TEST(ThreadPoolTest, ThreadNamesAreSetAndShort) {
  ThreadPool::Options options;
  options.num_threads = 12;
  options.name = "a-very-long-worker-name";
  absl::StatusOr<std::unique_ptr<ThreadPool>> pool = ThreadPool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::Mutex mu;
  std::vector<std::string> names;
  (*pool)->ParallelFor(12, 1, [&](size_t, size_t, int thread) {
    char name[32] = {};
    ASSERT_EQ(pthread_getname_np(pthread_self(), name, sizeof(name)), 0);
    absl::MutexLock lock(&mu);
    names.push_back(name);
  });
  ASSERT_EQ(names.size(), 12u);
  for (const std::string& name : names) {
    EXPECT_LE(name.size(), 15u);
    EXPECT_THAT(name, testing::StartsWith("a-very-long"));
  }
  EXPECT_THAT(names, testing::Contains("a-very-long-w-0"));
  EXPECT_THAT(names, testing::Contains("a-very-long--11"));
}

TEST(ThreadPoolTest, PinningToCpuZeroReadsBack) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  if (!CPU_ISSET(0, &allowed)) GTEST_SKIP() << "cpu 0 is not in this process's affinity mask";
  std::unique_ptr<ThreadPool> pool = MakePool(2, {0});
  ASSERT_NE(pool, nullptr);
  std::atomic<int> pinned{0};
  pool->ParallelFor(2, 1, [&](size_t, size_t, int) {
    cpu_set_t got;
    CPU_ZERO(&got);
    ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(got), &got), 0);
    if (CPU_COUNT(&got) == 1 && CPU_ISSET(0, &got) && sched_getcpu() == 0) pinned.fetch_add(1);
  });
  EXPECT_EQ(pinned.load(), 2);
}

TEST(ThreadPoolTest, InvalidArguments) {
  ThreadPool::Options options;
  options.num_threads = 0;
  EXPECT_EQ(ThreadPool::Create(options).status().code(), absl::StatusCode::kInvalidArgument);

  options.num_threads = 2;
  options.cpus = {0, -1};
  EXPECT_EQ(ThreadPool::Create(options).status().code(), absl::StatusCode::kInvalidArgument);

  options.cpus = {1 << 20};
  absl::StatusOr<std::unique_ptr<ThreadPool>> pool = ThreadPool::Create(options);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), testing::HasSubstr("cpus[0]"));
}

TEST(ThreadPoolTest, RepeatedParallelForThousandTimes) {
  std::unique_ptr<ThreadPool> pool = MakePool(4);
  ASSERT_NE(pool, nullptr);
  std::vector<int> counts(1000, 0);
  for (int iter = 0; iter < 1000; ++iter) {
    std::atomic<size_t> total{0};
    pool->ParallelFor(1000 + iter, 8, [&](size_t begin, size_t end, int) {
      total.fetch_add(end - begin);
      for (size_t i = begin; i < end && i < counts.size(); ++i) ++counts[i];
    });
    ASSERT_EQ(total.load(), static_cast<size_t>(1000 + iter));
  }
  EXPECT_THAT(counts, testing::Each(1000));
}

TEST(ThreadPoolTest, ElementWiseResultIndependentOfThreadCount) {
  std::vector<double> reference(10007);
  for (size_t i = 0; i < reference.size(); ++i) reference[i] = 1.0 / static_cast<double>(i + 1);
  for (int threads : {1, 2, 3, 7}) {
    std::unique_ptr<ThreadPool> pool = MakePool(threads);
    ASSERT_NE(pool, nullptr);
    std::vector<double> out(reference.size(), 0);
    pool->ParallelFor(out.size(), 16, [&](size_t begin, size_t end, int) {
      for (size_t i = begin; i < end; ++i) out[i] = 1.0 / static_cast<double>(i + 1);
    });
    EXPECT_EQ(out, reference);
  }
}

}  // namespace
}  // namespace slidedp
