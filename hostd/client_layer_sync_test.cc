#include "hostd/client_layer_sync.h"

#include <cstdint>
#include <optional>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Four layers of 10, 20, 30 and 40 elements; hostd's copy of all at version 0 (a fresh job).
class ClientLayerSyncTest : public ::testing::Test {
 protected:
  void SetUp() override { sync_.Reset({10, 20, 30, 40}, 0); }

  // Uploads every part of `layer` at `step` in pieces of `piece` elements.
  ClientLayerSync::PieceDone UploadLayer(uint32_t layer, uint64_t step, uint64_t numel,
                                         uint64_t piece) {
    ClientLayerSync::PieceDone done;
    for (uint32_t part = 0; part < ClientLayerSync::kParts; ++part) {
      for (uint64_t off = 0; off < numel; off += piece) {
        const uint64_t n = std::min(piece, numel - off);
        EXPECT_TRUE(sync_.BeginPiece(layer, part, off, step).ok());
        done = sync_.EndPiece(layer, part, off, n);
      }
    }
    return done;
  }

  ClientLayerSync sync_;
};

TEST(LayerListTest, NamesTheLayersOrSaysNone) {
  EXPECT_EQ(LayerList({}), "[] (none)");
  EXPECT_EQ(LayerList({1, 4}), "[1, 4]");
}

TEST_F(ClientLayerSyncTest, NormalizeSetSortsAndRefusesUnknownOrRepeatedLayers) {
  absl::StatusOr<std::vector<uint32_t>> set = sync_.NormalizeSet({3, 0});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_THAT(*set, ElementsAre(0, 3));
  absl::StatusOr<std::vector<uint32_t>> bad = sync_.NormalizeSet({4});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(bad.status().message(), HasSubstr("layer 4 does not exist; expected 0..3"));
  bad = sync_.NormalizeSet({2, 1, 2});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("layer 2 is listed twice"));
}

TEST_F(ClientLayerSyncTest, TheSetChangesOnlyWithNoRankAttachedNoStepAndACurrentCopy) {
  EXPECT_TRUE(sync_.CheckChange({1}, 0, false, 0, 0).ok());
  sync_.SetLayers({1}, 0);
  EXPECT_TRUE(sync_.is_client(1));
  EXPECT_FALSE(sync_.is_client(0));
  EXPECT_THAT(sync_.updated(), ElementsAre(false, true, false, false));
  // The same set is always fine; another is refused while a rank is attached or a step runs.
  EXPECT_TRUE(sync_.CheckChange({1}, 1, true, 5, 4).ok());
  absl::Status s = sync_.CheckChange({2}, 1, true, 0, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("rank 1 sent [2] but the attached ranks update [1]"));
  s = sync_.CheckChange({2}, 0, false, 1, 0);
  EXPECT_THAT(s.message(), HasSubstr("step 1 is running"));
  // Once the ranks trained layer 1 past hostd's copy (at 0), the set is fixed.
  s = sync_.CheckChange({}, 0, false, 0, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("hostd's copy of them is at version 0, not the job's step 3"));
}

TEST_F(ClientLayerSyncTest, NewlyListedLayersAreCurrentAtTheLastCompletedStep) {
  // hostd updated layer 2 through step 6: its copy is the job's state at 6.
  sync_.SetLayers({2}, 6);
  EXPECT_EQ(sync_.copy_version(), 6u);
  EXPECT_TRUE(sync_.CopyCurrent(0, 6));
  EXPECT_FALSE(sync_.CopyCurrent(7, 6));  // a step runs: the ranks' state moves on
  EXPECT_FALSE(sync_.CopyCurrent(0, 7));
}

TEST_F(ClientLayerSyncTest, AnUnknownCopyStaysUnknownAndIsNeverCurrent) {
  sync_.Reset({10, 20}, std::nullopt);   // a re-adopted job
  EXPECT_TRUE(sync_.CopyCurrent(0, 5));  // no set: hostd's copy is everything
  sync_.SetLayers({0}, 5);
  EXPECT_EQ(sync_.copy_version(), std::nullopt);
  EXPECT_FALSE(sync_.CopyCurrent(0, 5));
  EXPECT_EQ(sync_.DescribeCopy(), "of an unknown version");
  absl::Status s = sync_.CheckReadable(0, 0, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("copy of layer 0 is of an unknown version but the job is at "
                                     "step 5"));
}

TEST_F(ClientLayerSyncTest, CheckpointsOfAnotherVersionAwaitTheSet) {
  EXPECT_TRUE(sync_.CheckCheckpointable(9).ok());  // no set
  EXPECT_THAT(sync_.AwaitedBy(9), IsEmpty());
  sync_.SetLayers({0, 3}, 4);
  EXPECT_TRUE(sync_.CheckCheckpointable(4).ok());
  EXPECT_THAT(sync_.AwaitedBy(4), IsEmpty());
  absl::Status s = sync_.CheckCheckpointable(5);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("layers [0, 3] themselves (client_updated_layers) and "
                                     "hostd's copy of them is at version 4, not 5"));
  EXPECT_THAT(sync_.AwaitedBy(5), ElementsAre(0, 3));
}

