// RankTable: the ranks attached to hostd's job and their sessions, as the control plane sees them.
//
// An attachment is one rank process between its AttachRank and its detach (or lost session): the
// table issues it a token, and every later call about the rank names that token, so a call of an
// attachment that ended (a late stream close, a stale client) cannot touch the one that replaced
// it. Per attachment the table keeps the session (connected, last heartbeat), the queue of
// session events to deliver, the last step the rank began and, for rank 0, the NCCL communicator
// ids it published (by generation; they die with the attachment).
//
// The table decides; it neither knows gRPC nor shared memory. Engine mirrors what a rank must see
// (its RankSlot) and acts on what the table reports (a missed heartbeat deadline aborts a step).
//
// Thread safety: externally synchronized. Engine guards its one RankTable with its mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::hostd {

class RankTable {
 public:
  using Clock = std::chrono::steady_clock;

  struct RankEntry {
    bool attached = false;
    bool connected = false;  // a session is open and has not missed its deadline
    std::string token;       // of the current attachment; empty while detached
    int32_t pid = 0;
    std::string hostname;
    int32_t gpu = -1;
    uint64_t last_step = 0;  // the last step the rank began
    Clock::time_point last_heartbeat;
    std::deque<slidedp::v1::SessionEvent> events;  // not yet delivered, oldest first
  };

  // Forgets every attachment and sizes the table for `world_size` ranks, none attached.
  void Reset(uint32_t world_size);
  uint32_t world_size() const { return static_cast<uint32_t>(ranks_.size()); }
  // Precondition: rank < world_size().
  const RankEntry& rank(uint32_t rank) const { return ranks_[rank]; }
  bool AnyAttached() const;
  uint32_t NumAttached() const;

  // --- attachments ---
  // ALREADY_EXISTS when `rank` is attached (naming its pid). Precondition: rank < world_size().
  absl::Status CheckAttachable(uint32_t rank) const;
  // Starts a new attachment of `rank` (its previous state goes) and returns its token, unique for
  // this table's life; rank 0's comm ids go. Precondition: CheckAttachable(rank) is OK.
  const std::string& Attach(uint32_t rank, int32_t pid, std::string hostname, int32_t gpu,
                            Clock::time_point now);
  // OUT_OF_RANGE for a rank past the world size, FAILED_PRECONDITION for one not attached,
  // PERMISSION_DENIED for a token other than the attachment's.
  absl::Status CheckToken(uint32_t rank, const std::string& token) const;
  // True while `token` is the current attachment of `rank`.
  bool IsAttachment(uint32_t rank, const std::string& token) const;
  // Ends the rank's attachment (a detach or a lost session); rank 0's comm ids go with it.
  // Precondition: rank < world_size().
  void Release(uint32_t rank);
  // Records that the rank began `step`. Precondition: rank < world_size().
  void NoteBegun(uint32_t rank, uint64_t step) { ranks_[rank].last_step = step; }

  // --- sessions ---
  // Opens the attachment's session: CheckToken's errors, ALREADY_EXISTS when one is open.
  absl::Status OpenSession(uint32_t rank, const std::string& token, Clock::time_point now);
  // Renews the session's deadline; false (and nothing changes) unless the attachment is current
  // and its session open.
  bool Heartbeat(uint32_t rank, const std::string& token, Clock::time_point now);
  // True while the attachment is current and its session open.
  bool SessionOpen(uint32_t rank, const std::string& token) const;
  // The session of `rank` is closed by hostd (missed deadline); the rank stays attached and its
  // queued events stay deliverable. Precondition: rank < world_size().
  void Disconnect(uint32_t rank) { ranks_[rank].connected = false; }
  // The connected ranks whose last heartbeat is more than `deadline` before `now`, ascending.
  std::vector<uint32_t> MissedDeadline(Clock::time_point now, Clock::duration deadline) const;

  // --- session events ---
  // Queues `ev` for every rank whose session is open.
  void Broadcast(const slidedp::v1::SessionEvent& ev);
  // True when a waiter for the attachment's next event should wake: the attachment ended, its
  // session closed, or an event is queued.
  bool EventReadyOrGone(uint32_t rank, const std::string& token) const;
  // The attachment's oldest queued event; nullopt when none or the attachment ended.
  std::optional<slidedp::v1::SessionEvent> PopEvent(uint32_t rank, const std::string& token);

  // --- NCCL communicator ids of rank 0's current attachment ---
  // ALREADY_EXISTS when this attachment published `generation` already.
  absl::Status PublishCommId(uint64_t generation, std::string unique_id);
  // Null when rank 0's current attachment has not published `generation`.
  const std::string* FindCommId(uint64_t generation) const;

  // One RankStatus per rank, ms_since_heartbeat measured at `now` for the attached ones.
  std::vector<slidedp::v1::RankStatus> Statuses(Clock::time_point now) const;

 private:
  std::vector<RankEntry> ranks_;
  // The communicator ids rank 0's current attachment published, by generation.
  std::map<uint64_t, std::string> comm_ids_;
  uint64_t token_counter_ = 0;
};

}  // namespace slidedp::hostd
