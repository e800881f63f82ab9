#include "hostd/rank_table.h"

#include <chrono>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

using std::chrono::milliseconds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Clock = RankTable::Clock;

slidedp::v1::SessionEvent StepBegun(uint64_t step) {
  slidedp::v1::SessionEvent ev;
  ev.mutable_step_begun()->set_step(step);
  return ev;
}

class RankTableTest : public ::testing::Test {
 protected:
  void SetUp() override { table_.Reset(3); }

  std::string AttachRank(uint32_t rank) {
    EXPECT_TRUE(table_.CheckAttachable(rank).ok());
    return table_.Attach(rank, /*pid=*/100 + static_cast<int32_t>(rank), "host", /*gpu=*/0, t0_);
  }

  RankTable table_;
  const Clock::time_point t0_ = Clock::now();
};

TEST_F(RankTableTest, StartsEmpty) {
  EXPECT_EQ(table_.world_size(), 3u);
  EXPECT_FALSE(table_.AnyAttached());
  EXPECT_EQ(table_.NumAttached(), 0u);
  const absl::Status s = table_.CheckToken(1, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("rank 1 is not attached"));
}

TEST_F(RankTableTest, RankPastTheWorldSizeIsOutOfRange) {
  const absl::Status s = table_.CheckToken(3, "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(s.message(), "rank: expected 0..2 (world_size 3), got 3");
  EXPECT_FALSE(table_.IsAttachment(3, "x"));
}

TEST_F(RankTableTest, AttachIssuesATokenThatCheckTokenAccepts) {
  const std::string token = AttachRank(1);
  EXPECT_FALSE(token.empty());
  EXPECT_TRUE(table_.CheckToken(1, token).ok());
  EXPECT_TRUE(table_.IsAttachment(1, token));
  EXPECT_FALSE(table_.IsAttachment(0, token));
  EXPECT_TRUE(table_.AnyAttached());
  EXPECT_EQ(table_.NumAttached(), 1u);
  EXPECT_EQ(table_.rank(1).pid, 101);
  EXPECT_EQ(table_.rank(1).hostname, "host");
}

TEST_F(RankTableTest, SecondAttachOfAnAttachedRankIsRefused) {
  AttachRank(2);
  const absl::Status s = table_.CheckAttachable(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), "rank 2 is already attached (pid 102); detach it first");
}

TEST_F(RankTableTest, WrongOrMissingTokenIsPermissionDenied) {
  AttachRank(0);
  absl::Status s = table_.CheckToken(0, "not-the-token");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "attach_token: does not match the token issued to rank 0");
  s = table_.CheckToken(0, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("(none sent"));
}