TEST_F(ClientLayerSyncTest, PartsAndRangesAreChecked) {
  sync_.SetLayers({1}, 0);
  EXPECT_TRUE(sync_.CheckPart(1, 2).ok());
  EXPECT_EQ(sync_.CheckPart(4, 0).code(), absl::StatusCode::kOutOfRange);
  absl::Status s = sync_.CheckPart(0, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("layer: 0 is not updated by the ranks; the client-updated "
                                     "layers are [1]"));
  EXPECT_EQ(sync_.CheckPart(1, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(sync_.CheckRange(1, 15, 5).ok());
  s = sync_.CheckRange(1, 15, 6);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("offset: 15 + 6 elements pass the end of layer 1 (20"));
  // An offset past the end with a count that wraps is refused too.
  EXPECT_FALSE(sync_.CheckRange(1, 21, UINT64_MAX).ok());
  EXPECT_FALSE(sync_.CheckRange(1, 1, UINT64_MAX).ok());
}

TEST_F(ClientLayerSyncTest, AnAskedUploadCarriesTheAskedVersion) {
  sync_.SetLayers({1}, 0);
  sync_.SetSyncStep(3);
  EXPECT_TRUE(sync_.CheckUploadVersion(3, 4, 4, true).ok());  // while step 4 runs, an export
  absl::Status s = sync_.CheckUploadVersion(2, 0, 3, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("a checkpoint asks for version 3, got 2"));
  EXPECT_FALSE(sync_.ShouldWithdraw(3));
  EXPECT_TRUE(sync_.ShouldWithdraw(0));  // its checkpoint is over
}

TEST_F(ClientLayerSyncTest, AnUnaskedUploadIsOfTheLastCompletedStepBetweenSteps) {
  sync_.SetLayers({1}, 0);
  EXPECT_TRUE(sync_.CheckUploadVersion(2, 0, 3, false).ok());
  absl::Status s = sync_.CheckUploadVersion(2, 3, 3, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("got version 2 while step 3 runs"));
  EXPECT_FALSE(sync_.CheckUploadVersion(1, 0, 3, false).ok());
  EXPECT_FALSE(sync_.CheckUploadVersion(2, 0, 3, true).ok());  // an export runs
  // The copy at version 0 (the job's start): uploading version 0 again is ALREADY_EXISTS.
  EXPECT_EQ(sync_.CheckUploadVersion(0, 0, 1, false).code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(ClientLayerSyncTest, AnUploadCompletesLayerByLayerAndMovesTheCopy) {
  sync_.SetLayers({1, 2}, 0);
  ClientLayerSync::PieceDone done = UploadLayer(1, 5, 20, 7);
  EXPECT_TRUE(done.layer_complete);
  EXPECT_FALSE(done.all_complete);
  EXPECT_EQ(sync_.copy_version(), 0u);
  // A complete layer of the same version is not taken twice.
  EXPECT_EQ(sync_.BeginPiece(1, 0, 0, 5).code(), absl::StatusCode::kAlreadyExists);
  done = UploadLayer(2, 5, 30, 30);
  EXPECT_TRUE(done.layer_complete);
  EXPECT_TRUE(done.all_complete);
  EXPECT_EQ(sync_.copy_version(), 5u);
  EXPECT_TRUE(sync_.CopyCurrent(0, 5));
  // The next version starts over.
  EXPECT_TRUE(sync_.BeginPiece(1, 0, 0, 6).ok());
  EXPECT_FALSE(sync_.EndPiece(1, 0, 0, 20).layer_complete);
  EXPECT_EQ(sync_.copy_version(), 5u);
}

TEST_F(ClientLayerSyncTest, PiecesComeInOrderOneAtATime) {
  sync_.SetLayers({1}, 0);
  ASSERT_TRUE(sync_.BeginPiece(1, 0, 0, 2).ok());
  absl::Status s = sync_.BeginPiece(1, 1, 0, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("one piece at a time"));
  sync_.EndPiece(1, 0, 0, 8);
  s = sync_.BeginPiece(1, 0, 9, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("offset: expected 8 (or 0 to restart the part)"));
  ASSERT_TRUE(sync_.BeginPiece(1, 0, 8, 2).ok());
  sync_.EndPiece(1, 0, 8, 12);
  // Offset 0 restarts a part: it must be sent whole again.
  ASSERT_TRUE(sync_.BeginPiece(1, 0, 0, 2).ok());
  sync_.EndPiece(1, 0, 0, 4);
  ASSERT_TRUE(sync_.BeginPiece(1, 1, 0, 2).ok());
  sync_.EndPiece(1, 1, 0, 20);
  ASSERT_TRUE(sync_.BeginPiece(1, 2, 0, 2).ok());
  EXPECT_FALSE(sync_.EndPiece(1, 2, 0, 20).layer_complete);  // master has 4 of 20
}

TEST_F(ClientLayerSyncTest, ResetForgetsTheSetTheRequestAndTheUpload) {
  sync_.SetLayers({1}, 0);
  sync_.SetSyncStep(4);
  ASSERT_TRUE(sync_.BeginPiece(1, 0, 0, 4).ok());
  sync_.Reset({10, 20}, 7);
  EXPECT_TRUE(sync_.empty());
  EXPECT_EQ(sync_.sync_step(), 0u);
  EXPECT_EQ(sync_.copy_version(), 7u);
  EXPECT_THAT(sync_.updated(), ElementsAre(false, false));
}

}  // namespace
}  // namespace slidedp::hostd
