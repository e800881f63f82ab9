#include "proto/grad_ring.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "proto/doorbell.h"

namespace slidedp::shm {
namespace {

// A control and a grads segment's worth of zeroed, page-aligned memory for a small ring (page
// aligned as the mappings are: ChunkSlot is alignas(64)).
struct Segments {
  explicit Segments(RingShape s) : shape(s) {
    uint64_t grads_bytes = 0;
    EXPECT_TRUE(GradSegmentBytes(s.world_size, s.slots_per_rank, s.chunk_bytes, &grads_bytes));
    control = Page(ControlSegmentBytes(s.layer_count, s.world_size, s.slots_per_rank));
    grads = Page(grads_bytes);
  }
  GradRing ring() { return GradRing(control.get(), grads.get(), shape); }
  char* control_base() { return control.get(); }
  char* grads_base() { return grads.get(); }

  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  static std::unique_ptr<char, Free> Page(size_t bytes) {
    const size_t rounded = AlignUp(bytes, kPayloadAlign);
    std::unique_ptr<char, Free> p(static_cast<char*>(std::aligned_alloc(kPayloadAlign, rounded)));
    std::memset(p.get(), 0, rounded);
    return p;
  }

  RingShape shape;
  std::unique_ptr<char, Free> control;
  std::unique_ptr<char, Free> grads;
};

constexpr RingShape kShape{/*layer_count=*/3, /*world_size=*/2, /*slots_per_rank=*/4,
                           /*chunk_bytes=*/256};

ChunkHeader SomeHeader() {
  ChunkHeader h;
  h.step = 5;
  h.seq = 6;
  h.offset_elements = 64;
  h.numel = 32;
  h.layer = 2;
  h.dtype = static_cast<uint32_t>(DType::kFp32);
  h.flags = kChunkFlagStats;
  h.stats_sumsq = 12.5;
  return h;
}

TEST(GradRingTest, SlotsAndDataLieWhereTheAbiSays) {
  Segments seg(kShape);
  const GradRing ring = seg.ring();
  for (uint32_t r = 0; r < kShape.world_size; ++r) {
    for (uint32_t s = 0; s < kShape.slots_per_rank; ++s) {
      EXPECT_EQ(reinterpret_cast<char*>(&ring.slot(r, s)),
                seg.control_base() + ChunkSlotsOffset(3) + (r * 4 + s) * sizeof(ChunkSlot));
      EXPECT_EQ(static_cast<char*>(ring.data(r, s)),
                seg.grads_base() + kHeaderBytes + (r * 4 + s) * kShape.chunk_bytes);
    }
  }
  EXPECT_EQ(ring.SlotOf(0), 0u);
  EXPECT_EQ(ring.SlotOf(3), 3u);
  EXPECT_EQ(ring.SlotOf(4), 0u);
  EXPECT_EQ(ring.SlotOf(4 * 1000 + 2), 2u);
  EXPECT_EQ(ring.ChunkElems(DType::kFp32), 64u);
  EXPECT_EQ(ring.ChunkElems(DType::kBf16), 128u);
  EXPECT_EQ(ring.ChunkElems(static_cast<DType>(9)), 0u);
}

TEST(GradRingTest, ASlotGoesEmptyFullEmpty) {
  Segments seg(kShape);
  ChunkSlot& cs = seg.ring().slot(1, 2);
  EXPECT_TRUE(SlotIsEmpty(cs));
  EXPECT_FALSE(SlotIsFull(cs));
  ChunkHeader h;
  h.step = 99;
  EXPECT_FALSE(ReadFullSlot(cs, &h));
  EXPECT_EQ(h.step, 99u);  // untouched while the slot is empty

  const ChunkHeader sent = SomeHeader();
  PublishChunk(cs, sent);
  EXPECT_TRUE(SlotIsFull(cs));
  EXPECT_FALSE(SlotIsEmpty(cs));
  ChunkHeader got;
  ASSERT_TRUE(ReadFullSlot(cs, &got));
  EXPECT_EQ(got.step, sent.step);
  EXPECT_EQ(got.seq, sent.seq);
  EXPECT_EQ(got.offset_elements, sent.offset_elements);
  EXPECT_EQ(got.numel, sent.numel);
  EXPECT_EQ(got.layer, sent.layer);
  EXPECT_EQ(got.dtype, sent.dtype);
  EXPECT_EQ(got.flags, sent.flags);
  EXPECT_EQ(got.stats_sumsq, sent.stats_sumsq);

  const uint32_t wake_before = Atomic(cs.wake_seq).load();
  ReleaseSlot(cs);
  EXPECT_TRUE(SlotIsEmpty(cs));
  EXPECT_EQ(Atomic(cs.wake_seq).load(), wake_before + 1);  // a waiting rank is rung
  // The other slots saw none of it.
  EXPECT_TRUE(SlotIsEmpty(seg.ring().slot(1, 1)));
  EXPECT_EQ(seg.ring().slot(1, 3).wake_seq, 0u);
}

// A producer and a consumer thread hand chunks through one ring the way a rank and hostd do
// (the consumer checks the data the release store published); each side sleeps on the doorbell
// the other rings.
TEST(GradRingTest, ChunksHandedThroughTheRingArriveWhole) {
  Segments seg(kShape);
  const GradRing ring = seg.ring();
  uint32_t doorbell = 0;
  constexpr uint64_t kChunks = 2000;
  const uint64_t elems = ring.ChunkElems(DType::kFp32);
  std::thread producer([&] {
    for (uint64_t seq = 0; seq < kChunks; ++seq) {
      ChunkSlot& cs = ring.slot(0, ring.SlotOf(seq));
      const Doorbell slot_bell(&cs.wake_seq);
      for (;;) {
        const uint32_t seen = slot_bell.Load();
        if (SlotIsEmpty(cs)) break;
        slot_bell.Wait(seen, std::chrono::milliseconds(100));
      }
      auto* data = static_cast<float*>(ring.data(0, ring.SlotOf(seq)));
      for (uint64_t i = 0; i < elems; ++i) data[i] = static_cast<float>(seq * 1000 + i);
      ChunkHeader h = SomeHeader();
      h.seq = seq;
      h.numel = elems;
      PublishChunk(cs, h);
      Doorbell(&doorbell).Ring();
    }
  });
  const Doorbell bell(&doorbell);
  uint64_t bad = 0;
  for (uint64_t seq = 0; seq < kChunks; ++seq) {
    ChunkSlot& cs = ring.slot(0, ring.SlotOf(seq));
    ChunkHeader h;
    for (;;) {
      const uint32_t seen = bell.Load();
      if (ReadFullSlot(cs, &h)) break;
      bell.Wait(seen, std::chrono::milliseconds(100));
    }
    const auto* data = static_cast<const float*>(ring.data(0, ring.SlotOf(seq)));
    bad += h.seq != seq || h.numel != elems;
    for (uint64_t i = 0; i < elems; ++i) bad += data[i] != static_cast<float>(seq * 1000 + i);
    ReleaseSlot(cs);
  }
  producer.join();
  EXPECT_EQ(bad, 0u);
}

TEST(GradRingTest, CheckChunkHeaderPassesAValidHeader) {
  const ChunkLimits limits{DType::kFp32, 3, 256};
  EXPECT_EQ(CheckChunkHeader(SomeHeader(), limits), nullptr);
  ChunkHeader full = SomeHeader();
  full.numel = 64;  // exactly a slot
  EXPECT_EQ(CheckChunkHeader(full, limits), nullptr);
  ChunkHeader nonfinite = SomeHeader();
  nonfinite.flags = kChunkFlagStats | kChunkFlagNonFinite;
  EXPECT_EQ(CheckChunkHeader(nonfinite, limits), nullptr);
  ChunkHeader bf16 = SomeHeader();
  bf16.dtype = static_cast<uint32_t>(DType::kBf16);
  bf16.numel = 128;
  bf16.flags = 0;
  EXPECT_EQ(CheckChunkHeader(bf16, ChunkLimits{DType::kBf16, 3, 256}), nullptr);
}

TEST(GradRingTest, CheckChunkHeaderNamesTheBadField) {
  const ChunkLimits limits{DType::kFp32, 3, 256};
  struct Case {
    void (*mutate)(ChunkHeader&);
    const char* field;
  };
  const Case cases[] = {
      {[](ChunkHeader& h) { h.dtype = 0; }, "dtype"},
      {[](ChunkHeader& h) { h.dtype = 3; }, "dtype"},
      {[](ChunkHeader& h) { h.dtype = static_cast<uint32_t>(DType::kBf16); }, "dtype"},
      {[](ChunkHeader& h) { h.layer = 3; }, "layer"},
      {[](ChunkHeader& h) { h.layer = 0xFFFFFFFF; }, "layer"},
      {[](ChunkHeader& h) { h.numel = 0; }, "numel"},
      {[](ChunkHeader& h) { h.numel = 65; }, "numel"},
      {[](ChunkHeader& h) { h.numel = ~uint64_t{0}; }, "numel"},
      {[](ChunkHeader& h) { h.flags = 1u << 5; }, "flags"},
      {[](ChunkHeader& h) { h.flags = kChunkFlagNonFinite; }, "flags"},
  };
  for (const Case& c : cases) {
    ChunkHeader h = SomeHeader();
    c.mutate(h);
    const char* got = CheckChunkHeader(h, limits);
    ASSERT_NE(got, nullptr) << c.field;
    EXPECT_STREQ(got, c.field);
  }
}

}  // namespace
}  // namespace slidedp::shm
