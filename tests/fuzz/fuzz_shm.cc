// libFuzzer target: what hostd and the ranks validate in shared memory.
//
// 1. Segment headers (proto/shm_abi.h ValidateHeader): the input XORs the header of a real
//    control segment; ValidateHeader must accept it iff no checked field changed.
// 2. The gradient push protocol as hostd's GradientReducer sees it: a rank process owns the
//    ChunkSlot headers and the grads segment, so every header field is hostile. The input drives
//    fake ranks that push protocol-correct chunks (the harness keeps each rank's place in the
//    step), chunks with one corrupted header field, aborts and next steps; the reducer runs
//    synchronously (GradientReducer::PollOnce) against a real UpdateWorker. Oracles: no sanitizer
//    report, no error while every push was correct and no step was aborted, and a protocol
//    error leaves the sum route's rings empty.
// Input: byte 0 picks the route (sum of 2 ranks, 2 shards, 1 designated rank), the gradient
// dtype and the granularity; bytes 1..128 are the header mask; then 16-byte records (below).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_pool.h"
#include "hostd/optimizer.h"
#include "hostd/reducer.h"
#include "hostd/state.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"
#include "proto/shm_abi.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

namespace v1 = slidedp::v1;

constexpr uint64_t kChunkBytes = 4096;
constexpr uint32_t kRingSlots = 4;
constexpr uint32_t kWorld = 2;
constexpr size_t kRecordBytes = 16;

#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "fuzz_shm: check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      abort();                                                                            \
    }                                                                                     \
  } while (0)

ThreadPool* Pool() {
  static ThreadPool* pool = ThreadPool::Create({.num_threads = 1}).value().release();
  return pool;
}

model::LoadedModel FuzzModel() {
  model::LoadedModel m = testing::SmallModel();  // layers of 9970 and 15000 elements
  auto* l2 = m.manifest.add_layers();            // and one of 50: empty shards with 2 ranks
  l2->set_name("tiny");
  l2->set_kind(v1::LAYER_KIND_DECODER);
  auto* t = l2->add_tensors();
  t->set_name("tiny.bias");
  t->add_shape(50);
  t->set_dtype(v1::DTYPE_BF16);
  t->set_no_decay(true);
  return m;
}

