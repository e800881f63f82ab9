#include "hostd/rank_table.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"

namespace slidedp::hostd {
namespace {

std::string RandomHex(int bytes) {
  std::random_device rd;
  std::string out;
  static constexpr char kHex[] = "0123456789abcdef";
  for (int i = 0; i < bytes; ++i) {
    const unsigned b = rd() & 0xff;
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

}  // namespace

void RankTable::Reset(uint32_t world_size) {
  ranks_.assign(world_size, RankEntry{});
  comm_ids_.clear();
}

bool RankTable::AnyAttached() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const RankEntry& e) { return e.attached; });
}

uint32_t RankTable::NumAttached() const {
  return static_cast<uint32_t>(
      std::count_if(ranks_.begin(), ranks_.end(), [](const RankEntry& e) { return e.attached; }));
}

absl::Status RankTable::CheckAttachable(uint32_t rank) const {
  const RankEntry& e = ranks_[rank];
  if (e.attached) {
    return absl::AlreadyExistsError(
        absl::StrCat("rank ", rank, " is already attached (pid ", e.pid, "); detach it first"));
  }
  return absl::OkStatus();
}

const std::string& RankTable::Attach(uint32_t rank, int32_t pid, std::string hostname, int32_t gpu,
                                     Clock::time_point now) {
  RankEntry& e = ranks_[rank];
  e = RankEntry{};
  e.attached = true;
  // The random part keeps a token unguessable, and one of an earlier hostd (whose counter also
  // began at 1) from matching; the counter keeps this table's tokens unique.
  e.token = absl::StrCat(RandomHex(16), "-", ++token_counter_);
  if (rank == 0) comm_ids_.clear();
  e.pid = pid;
  e.hostname = std::move(hostname);
  e.gpu = gpu;
  e.last_heartbeat = now;
  return e.token;
}

absl::Status RankTable::CheckToken(uint32_t rank, const std::string& token) const {
  if (rank >= ranks_.size()) {
    return absl::OutOfRangeError(absl::StrCat("rank: expected 0..", ranks_.size() - 1,
                                              " (world_size ", ranks_.size(), "), got ", rank));
  }
  if (!ranks_[rank].attached) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " is not attached; call AttachRank first"));
  }
  if (token != ranks_[rank].token) {
    return absl::PermissionDeniedError(
        absl::StrCat("attach_token: does not match the token issued to rank ", rank,
                     token.empty() ? " (none sent: a client older than protocol 2?)" : ""));
  }
  return absl::OkStatus();
}

bool RankTable::IsAttachment(uint32_t rank, const std::string& token) const {
  return rank < ranks_.size() && ranks_[rank].attached && ranks_[rank].token == token;
}

void RankTable::Release(uint32_t rank) {
  ranks_[rank] = RankEntry{};
  // The communicator ids rank 0 published die with its attachment: a rank of the next
  // attachment must not fetch them (its communicator would wait for a rank 0 long gone).
  if (rank == 0) comm_ids_.clear();
}

absl::Status RankTable::OpenSession(uint32_t rank, const std::string& token,
                                    Clock::time_point now) {
  if (absl::Status s = CheckToken(rank, token); !s.ok()) return s;
  RankEntry& e = ranks_[rank];
  if (e.connected) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " already has an open session"));
  }
  e.connected = true;
  e.last_heartbeat = now;
  return absl::OkStatus();
}

bool RankTable::Heartbeat(uint32_t rank, const std::string& token, Clock::time_point now) {
  if (!SessionOpen(rank, token)) return false;
  ranks_[rank].last_heartbeat = now;
  return true;
}

bool RankTable::SessionOpen(uint32_t rank, const std::string& token) const {
  return IsAttachment(rank, token) && ranks_[rank].connected;
}

std::vector<uint32_t> RankTable::MissedDeadline(Clock::time_point now,
                                                Clock::duration deadline) const {
  std::vector<uint32_t> missed;
  for (uint32_t r = 0; r < ranks_.size(); ++r) {
    const RankEntry& e = ranks_[r];
    if (e.connected && now - e.last_heartbeat > deadline) missed.push_back(r);
  }
  return missed;
}

void RankTable::Broadcast(const slidedp::v1::SessionEvent& ev) {
  for (RankEntry& e : ranks_) {
    if (e.connected) e.events.push_back(ev);
  }
}

bool RankTable::EventReadyOrGone(uint32_t rank, const std::string& token) const {
  return !IsAttachment(rank, token) || !ranks_[rank].connected || !ranks_[rank].events.empty();
}

std::optional<slidedp::v1::SessionEvent> RankTable::PopEvent(uint32_t rank,
                                                             const std::string& token) {
  if (!IsAttachment(rank, token) || ranks_[rank].events.empty()) return std::nullopt;
  slidedp::v1::SessionEvent ev = std::move(ranks_[rank].events.front());
  ranks_[rank].events.pop_front();
  return ev;
}

absl::Status RankTable::PublishCommId(uint64_t generation, std::string unique_id) {
  // Ids are of rank 0's current attachment (Release drops them with it), so a new training
  // process starts from any generation; within one attachment each is published once.
  if (!comm_ids_.emplace(generation, std::move(unique_id)).second) {
    return absl::AlreadyExistsError(absl::StrCat(
        "generation: ", generation,
        " is already published by this attachment of rank 0; a re-created communicator takes "
        "the next generation"));
  }
  return absl::OkStatus();
}

const std::string* RankTable::FindCommId(uint64_t generation) const {
  auto it = comm_ids_.find(generation);
  return it == comm_ids_.end() ? nullptr : &it->second;
}

std::vector<slidedp::v1::RankStatus> RankTable::Statuses(Clock::time_point now) const {
  std::vector<slidedp::v1::RankStatus> out;
  for (uint32_t r = 0; r < ranks_.size(); ++r) {
    const RankEntry& e = ranks_[r];
    slidedp::v1::RankStatus s;
    s.set_rank(r);
    s.set_pid(e.pid);
    s.set_hostname(e.hostname);
    s.set_gpu(e.gpu);
    s.set_connected(e.connected);
    s.set_attached(e.attached);
    s.set_last_step(e.last_step);
    if (e.attached) {
      s.set_ms_since_heartbeat(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(now - e.last_heartbeat).count()));
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace slidedp::hostd