TEST_F(RankTableTest, ReattachIssuesANewTokenAndTheStaleOneIsRefused) {
  const std::string first = AttachRank(1);
  table_.Release(1);
  EXPECT_EQ(table_.CheckToken(1, first).code(), absl::StatusCode::kFailedPrecondition);
  const std::string second = AttachRank(1);
  EXPECT_NE(first, second);
  EXPECT_TRUE(table_.CheckToken(1, second).ok());
  EXPECT_EQ(table_.CheckToken(1, first).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(table_.IsAttachment(1, first));
}

TEST_F(RankTableTest, TokensStayUniqueAcrossResets) {
  const std::string before = AttachRank(0);
  table_.Reset(3);
  EXPECT_FALSE(table_.AnyAttached());
  EXPECT_NE(AttachRank(0), before);
}

TEST_F(RankTableTest, SessionOpensOnceAndOnlyForTheCurrentAttachment) {
  const std::string token = AttachRank(0);
  EXPECT_EQ(table_.OpenSession(0, "stale", t0_).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(table_.SessionOpen(0, token));
  ASSERT_TRUE(table_.OpenSession(0, token, t0_).ok());
  EXPECT_TRUE(table_.SessionOpen(0, token));
  EXPECT_TRUE(table_.rank(0).connected);
  const absl::Status again = table_.OpenSession(0, token, t0_);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(again.message(), "rank 0 already has an open session");
}

TEST_F(RankTableTest, LateCallsOfAnEndedAttachmentAreIgnored) {
  const std::string old_token = AttachRank(1);
  ASSERT_TRUE(table_.OpenSession(1, old_token, t0_).ok());
  table_.Release(1);
  const std::string token = AttachRank(1);
  ASSERT_TRUE(table_.OpenSession(1, token, t0_).ok());
  // The old stream's heartbeat, close check and event reads do not reach the new attachment.
  EXPECT_FALSE(table_.Heartbeat(1, old_token, t0_ + milliseconds(500)));
  EXPECT_EQ(table_.rank(1).last_heartbeat, t0_);
  EXPECT_FALSE(table_.IsAttachment(1, old_token));
  EXPECT_FALSE(table_.SessionOpen(1, old_token));
  table_.Broadcast(StepBegun(4));
  EXPECT_TRUE(table_.EventReadyOrGone(1, old_token));  // gone: its waiter wakes and ends
  EXPECT_FALSE(table_.PopEvent(1, old_token).has_value());
  ASSERT_EQ(table_.rank(1).events.size(), 1u);  // still there for the new attachment
  EXPECT_TRUE(table_.SessionOpen(1, token));
}

TEST_F(RankTableTest, HeartbeatNeedsAnOpenSession) {
  const std::string token = AttachRank(0);
  EXPECT_FALSE(table_.Heartbeat(0, token, t0_ + milliseconds(10)));
  ASSERT_TRUE(table_.OpenSession(0, token, t0_).ok());
  EXPECT_TRUE(table_.Heartbeat(0, token, t0_ + milliseconds(10)));
  EXPECT_EQ(table_.rank(0).last_heartbeat, t0_ + milliseconds(10));
}

TEST_F(RankTableTest, MissedDeadlineListsConnectedRanksPastTheirDeadline) {
  const std::string t0 = AttachRank(0);
  const std::string t1 = AttachRank(1);
  AttachRank(2);  // attached, no session: never misses a deadline
  ASSERT_TRUE(table_.OpenSession(0, t0, t0_).ok());
  ASSERT_TRUE(table_.OpenSession(1, t1, t0_).ok());
  const milliseconds deadline(1000);
  EXPECT_THAT(table_.MissedDeadline(t0_ + deadline, deadline), IsEmpty());  // exactly at it: ok
  ASSERT_TRUE(table_.Heartbeat(1, t1, t0_ + milliseconds(600)));
  EXPECT_THAT(table_.MissedDeadline(t0_ + milliseconds(1001), deadline), ElementsAre(0u));
  EXPECT_THAT(table_.MissedDeadline(t0_ + milliseconds(1601), deadline), ElementsAre(0u, 1u));
  // A disconnected rank stays attached and is not reported again.
  table_.Disconnect(0);
  EXPECT_TRUE(table_.IsAttachment(0, t0));
  EXPECT_FALSE(table_.SessionOpen(0, t0));
  EXPECT_THAT(table_.MissedDeadline(t0_ + milliseconds(1601), deadline), ElementsAre(1u));
}

TEST_F(RankTableTest, BroadcastQueuesForOpenSessionsInOrder) {
  const std::string t0 = AttachRank(0);
  const std::string t1 = AttachRank(1);
  ASSERT_TRUE(table_.OpenSession(0, t0, t0_).ok());
  EXPECT_FALSE(table_.EventReadyOrGone(0, t0));
  table_.Broadcast(StepBegun(1));
  table_.Broadcast(StepBegun(2));
  EXPECT_TRUE(table_.EventReadyOrGone(0, t0));
  EXPECT_THAT(table_.rank(1).events, IsEmpty());  // no session: nothing queued
  std::optional<slidedp::v1::SessionEvent> ev = table_.PopEvent(0, t0);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->step_begun().step(), 1u);
  ev = table_.PopEvent(0, t0);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->step_begun().step(), 2u);
  EXPECT_FALSE(table_.PopEvent(0, t0).has_value());
  EXPECT_FALSE(table_.EventReadyOrGone(0, t0));
  EXPECT_FALSE(table_.PopEvent(1, t1).has_value());
}

