// The doorbell: a uint32 futex word in shared memory that one side bumps and wakes and the other
// side sleeps on. Both ends of the shared-memory protocol use it (hostd: the reducer's doorbell,
// the wake words of layers, slots and the control block; the ranks: waits on those words and the
// doorbell they ring after publishing a chunk), so it lives next to shm_abi.h, the contract, and
// not in common/ (general utilities) or in one of the two ends.
//
// The word is one of the fields shm_abi.h documents as an "atomic futex word". The futex is not
// FUTEX_PRIVATE: the waiter and the waker are in different processes. Usage, so that no bump is
// lost between the check and the sleep:
//   Doorbell bell(&cb.doorbell);
//   for (;;) {
//     const uint32_t seen = bell.Load();      // acquire: load the word first,
//     if (ready()) break;                     // then test the condition it guards,
//     bell.Wait(seen, timeout);               // and sleep only while the word is unchanged.
//   }
// and on the other side: change the state the condition reads, then bell.Ring().
//
// Thread safety: a Doorbell is a pointer to a word; any number of threads and processes may
// Load, Wait and Ring at once.
#pragma once

#include <chrono>
#include <cstdint>

namespace slidedp::shm {

class Doorbell {
 public:
  enum class WaitResult {
    kWoken,     // a wake came, or the word no longer held `seen` when the wait began
    kTimedOut,  // `timeout` passed without either
  };

  // `word` must stay mapped for as long as this is used; it is not owned.
  explicit Doorbell(uint32_t* word) : word_(word) {}

  // The word's value (acquire: what the ringer stored before its bump is visible).
  uint32_t Load() const;

  // Sleeps while the word equals `seen`, for at most `timeout` (<= 0: returns kTimedOut at
  // once). A signal (EINTR) does not end the wait early: it resumes with the time left. Spurious
  // wakes are possible (as with any futex): callers re-check their condition in a loop.
  WaitResult Wait(uint32_t seen, std::chrono::nanoseconds timeout) const;

  // Bumps the word (acq_rel: the ringer's earlier stores are published with it) and wakes every
  // waiter.
  void Ring() const;

  // Wakes every waiter without changing the word; for callers that bump it themselves.
  void WakeAll() const;

 private:
  uint32_t* word_;
};

}  // namespace slidedp::shm
