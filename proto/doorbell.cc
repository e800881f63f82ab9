#include "proto/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>

#include "proto/shm_abi.h"

namespace slidedp::shm {

uint32_t Doorbell::Load() const { return Atomic(*word_).load(std::memory_order_acquire); }

Doorbell::WaitResult Doorbell::Wait(uint32_t seen, std::chrono::nanoseconds timeout) const {
  using Clock = std::chrono::steady_clock;
  if (timeout <= std::chrono::nanoseconds::zero()) return WaitResult::kTimedOut;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
    if (left <= std::chrono::nanoseconds::zero()) return WaitResult::kTimedOut;
    timespec ts{static_cast<time_t>(left.count() / 1000000000),
                static_cast<long>(left.count() % 1000000000)};
    if (syscall(SYS_futex, word_, FUTEX_WAIT, seen, &ts, nullptr, 0) == 0) {
      return WaitResult::kWoken;
    }
    switch (errno) {
      case EAGAIN:  // the word was no longer `seen`
        return WaitResult::kWoken;
      case ETIMEDOUT:
        return WaitResult::kTimedOut;
      case EINTR:  // a signal: sleep on for the time left
        continue;
      default:  // EFAULT, EINVAL: a caller's bug; it re-checks its condition and deadline
        return WaitResult::kWoken;
    }
  }
}

void Doorbell::Ring() const {
  Atomic(*word_).fetch_add(1, std::memory_order_acq_rel);
  WakeAll();
}

void Doorbell::WakeAll() const {
  syscall(SYS_futex, word_, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace slidedp::shm