TEST_F(RankTableTest, QueuedEventsStayDeliverableAfterADisconnect) {
  const std::string token = AttachRank(0);
  ASSERT_TRUE(table_.OpenSession(0, token, t0_).ok());
  table_.Broadcast(StepBegun(7));
  table_.Disconnect(0);
  EXPECT_TRUE(table_.EventReadyOrGone(0, token));
  std::optional<slidedp::v1::SessionEvent> ev = table_.PopEvent(0, token);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->step_begun().step(), 7u);
  table_.Broadcast(StepBegun(8));  // not connected any more: not queued
  EXPECT_FALSE(table_.PopEvent(0, token).has_value());
}

TEST_F(RankTableTest, ReleaseDropsQueuedEvents) {
  const std::string token = AttachRank(0);
  ASSERT_TRUE(table_.OpenSession(0, token, t0_).ok());
  table_.Broadcast(StepBegun(1));
  table_.Release(0);
  const std::string next = AttachRank(0);
  EXPECT_FALSE(table_.PopEvent(0, next).has_value());
}

TEST_F(RankTableTest, CommIdsArePublishedOncePerGeneration) {
  AttachRank(0);
  EXPECT_EQ(table_.FindCommId(1), nullptr);
  ASSERT_TRUE(table_.PublishCommId(1, "id-1").ok());
  ASSERT_TRUE(table_.PublishCommId(2, "id-2").ok());
  const absl::Status s = table_.PublishCommId(1, "other");
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("generation: 1 is already published"));
  ASSERT_NE(table_.FindCommId(1), nullptr);
  EXPECT_EQ(*table_.FindCommId(1), "id-1");
  EXPECT_EQ(*table_.FindCommId(2), "id-2");
}

TEST_F(RankTableTest, CommIdsDieWithRankZerosAttachment) {
  AttachRank(0);
  AttachRank(1);
  ASSERT_TRUE(table_.PublishCommId(1, "first").ok());
  table_.Release(1);  // another rank's detach leaves them
  ASSERT_NE(table_.FindCommId(1), nullptr);
  table_.Release(0);
  EXPECT_EQ(table_.FindCommId(1), nullptr);
  // The next attachment of rank 0 starts again from any generation, generation 1 included.
  AttachRank(0);
  EXPECT_EQ(table_.FindCommId(1), nullptr);
  ASSERT_TRUE(table_.PublishCommId(1, "second").ok());
  EXPECT_EQ(*table_.FindCommId(1), "second");
}

TEST_F(RankTableTest, StatusesReportEveryRank) {
  const std::string token = AttachRank(1);
  ASSERT_TRUE(table_.OpenSession(1, token, t0_).ok());
  table_.NoteBegun(1, 5);
  const std::vector<slidedp::v1::RankStatus> st = table_.Statuses(t0_ + milliseconds(250));
  ASSERT_EQ(st.size(), 3u);
  EXPECT_EQ(st[0].rank(), 0u);
  EXPECT_FALSE(st[0].attached());
  EXPECT_EQ(st[0].ms_since_heartbeat(), 0u);
  EXPECT_EQ(st[1].rank(), 1u);
  EXPECT_TRUE(st[1].attached());
  EXPECT_TRUE(st[1].connected());
  EXPECT_EQ(st[1].pid(), 101);
  EXPECT_EQ(st[1].last_step(), 5u);
  EXPECT_EQ(st[1].ms_since_heartbeat(), 250u);
}

}  // namespace
}  // namespace slidedp::hostd