template <typename T>
T Take(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// 1. Header validation against a mask over a real header.
void FuzzHeader(const shm::SegmentHeader& real, const uint8_t* mask, size_t n) {
  shm::SegmentHeader h = real;
  auto* bytes = reinterpret_cast<uint8_t*>(&h);
  for (size_t i = 0; i < n && i < sizeof(h); ++i) bytes[i] ^= mask[i];
  const bool same = h.magic == real.magic && h.abi_version == real.abi_version &&
                    h.kind == real.kind && h.size_bytes == real.size_bytes &&
                    h.manifest_hash == real.manifest_hash &&
                    h.payload_offset == real.payload_offset;
  const char* bad = shm::ValidateHeader(h, static_cast<shm::SegmentKind>(real.kind),
                                        real.size_bytes, real.manifest_hash);
  FUZZ_CHECK((bad == nullptr) == same);
}

// One fake rank: where it is in the step's push sequence.
struct FakeRank {
  uint32_t rank = 0;
  int part = -1;         // index in pushing_ranks, -1: not a pushing rank
  uint64_t seq = 0;      // next chunk's sequence number
  size_t layer_pos = 0;  // index into the push order
  uint64_t done = 0;     // elements of the current layer (or shard) pushed
};

class Harness {
 public:
  Harness(uint8_t mode) {
    const uint32_t route = mode % 3;
    type_ = (mode & 4) ? kernels::GradType::kFp32 : kernels::GradType::kBf16;
    const auto granularity = static_cast<GradientReducer::Granularity>((mode >> 3) % 3);
    TrainingState::Options so;
    so.instance = testing::UniqueInstance("fzshm");
    so.model = FuzzModel();
    so.seed = 3;
    so.world_size = kWorld;
    so.mlock = MlockPolicy::kOff;
    so.chunk_bytes = kChunkBytes;
    so.grad_ring_slots = kRingSlots;
    so.grad_dtype = type_ == kernels::GradType::kFp32 ? 1 : 2;
    so.grad_route = route == 0 ? 1 : route == 1 ? 3 : 2;
    state_ = TrainingState::Create(so, Pool()).value();
    state_->set_remove_on_destroy(true);
    v1::OptimizerConfig cfg;
    cfg.set_lr(1e-3);
    cfg.set_beta1(0.9);
    cfg.set_beta2(0.999);
    cfg.set_eps(1e-8);
    cfg.set_scale_by_world_size(true);
    cfg.set_grad_dtype(type_ == kernels::GradType::kFp32 ? v1::DTYPE_FP32 : v1::DTYPE_BF16);
    worker_ = std::make_unique<UpdateWorker>(state_.get(), Pool(),
                                             UpdateWorker::Options{kernels::Isa::kScalar, 8192},
                                             *model::NormalizeOptimizerConfig(cfg));
    GradientReducer::Options ro;
    ro.grad_type = type_;
    ro.granularity = granularity;
    if (route == 0) {
      ro.route = GradientReducer::Route::kSum;
      ro.pushing_ranks = {0, 1};
    } else if (route == 1) {
      ro.route = GradientReducer::Route::kShards;
      ro.pushing_ranks = {0, 1};
    } else {
      ro.route = GradientReducer::Route::kShards;
      ro.pushing_ranks = {1};  // GPU reduction: rank 1 pushes the aggregated gradient
    }
    sum_ = ro.route == GradientReducer::Route::kSum;
    parts_ = static_cast<uint32_t>(ro.pushing_ranks.size());
    for (uint32_t r = 0; r < kWorld; ++r) {
      FakeRank fr;
      fr.rank = r;
      for (size_t i = 0; i < ro.pushing_ranks.size(); ++i) {
        if (ro.pushing_ranks[i] == r) fr.part = static_cast<int>(i);
      }
      ranks_.push_back(fr);
    }
    worker_->Start();
    reducer_ = std::make_unique<GradientReducer>(
        state_.get(), Pool(), worker_.get(), ro,
        [this](const LayerUpdateResult& r) {
          if (!r.aborted) layers_done_.fetch_add(1);
        },
        [this](uint64_t step, const std::string& reason) {
          errors_++;
          // The reducer emptied every ring slot before reporting (no slot is lent on the sum
          // route, and nothing was pushed since).
          if (sum_) {
            for (uint32_t r = 0; r < kWorld; ++r) {
              for (uint32_t s = 0; s < kRingSlots; ++s) {
                FUZZ_CHECK(shm::Atomic(state_->chunk_slot(r, s).state).load() == shm::kSlotEmpty);
              }
            }
          }
          // What the engine does with a protocol error.
          reducer_->Abort(step);
          AbortWorker(step);
          aborted_ = true;
        });
    for (uint32_t l = state_->num_layers(); l-- > 0;) order_.push_back(l);  // backward order
    reducer_->Arm(step_);
  }

  ~Harness() {
    worker_->Stop();  // lent slots come back before the reducer goes
    reducer_.reset();
    worker_.reset();
  }

  const TrainingState& state() const { return *state_; }

  void Record(const uint8_t* r) {
    const uint8_t op = r[0] % 8;
    FakeRank& fr = ranks_[r[1] % kWorld];
    if (op <= 4) {
      Push(fr, op == 4 ? r[2] % 9 : 0, Take<uint64_t>(r + 3), r[11], r[12]);
    } else if (op == 5) {
      Drain();
    } else if (op == 6) {
      Abort();
    } else {
      NextStep();
    }
  }

  void Finish() {
    Drain();
    // Every push correct, nothing aborted: the protocol must not have failed.
    if (!corrupted_ && !aborted_) FUZZ_CHECK(errors_ == 0);
  }

 private:
  uint64_t LayerNumel(uint32_t l) const { return state_->layers()[l].numel; }
  // The range this rank pushes of layer `l`: the whole layer (sum), its shard, or nothing.
  shm::ShardRange Range(const FakeRank& fr, uint32_t l) const {
    if (fr.part < 0) return {0, 0};
    if (sum_) return {0, LayerNumel(l)};
    return shm::ShardOf(LayerNumel(l), parts_, static_cast<uint32_t>(fr.part));
  }
  // Skips layers where the rank has nothing to push; false when the step is all pushed.
  bool Settle(FakeRank& fr) const {
    while (fr.layer_pos < order_.size()) {
      const shm::ShardRange rg = Range(fr, order_[fr.layer_pos]);
      if (fr.done < rg.numel) return true;
      fr.layer_pos++;
      fr.done = 0;
    }
    return false;
  }

  // Pushes the rank's next chunk; `corrupt` names a header field to overwrite with `value`.
  void Push(FakeRank& fr, uint32_t corrupt, uint64_t value, uint8_t fill, uint8_t flags) {
    if (!Settle(fr)) {
      if (corrupt == 0) return;  // nothing left to push in this step
    }
    const uint32_t slot = static_cast<uint32_t>(fr.seq % kRingSlots);
    shm::ChunkSlot& cs = state_->chunk_slot(fr.rank, slot);
    // A rank waits for its slot; the harness lets hostd run, bounded (hostd may wait for another
    // rank's chunk, which is no error).
    for (int i = 0; i < 100 && shm::Atomic(cs.state).load() != shm::kSlotEmpty; ++i) {
      if (!reducer_->PollOnce()) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (shm::Atomic(cs.state).load() != shm::kSlotEmpty) return;
    const size_t elem = kernels::GradTypeBytes(type_);
    const uint64_t chunk_elems = kChunkBytes / elem;
    uint32_t layer = 0;
    uint64_t offset = 0;
    uint64_t numel = 1;
    bool first = false;
    if (fr.layer_pos < order_.size()) {
      layer = order_[fr.layer_pos];
      const shm::ShardRange rg = Range(fr, layer);
      offset = rg.begin + fr.done;
      numel = std::min(chunk_elems, rg.numel - fr.done);
      first = fr.done == 0;
    }
    // Gradient data: a repeated byte, so NaN/Inf patterns and denormals occur.
    auto* data = static_cast<uint8_t*>(state_->grad_slot_data(fr.rank, slot));
    std::memset(data, fill, kChunkBytes);
    double sumsq = 0;
    bool nonfinite = false;
    if (first && !sum_) {
      const shm::ShardRange rg = Range(fr, layer);
      float v;
      if (type_ == kernels::GradType::kFp32) {
        std::memset(&v, fill, sizeof(v));
      } else {
        uint16_t b;
        std::memset(&b, fill, sizeof(b));
        v = kernels::Bf16ToFp32(b);
      }
      nonfinite = !std::isfinite(v);
      sumsq = nonfinite ? 0 : static_cast<double>(v) * v * static_cast<double>(rg.numel);
    }
    cs.step = step_;
    cs.seq = fr.seq;
    cs.offset_elements = offset;
    cs.numel = numel;
    cs.layer = layer;
    cs.dtype = type_ == kernels::GradType::kFp32 ? 1 : 2;
    cs.flags = (first && !sum_ && (flags & 1) == 0)
                   ? shm::kChunkFlagStats | (nonfinite ? shm::kChunkFlagNonFinite : 0u)
                   : 0u;
    cs.stats_sumsq = sumsq;
    switch (corrupt) {
      case 0:
        break;
      case 1:
        cs.step = value % 4 == 0 ? step_ + 1 : value;  // an early next step is legal
        break;
      case 2:
        cs.seq = value;
        break;
      case 3:
        cs.offset_elements = value;
        break;
      case 4:
        cs.numel = value;
        break;
      case 5:
        cs.layer = static_cast<uint32_t>(value);
        break;
      case 6:
        cs.dtype = static_cast<uint32_t>(value);
        break;
      case 7:
        cs.flags = static_cast<uint32_t>(value);
        break;
      case 8:
        std::memcpy(&cs.stats_sumsq, &value, sizeof(double));
        break;
    }
    if (corrupt != 0) corrupted_ = true;
    shm::Atomic(cs.state).store(shm::kSlotFull, std::memory_order_release);
    fr.seq++;
    if (fr.layer_pos < order_.size()) fr.done += numel;
  }

  // Runs the reducer until it stalls, waiting (bounded) for the worker to return lent slots.
  void Drain() {
    for (int idle = 0; idle < 5;) {
      if (reducer_->PollOnce()) {
        idle = 0;
      } else {
        ++idle;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  // UpdateWorker::AbortStep seals the step on the worker thread; the engine's next BeginStep
  // waits for that (AwaitSealsLocked), so the harness does too before it arms the next step.
  void AbortWorker(uint64_t step) {
    seals_pending_++;
    worker_->AbortStep(step, [this] { seals_pending_--; });
  }
  void AwaitSeals() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (seals_pending_.load() != 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    FUZZ_CHECK(seals_pending_.load() == 0);
  }

  void ResetRanks() {
    for (FakeRank& fr : ranks_) fr = FakeRank{fr.rank, fr.part};
  }

  void Abort() {
    reducer_->Abort(step_);
    AbortWorker(step_);
    AwaitSeals();
    aborted_ = true;
    step_++;
    layers_done_ = 0;
    ResetRanks();
    reducer_->Arm(step_);
  }

  // The engine starts step t + 1 once every layer of t is published; if t cannot complete (a
  // push was lost or corrupted) it is aborted instead.
  void NextStep() {
    for (FakeRank& fr : ranks_) {
      if (Settle(fr)) return Abort();
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (layers_done_.load() < state_->num_layers() && errors_ == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      if (!reducer_->PollOnce()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (layers_done_.load() < state_->num_layers()) return Abort();
    AwaitSeals();
    step_++;
    layers_done_ = 0;
    ResetRanks();
    reducer_->Arm(step_);
  }

  kernels::GradType type_;
  bool sum_ = true;
  uint32_t parts_ = 1;
  std::unique_ptr<TrainingState> state_;
  std::unique_ptr<UpdateWorker> worker_;
  std::unique_ptr<GradientReducer> reducer_;
  std::vector<FakeRank> ranks_;
  std::vector<uint32_t> order_;
  uint64_t step_ = 1;
  std::atomic<uint32_t> layers_done_{0};
  std::atomic<int> seals_pending_{0};
  int errors_ = 0;  // the error callback runs on the polling thread
  bool corrupted_ = false;
  bool aborted_ = false;
};

}  // namespace
}  // namespace slidedp::hostd

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // FUZZ_VERBOSE=1 keeps hostd's log (the reasons of protocol errors) when reproducing.
  if (getenv("FUZZ_VERBOSE") == nullptr) spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slidedp::hostd;
  if (size < 1) return 0;
  Harness h(data[0]);
  const size_t mask_bytes = std::min<size_t>(size - 1, sizeof(slidedp::shm::SegmentHeader));
  // The control segment's header sits kControlBlockOffset bytes before its control block.
  const char* base =
      reinterpret_cast<const char*>(&h.state().control()) - slidedp::shm::kControlBlockOffset;
  FuzzHeader(*reinterpret_cast<const slidedp::shm::SegmentHeader*>(base), data + 1, mask_bytes);
  size_t pos = 1 + mask_bytes;
  for (int n = 0; pos + kRecordBytes <= size && n < 256; pos += kRecordBytes, ++n) {
    h.Record(data + pos);
  }
  h.Finish();
  return 0;
}
