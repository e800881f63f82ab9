#include "proto/doorbell.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "gtest/gtest.h"
#include "proto/shm_abi.h"

namespace slidedp::shm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

TEST(DoorbellTest, WaitTimesOutWhenNothingRings) {
  uint32_t word = 7;
  const Doorbell bell(&word);
  const auto t0 = Clock::now();
  EXPECT_EQ(bell.Wait(7, milliseconds(30)), Doorbell::WaitResult::kTimedOut);
  EXPECT_GE(Clock::now() - t0, milliseconds(29));
  EXPECT_EQ(word, 7u);
}

TEST(DoorbellTest, NonPositiveTimeoutReturnsAtOnce) {
  uint32_t word = 0;
  const Doorbell bell(&word);
  EXPECT_EQ(bell.Wait(0, milliseconds(0)), Doorbell::WaitResult::kTimedOut);
  EXPECT_EQ(bell.Wait(0, milliseconds(-5)), Doorbell::WaitResult::kTimedOut);
}

TEST(DoorbellTest, AWordThatChangedBeforeTheWaitReturnsAtOnce) {
  uint32_t word = 0;
  const Doorbell bell(&word);
  const uint32_t seen = bell.Load();
  bell.Ring();  // between the load and the wait: the wait must not sleep
  const auto t0 = Clock::now();
  EXPECT_EQ(bell.Wait(seen, std::chrono::seconds(10)), Doorbell::WaitResult::kWoken);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  EXPECT_EQ(bell.Load(), seen + 1);
}

TEST(DoorbellTest, RingWakesAWaiterAndBumpsTheWord) {
  uint32_t word = 41;
  const Doorbell bell(&word);
  std::atomic<bool> returned{false};
  Doorbell::WaitResult result = Doorbell::WaitResult::kTimedOut;
  std::thread waiter([&] {
    result = bell.Wait(41, std::chrono::seconds(20));
    returned = true;
  });
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_FALSE(returned.load());  // asleep until the ring
  const auto t0 = Clock::now();
  bell.Ring();
  waiter.join();
  EXPECT_EQ(result, Doorbell::WaitResult::kWoken);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(bell.Load(), 42u);
}

TEST(DoorbellTest, WakeAllWakesEveryWaiterWithoutChangingTheWord) {
  uint32_t word = 3;
  const Doorbell bell(&word);
  std::atomic<int> woken{0};
  std::thread a(
      [&] { woken += bell.Wait(3, std::chrono::seconds(20)) == Doorbell::WaitResult::kWoken; });
  std::thread b(
      [&] { woken += bell.Wait(3, std::chrono::seconds(20)) == Doorbell::WaitResult::kWoken; });
  std::this_thread::sleep_for(milliseconds(50));
  // A waiter not yet asleep would sleep through this wake: wake until both are out.
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (woken.load() < 2 && Clock::now() < give_up) {
    bell.WakeAll();
    std::this_thread::sleep_for(milliseconds(5));
  }
  a.join();
  b.join();
  EXPECT_EQ(woken.load(), 2);
  EXPECT_EQ(word, 3u);
}

void IgnoreSignal(int) {}

TEST(DoorbellTest, ASignalDoesNotEndTheWaitEarly) {
  struct sigaction sa = {};
  sa.sa_handler = IgnoreSignal;  // no SA_RESTART: the futex wait fails with EINTR
  struct sigaction old = {};
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old), 0);
  uint32_t word = 0;
  const Doorbell bell(&word);
  Doorbell::WaitResult result = Doorbell::WaitResult::kWoken;
  Clock::duration waited{};
  std::thread waiter([&] {
    const auto t0 = Clock::now();
    result = bell.Wait(0, milliseconds(300));
    waited = Clock::now() - t0;
  });
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(milliseconds(30));
    pthread_kill(waiter.native_handle(), SIGUSR1);
  }
  waiter.join();
  sigaction(SIGUSR1, &old, nullptr);
  EXPECT_EQ(result, Doorbell::WaitResult::kTimedOut);
  EXPECT_GE(waited, milliseconds(299));
}

TEST(DoorbellTest, RingsAcrossProcessesThroughSharedMemory) {
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* word = static_cast<uint32_t*>(mem);
  *word = 0;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::this_thread::sleep_for(milliseconds(50));
    Doorbell(word).Ring();
    _exit(0);
  }
  const Doorbell bell(word);
  Doorbell::WaitResult result = Doorbell::WaitResult::kTimedOut;
  const auto give_up = Clock::now() + std::chrono::seconds(20);
  do {  // a Wait after the ring returns kWoken at once (the word is no longer 0)
    result = bell.Wait(0, std::chrono::seconds(20));
  } while (bell.Load() == 0 && Clock::now() < give_up);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_EQ(result, Doorbell::WaitResult::kWoken);
  EXPECT_EQ(bell.Load(), 1u);
  munmap(mem, 4096);
}

}  // namespace
}  // namespace slidedp::shm
