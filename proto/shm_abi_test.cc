#include "proto/shm_abi.h"

#include <cstring>

#include "gtest/gtest.h"

namespace slidedp::shm {
namespace {

SegmentHeader ValidHeader() {
  SegmentHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kMagic;
  h.abi_version = kAbiVersion;
  h.kind = static_cast<uint32_t>(SegmentKind::kParams);
  h.size_bytes = 1 << 20;
  h.manifest_hash = 0xabcdef;
  h.payload_offset = kHeaderBytes;
  return h;
}

TEST(ShmAbiTest, ValidHeaderPasses) {
  SegmentHeader h = ValidHeader();
  EXPECT_EQ(ValidateHeader(h, SegmentKind::kParams, 1 << 20, 0xabcdef), nullptr);
}

TEST(ShmAbiTest, EachMismatchNamesItsField) {
  struct Case {
    void (*mutate)(SegmentHeader&);
    const char* field;
  } cases[] = {
      {[](SegmentHeader& h) { h.magic ^= 1; }, "magic"},
      {[](SegmentHeader& h) { h.abi_version += 1; }, "abi_version"},
      {[](SegmentHeader& h) { h.kind = static_cast<uint32_t>(SegmentKind::kGrads); }, "kind"},
      {[](SegmentHeader& h) { h.size_bytes -= 4096; }, "size_bytes"},
      {[](SegmentHeader& h) { h.manifest_hash = 7; }, "manifest_hash"},
      {[](SegmentHeader& h) { h.payload_offset = 64; }, "payload_offset"},
  };
  for (const Case& c : cases) {
    SegmentHeader h = ValidHeader();
    c.mutate(h);
    const char* got = ValidateHeader(h, SegmentKind::kParams, 1 << 20, 0xabcdef);
    ASSERT_NE(got, nullptr) << c.field;
    EXPECT_STREQ(got, c.field);
  }
}

TEST(ShmAbiTest, ControlLayoutIsCacheLineAligned) {
  EXPECT_EQ(kControlBlockOffset % 64, 0u);
  EXPECT_EQ(kRankSlotsOffset % 64, 0u);
  EXPECT_EQ(kLayerControlOffset % 64, 0u);
  EXPECT_EQ(ControlSegmentBytes(3), kLayerControlOffset + 3 * sizeof(LayerControl));
  EXPECT_EQ(AlignUp(1, 4096), 4096u);
  EXPECT_EQ(AlignUp(4096, 4096), 4096u);
  EXPECT_EQ(AlignUp(0, 4096), 0u);
}

TEST(ShmAbiTest, AtomicRefOperatesOnPlainFields) {
  LayerControl lc;
  std::memset(&lc, 0, sizeof(lc));
  Atomic(lc.committed_version).store(5, std::memory_order_release);
  EXPECT_EQ(lc.committed_version, 5u);
  EXPECT_EQ(Atomic(lc.wake_seq).fetch_add(1), 0u);
  EXPECT_EQ(lc.wake_seq, 1u);
}

TEST(ShmAbiTest, DTypeValuesAndSizes) {
  EXPECT_EQ(static_cast<uint32_t>(DType::kFp32), 1u);
  EXPECT_EQ(static_cast<uint32_t>(DType::kBf16), 2u);
  EXPECT_EQ(DTypeBytes(DType::kFp32), 4u);
  EXPECT_EQ(DTypeBytes(DType::kBf16), 2u);
  EXPECT_EQ(DTypeBytes(static_cast<DType>(0)), 0u);
  EXPECT_EQ(DTypeBytes(static_cast<DType>(3)), 0u);
  EXPECT_TRUE(IsDType(1));
  EXPECT_TRUE(IsDType(2));
  EXPECT_FALSE(IsDType(0));
  EXPECT_FALSE(IsDType(3));
  EXPECT_STREQ(DTypeName(DType::kFp32), "FP32");
  EXPECT_STREQ(DTypeName(DType::kBf16), "BF16");
  EXPECT_STREQ(DTypeName(static_cast<DType>(7)), "unknown");
}

}  // namespace
}  // namespace slidedp::shm
