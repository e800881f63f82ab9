#include "common/thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace slidedp {
namespace {

// Linux limits thread names to 15 characters plus the terminator.
constexpr size_t kMaxThreadNameLength = 15;

std::string ThreadName(const std::string& prefix, int index) {
  const std::string suffix = absl::StrCat("-", index);
  const size_t keep =
      suffix.size() >= kMaxThreadNameLength ? 0 : kMaxThreadNameLength - suffix.size();
  return absl::StrCat(prefix.substr(0, keep), suffix).substr(0, kMaxThreadNameLength);
}

absl::Status PthreadError(const char* call, int err, int cpu) {
  return absl::ErrnoToStatus(err, absl::StrCat(call, " while pinning a worker thread to cpu ", cpu,
                                               ": ", std::strerror(err)));
}

// Pins the calling thread to `cpu` and reads the binding back.
absl::Status PinCurrentThread(int cpu) {
  cpu_set_t want;
  CPU_ZERO(&want);
  CPU_SET(cpu, &want);
  const pthread_t self = pthread_self();
  if (const int err = pthread_setaffinity_np(self, sizeof(want), &want); err != 0) {
    return PthreadError("pthread_setaffinity_np", err, cpu);
  }
  cpu_set_t got;
  CPU_ZERO(&got);
  if (const int err = pthread_getaffinity_np(self, sizeof(got), &got); err != 0) {
    return PthreadError("pthread_getaffinity_np", err, cpu);
  }
  if (!CPU_EQUAL(&want, &got)) {
    return absl::FailedPreconditionError(absl::StrCat("worker thread binding to cpu ", cpu,
                                                      " did not take: affinity reads back ",
                                                      CPU_COUNT(&got), " cpus"));
  }
  return absl::OkStatus();
}

}  // namespace

// Workers sleep on a condition variable between calls (no spinning while idle). Each call bumps
// `generation`; a worker runs its range once per generation it sees and reports completion by
// decrementing `pending`. (TSan builds see absl::Mutex: scripts/tsan.sh rebuilds abseil's
// synchronization library instrumented.)
struct ThreadPool::Impl {
  int num_threads = 0;  // immutable after Create

  absl::Mutex call_mu;  // serializes ParallelFor callers; taken before mu

  absl::Mutex mu ABSL_ACQUIRED_AFTER(call_mu);
  absl::CondVar work_cv;  // generation or stop changed
  absl::CondVar done_cv;  // pending reached 0, or a worker started
  uint64_t generation ABSL_GUARDED_BY(mu) = 0;
  bool stop ABSL_GUARDED_BY(mu) = false;
  int pending ABSL_GUARDED_BY(mu) = 0;
  size_t n ABSL_GUARDED_BY(mu) = 0;
  size_t align ABSL_GUARDED_BY(mu) = 1;
  const std::function<void(size_t, size_t, int)>* fn ABSL_GUARDED_BY(mu) = nullptr;

  // Start-up handshake: each worker reports its pinning result once.
  int started ABSL_GUARDED_BY(mu) = 0;
  absl::Status start_status ABSL_GUARDED_BY(mu);

  // Owned by the thread that runs Create and the destructor.
  std::vector<std::thread> threads;

  void WorkerMain(int index, int cpu, const std::string& name) ABSL_LOCKS_EXCLUDED(mu);
  void StopAndJoin() ABSL_LOCKS_EXCLUDED(mu);
};

void ThreadPool::Impl::WorkerMain(int index, int cpu, const std::string& name) {
  // Names are diagnostics only (top, perf, gdb); a failure to set one is not an error.
  pthread_setname_np(pthread_self(), ThreadName(name, index).c_str());
  absl::Status pin_status = cpu >= 0 ? PinCurrentThread(cpu) : absl::OkStatus();
  uint64_t seen_generation = 0;
  {
    absl::MutexLock lock(&mu);
    if (!pin_status.ok() && start_status.ok()) start_status = std::move(pin_status);
    ++started;
    seen_generation = generation;
  }
  done_cv.SignalAll();

  for (;;) {
    size_t job_n = 0;
    size_t job_align = 1;
    const std::function<void(size_t, size_t, int)>* job = nullptr;
    {
      absl::MutexLock lock(&mu);
      while (!stop && generation == seen_generation) work_cv.Wait(&mu);
      if (stop) return;
      seen_generation = generation;
      job_n = n;
      job_align = align;
      job = fn;
    }
    size_t begin = 0;
    size_t end = 0;
    SplitRange(job_n, job_align, num_threads, index, &begin, &end);
    if (begin < end) (*job)(begin, end, index);
    bool last = false;
    {
      absl::MutexLock lock(&mu);
      last = --pending == 0;
    }
    if (last) done_cv.SignalAll();
  }
}

