#include "hostd/state.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "gtest/gtest.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"

namespace slidedp::hostd {
namespace {

using testing::SmallModel;
using testing::UniqueInstance;

std::unique_ptr<TrainingState> MakeState(const std::string& instance, ThreadPool* pool,
                                         uint64_t seed = 7) {
  TrainingState::Options o;
  o.instance = instance;
  o.model = SmallModel();
  o.seed = seed;
  auto s = TrainingState::Create(o, pool);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  (*s)->set_remove_on_destroy(true);
  return std::move(*s);
}

TEST(StateTest, LayoutIsPageAlignedAndHeadersValid) {
  auto s = MakeState(UniqueInstance("layout"), nullptr);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->num_layers(), 2u);
  EXPECT_EQ(s->layers()[0].numel, 37u + 129u * 77u);
  EXPECT_EQ(s->layers()[1].numel, 15000u);
  EXPECT_EQ(s->total_params(), 37u + 129u * 77u + 15000u);
  for (const LayerInfo& l : s->layers()) {
    EXPECT_EQ(l.state_offset % 4096, 0u);
    EXPECT_EQ(l.param_offset % 4096, 0u);
    EXPECT_EQ(l.state_stride % 4096, 0u);
    EXPECT_GE(l.state_stride, l.numel * 4);
    EXPECT_EQ(s->committed_version(l.index), 0u);
    EXPECT_EQ(s->layer_control(l.index).numel, l.numel);
  }
  for (const auto& seg : s->segments()) {
    auto view = ShmSegment::Open(seg.name, false);
    ASSERT_TRUE(view.ok()) << view.status();
    const auto* h = view->at<shm::SegmentHeader>(0);
    EXPECT_EQ(shm::ValidateHeader(*h, seg.kind, seg.size_bytes, s->manifest_hash()), nullptr);
    EXPECT_EQ(h->ready, 1u);
    EXPECT_EQ(h->layer_count, 2u);
    struct stat st;
    ASSERT_EQ(stat(("/dev/shm/" + seg.name).c_str(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), seg.size_bytes);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  EXPECT_EQ(s->control().next_step, 1u);
}

// Moments of layers the ranks update are given back to the system: they read as zeros, the
// segment's file holds fewer blocks, and nothing else changes.
TEST(StateTest, ReleaseMomentsFreesTheirPagesAndKeepsEverythingElse) {
  auto s = MakeState(UniqueInstance("release"), nullptr);
  ASSERT_NE(s, nullptr);
  const LayerInfo& l1 = s->layers()[1];
  for (uint64_t i = 0; i < l1.numel; ++i) {
    s->exp_avg(1)[i] = 1.0f;
    s->exp_avg_sq(1)[i] = 2.0f;
  }
  const uint64_t layer0 = s->LayerChecksum(0);
  const std::vector<float> master1(s->master(1), s->master(1) + l1.numel);
  const std::vector<uint16_t> params1(s->params(1), s->params(1) + l1.numel);
  std::string state_name;
  for (const auto& seg : s->segments()) {
    if (seg.kind == shm::SegmentKind::kState) state_name = seg.name;
  }
  struct stat before, after;
  ASSERT_EQ(stat(("/dev/shm/" + state_name).c_str(), &before), 0);
  auto released = s->ReleaseMoments(1);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, 2 * l1.state_stride);
  ASSERT_EQ(stat(("/dev/shm/" + state_name).c_str(), &after), 0);
  EXPECT_EQ(static_cast<uint64_t>(before.st_blocks - after.st_blocks) * 512, *released);
  for (uint64_t i = 0; i < l1.numel; ++i) {
    ASSERT_EQ(s->exp_avg(1)[i], 0.0f) << i;
    ASSERT_EQ(s->exp_avg_sq(1)[i], 0.0f) << i;
  }
  EXPECT_EQ(std::vector<float>(s->master(1), s->master(1) + l1.numel), master1);
  EXPECT_EQ(std::vector<uint16_t>(s->params(1), s->params(1) + l1.numel), params1);
  EXPECT_EQ(s->LayerChecksum(0), layer0);
  s->exp_avg(1)[0] = 3.0f;  // written again: memory comes back
  EXPECT_EQ(s->exp_avg(1)[0], 3.0f);
}

TEST(StateTest, InitIsDeterministicThreadIndependentAndHfLike) {
  auto pool = ThreadPool::Create({.num_threads = 3});
  ASSERT_TRUE(pool.ok());
  auto a = MakeState(UniqueInstance("init-a"), nullptr, 11);
  auto b = MakeState(UniqueInstance("init-b"), pool->get(), 11);
  auto c = MakeState(UniqueInstance("init-c"), nullptr, 12);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->Checksum(), b->Checksum());
  EXPECT_NE(a->Checksum(), c->Checksum());
  // Norm weights are ones; the projection is N(0, 0.02); m = v = 0; params = bf16(master).
  const float* w0 = a->master(0);
  for (int i = 0; i < 37; ++i) EXPECT_EQ(w0[i], 1.0f);
  double sum = 0, sumsq = 0;
  const uint64_t n = 129 * 77;
  for (uint64_t i = 37; i < 37 + n; ++i) {
    sum += w0[i];
    sumsq += double{w0[i]} * w0[i];
  }
  const double mean = sum / n, sd = std::sqrt(sumsq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.002);
  EXPECT_NEAR(sd, 0.02, 0.001);
  for (uint32_t l = 0; l < a->num_layers(); ++l) {
    for (uint64_t i = 0; i < a->layers()[l].numel; ++i) {
      ASSERT_EQ(a->exp_avg(l)[i], 0.0f);
      ASSERT_EQ(a->exp_avg_sq(l)[i], 0.0f);
      ASSERT_EQ(a->params(l)[i], kernels::RoundToBf16(a->master(l)[i]));
    }
  }
}

TEST(StateTest, ExistingInstanceIsAlreadyExistsAndRemoveSegmentsCleansUp) {
  const std::string inst = UniqueInstance("dup");
  TrainingState::Options o;
  o.instance = inst;
  o.model = SmallModel();
  auto first = TrainingState::Create(o, nullptr);
  ASSERT_TRUE(first.ok());
  auto second = TrainingState::Create(o, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  // The failed Create removed nothing of the first.
  EXPECT_TRUE(ShmSegment::Exists(SegmentName(inst, shm::SegmentKind::kState)));
  first->reset();  // crash-like: the names stay for re-adoption
  EXPECT_TRUE(ShmSegment::Exists(SegmentName(inst, shm::SegmentKind::kParams)));
  ASSERT_TRUE(TrainingState::RemoveSegments(o).ok());
  EXPECT_FALSE(ShmSegment::Exists(SegmentName(inst, shm::SegmentKind::kControl)));
}

std::string ShmPath(const std::string& inst, shm::SegmentKind kind) {
  return "/dev/shm/" + SegmentName(inst, kind);
}

constexpr shm::SegmentKind kKinds[] = {shm::SegmentKind::kControl, shm::SegmentKind::kState,
                                       shm::SegmentKind::kParams, shm::SegmentKind::kGrads};

// Removes whatever a test left under the instance's names, whoever owns it (on any exit).
struct ShmJanitor {
  std::string inst;
  ~ShmJanitor() {
    for (auto kind : kKinds) {
      unlink(ShmPath(inst, kind).c_str());
      unlink((ShmPath(inst, kind) + ".moved").c_str());
    }
  }
};

// shm_mode 0660 with a group reaches the segments ranks map; the state segment (master, m, v) is
// hostd's alone: 0600, hostd's own group.
TEST(StateTest, StateSegmentIs0600AndTheOthersGetModeAndGroup) {
  const std::string inst = UniqueInstance("group");
  ShmJanitor janitor{inst};
  TrainingState::Options o;
  o.instance = inst;
  o.model = SmallModel();
  o.mlock = MlockPolicy::kBestEffort;
  o.mode = 0660;
  o.group = testing::OtherGroup();
  auto s = TrainingState::Create(o, nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  (*s)->set_remove_on_destroy(true);
  for (auto kind : kKinds) {
    struct stat st;
    ASSERT_EQ(stat(ShmPath(inst, kind).c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, geteuid()) << ShmPath(inst, kind);
    if (kind == shm::SegmentKind::kState) {
      EXPECT_EQ(st.st_mode & 0777, 0600u) << ShmPath(inst, kind);
      EXPECT_EQ(st.st_gid, getegid()) << ShmPath(inst, kind);
    } else {
      EXPECT_EQ(st.st_mode & 0777, 0660u) << ShmPath(inst, kind);
      EXPECT_EQ(st.st_gid, o.group) << ShmPath(inst, kind);
    }
  }
}

// A crashed hostd's segments are mapped again only when they are hostd's: a wider mode than
// configured, another user's segment or a link in a segment's place is FAILED_PRECONDITION naming
// the file, its owner and mode and what was expected, and RemoveSegments removes none of them.
TEST(StateTest, OpenAndRemoveRefuseSegmentsHostdDoesNotOwn) {
  const std::string inst = UniqueInstance("foreign");
  ShmJanitor janitor{inst};
  TrainingState::Options o;
  o.instance = inst;
  o.model = SmallModel();
  o.mlock = MlockPolicy::kBestEffort;
  ASSERT_TRUE(TrainingState::Create(o, nullptr).ok());  // a crash: the segments stay
  ASSERT_TRUE(TrainingState::Open(o).ok());
  auto all_exist = [&] {
    for (auto kind : kKinds) {
      if (!ShmSegment::Exists(SegmentName(inst, kind))) return false;
    }
    return true;
  };
  auto expect_refused = [&](const std::string& path, const std::vector<std::string>& parts) {
    auto opened = TrainingState::Open(o);
    ASSERT_FALSE(opened.ok()) << path;
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
    const std::string msg(opened.status().message());
    for (const std::string& part : parts) {
      EXPECT_NE(msg.find(part), std::string::npos) << "no '" << part << "' in: " << msg;
    }
    absl::Status removed = TrainingState::RemoveSegments(o);
    EXPECT_EQ(removed.code(), absl::StatusCode::kFailedPrecondition) << removed;
    EXPECT_TRUE(all_exist());
  };

  // Any user can make this one: the world-writable mode of the report.
  const std::string params = ShmPath(inst, shm::SegmentKind::kParams);
  ASSERT_EQ(chmod(params.c_str(), 0666), 0);
  expect_refused(params,
                 {"segment " + params, "mode 0666", "mode 0600 or narrower", "rm " + params});
  ASSERT_EQ(chmod(params.c_str(), 0600), 0);
  // The state segment is 0600 even when the others may be 0660.
  const std::string state = ShmPath(inst, shm::SegmentKind::kState);
  ASSERT_EQ(chmod(state.c_str(), 0660), 0);
  o.mode = 0660;
  expect_refused(state, {"segment " + state, "mode 0660", "mode 0600 or narrower"});
  o.mode = 0600;
  ASSERT_EQ(chmod(state.c_str(), 0600), 0);
  ASSERT_TRUE(TrainingState::Open(o).ok());

  // A link in the control segment's place, to a file of ours that must stay as it is.
  const std::string control = ShmPath(inst, shm::SegmentKind::kControl);
  const std::string moved = control + ".moved";
  ASSERT_EQ(rename(control.c_str(), moved.c_str()), 0);
  ASSERT_EQ(symlink(moved.c_str(), control.c_str()), 0);
  expect_refused(control, {"segment " + control, "is a symbolic link"});
  ASSERT_EQ(unlink(control.c_str()), 0);
  ASSERT_EQ(rename(moved.c_str(), control.c_str()), 0);

  if (geteuid() == 0) {
    // Another user's segment: named with its uid and user name.
    ASSERT_EQ(chown(state.c_str(), 65534, 65534), 0);
    expect_refused(state, {"segment " + state, "owned by uid 65534 (nobody)",
                           "expected a regular file owned by uid 0 (root)"});
    ASSERT_EQ(chown(state.c_str(), 0, 0), 0);
  }
  ASSERT_TRUE(TrainingState::Open(o).ok());
  ASSERT_TRUE(TrainingState::RemoveSegments(o).ok());
  for (auto kind : kKinds) EXPECT_FALSE(ShmSegment::Exists(SegmentName(inst, kind)));
}

TEST(StateTest, CleanStopRemovesSegments) {
  const std::string inst = UniqueInstance("clean");
  {
    auto s = MakeState(inst, nullptr);
    ASSERT_NE(s, nullptr);
    EXPECT_TRUE(ShmSegment::Exists(SegmentName(inst, shm::SegmentKind::kState)));
  }
  EXPECT_FALSE(ShmSegment::Exists(SegmentName(inst, shm::SegmentKind::kState)));
}

TEST(StateTest, BadManifestAndWorldSizeAreRejectedBeforeAnySegment) {
  const std::string inst = UniqueInstance("bad");
  TrainingState::Options o;
  o.instance = inst;
  o.model = SmallModel();
  o.model.manifest.mutable_layers(1)->mutable_tensors(0)->set_shape(0, 0);
  EXPECT_EQ(TrainingState::Create(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  o.model = SmallModel();
  o.world_size = 65;
  auto s = TrainingState::Create(o, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("world_size"), std::string::npos);
  EXPECT_FALSE(ShmSegment::Exists(SegmentName(inst, shm::SegmentKind::kControl)));
}

TEST(StateTest, PublishAdvancesVersionAndWakeSequence) {
  auto s = MakeState(UniqueInstance("pub"), nullptr);
  ASSERT_NE(s, nullptr);
  const uint32_t seq = s->layer_control(1).wake_seq;
  s->BeginLayerWrite(1, 1);
  EXPECT_EQ(s->layer_control(1).pending_version, 1u);
  EXPECT_EQ(s->committed_version(1), 0u);
  s->PublishLayer(1, 1);
  EXPECT_EQ(s->committed_version(1), 1u);
  EXPECT_EQ(s->layer_control(1).wake_seq, seq + 1);
  EXPECT_EQ(s->committed_version(0), 0u);
}

}  // namespace
}  // namespace slidedp::hostd