void ThreadPool::Impl::StopAndJoin() {
  {
    absl::MutexLock lock(&mu);
    stop = true;
  }
  work_cv.SignalAll();
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
  threads.clear();
}

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(const Options& options) {
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ThreadPool num_threads must be >= 1, got ", options.num_threads));
  }
  const long configured_cpus = sysconf(_SC_NPROCESSORS_CONF);
  const long max_cpu =
      std::min<long>(CPU_SETSIZE, configured_cpus > 0 ? configured_cpus : CPU_SETSIZE);
  for (size_t i = 0; i < options.cpus.size(); ++i) {
    const int cpu = options.cpus[i];
    if (cpu < 0 || cpu >= max_cpu) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ThreadPool cpus[", i, "] = ", cpu, " is out of range: expected 0..", max_cpu - 1));
    }
  }

  auto impl = std::make_unique<Impl>();
  impl->num_threads = options.num_threads;
  impl->threads.reserve(options.num_threads);
  for (int t = 0; t < options.num_threads; ++t) {
    const int cpu = options.cpus.empty() ? -1 : options.cpus[t % options.cpus.size()];
    impl->threads.emplace_back(&Impl::WorkerMain, impl.get(), t, cpu, options.name);
  }
  absl::Status start_status;
  {
    absl::MutexLock lock(&impl->mu);
    while (impl->started != impl->num_threads) impl->done_cv.Wait(&impl->mu);
    start_status = impl->start_status;
  }
  if (!start_status.ok()) {
    impl->StopAndJoin();
    return start_status;
  }
  return std::unique_ptr<ThreadPool>(new ThreadPool(std::move(impl)));
}

ThreadPool::ThreadPool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ThreadPool::~ThreadPool() { impl_->StopAndJoin(); }

int ThreadPool::size() const { return impl_->num_threads; }

void ThreadPool::ParallelFor(size_t n, size_t align,
                             const std::function<void(size_t begin, size_t end, int thread)>& fn) {
  if (n == 0) return;
  absl::MutexLock call_lock(&impl_->call_mu);
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->n = n;
    impl_->align = align == 0 ? 1 : align;
    impl_->fn = &fn;
    impl_->pending = impl_->num_threads;
    ++impl_->generation;
  }
  impl_->work_cv.SignalAll();
  absl::MutexLock lock(&impl_->mu);
  while (impl_->pending != 0) impl_->done_cv.Wait(&impl_->mu);
  impl_->fn = nullptr;
}

void ThreadPool::SplitRange(size_t n, size_t align, int threads, int t, size_t* begin,
                            size_t* end) {
  if (align == 0) align = 1;
  if (threads < 1) threads = 1;
  // Whole aligned chunks, the last possibly short; the first (chunks % threads) threads get one
  // chunk more. Chunk c starts at c * align, which is < n for every c < chunks (no overflow).
  const size_t chunks = n / align + (n % align != 0 ? 1 : 0);
  const size_t per_thread = chunks / static_cast<size_t>(threads);
  const size_t extra = chunks % static_cast<size_t>(threads);
  const auto chunk_start = [&](size_t thread) {
    return thread * per_thread + std::min(thread, extra);
  };
  const size_t first = chunk_start(static_cast<size_t>(t));
  const size_t last = chunk_start(static_cast<size_t>(t) + 1);
  *begin = first >= chunks ? n : first * align;
  *end = last >= chunks ? n : last * align;
}

}  // namespace slidedp
