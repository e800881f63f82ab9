#include "hostd/recovery.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/instance_files.h"
#include "gtest/gtest.h"
#include "hostd/test_util.h"

namespace slidedp::hostd {
namespace {

using testing::SmallModel;
using testing::UniqueInstance;
using Action = RecoveryPlan::Action;

TrainingState::Options Opts(const std::string& instance) {
  TrainingState::Options o;
  o.instance = instance;
  o.model = SmallModel();
  o.seed = 5;
  o.mlock = MlockPolicy::kBestEffort;
  o.instance_nonce = 42;
  return o;
}

// A hostd that "crashed": its state is left in /dev/shm (remove_on_destroy stays false).
void CrashedState(const TrainingState::Options& o, uint64_t version, uint64_t* checksum) {
  auto s = TrainingState::Create(o, nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  for (uint32_t l = 0; l < (*s)->num_layers(); ++l) {
    (*s)->master(l)[0] += static_cast<float>(version);  // state that is not the init
    (*s)->BeginLayerWrite(l, version);
    (*s)->PublishLayer(l, version);
  }
  shm::Atomic((*s)->control().abort_epoch).store(3);
  shm::Atomic((*s)->rank_slot(1).attached).store(1);
  shm::Atomic((*s)->chunk_slot(0, 2).state).store(shm::kSlotFull);
  if (checksum != nullptr) *checksum = (*s)->Checksum();
}

constexpr shm::SegmentKind kKinds[] = {shm::SegmentKind::kControl, shm::SegmentKind::kState,
                                       shm::SegmentKind::kParams, shm::SegmentKind::kGrads};

constexpr const char* kPolicyNames[] = {"checkpoint", "fresh", "refuse"};  // OnInconsistent

std::string ShmPath(const std::string& inst, shm::SegmentKind kind) {
  return "/dev/shm/" + SegmentName(inst, kind);
}

// Removes whatever a test left under the instance's names, whoever owns it (on any exit).
struct ShmJanitor {
  std::string inst;
  std::vector<std::string> more;
  ~ShmJanitor() {
    for (auto kind : kKinds) unlink(ShmPath(inst, kind).c_str());
    unlink(InstanceLockPath(inst).c_str());
    for (const std::string& path : more) unlink(path.c_str());
  }
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool AnySegment(const std::string& inst) {
  for (auto k : {shm::SegmentKind::kControl, shm::SegmentKind::kState, shm::SegmentKind::kParams,
                 shm::SegmentKind::kGrads}) {
    if (ShmSegment::Exists(SegmentName(inst, k))) return true;
  }
  return false;
}

TEST(PlanRecoveryTest, Decisions) {
  FoundState none;
  EXPECT_EQ(PlanRecovery(none, OnInconsistent::kRefuse, std::nullopt).action, Action::kCreate);

  FoundState ok;
  ok.exists = true;
  ok.committed = {7, 7, 7};
  ok.pending = {7, 7, 7};
  RecoveryPlan p = PlanRecovery(ok, OnInconsistent::kRefuse, std::nullopt);
  EXPECT_EQ(p.action, Action::kAdopt);
  EXPECT_EQ(p.step, 7u);
  EXPECT_TRUE(p.reason.empty());

  FoundState mixed = ok;
  mixed.committed = {8, 8, 7, 7};
  mixed.pending = {8, 8, 8, 7};
  p = PlanRecovery(mixed, OnInconsistent::kRefuse, std::nullopt);
  EXPECT_EQ(p.action, Action::kRefuse);
  EXPECT_EQ(p.reason,
            "mid-update or torn: layer 2 (pending version 8, committed 7); committed versions "
            "disagree: layers 0-1 at 8, layers 2-3 at 7");
  EXPECT_EQ(PlanRecovery(mixed, OnInconsistent::kFresh, std::nullopt).action, Action::kStartFresh);
  p = PlanRecovery(mixed, OnInconsistent::kCheckpoint, std::nullopt);
  EXPECT_EQ(p.action, Action::kStartFresh);
  EXPECT_NE(p.reason.find("no checkpoint found"), std::string::npos) << p.reason;
  p = PlanRecovery(mixed, OnInconsistent::kCheckpoint, std::string("/ckpt/step-7"));
  EXPECT_EQ(p.action, Action::kRestoreCheckpoint);
  EXPECT_EQ(p.checkpoint, "/ckpt/step-7");

  FoundState foreign;
  foreign.exists = true;
  foreign.headers = absl::FailedPreconditionError("segment x: manifest_hash is a, expected b");
  p = PlanRecovery(foreign, OnInconsistent::kRefuse, std::nullopt);
  EXPECT_EQ(p.action, Action::kRefuse);
  EXPECT_NE(p.reason.find("manifest_hash is a, expected b"), std::string::npos) << p.reason;

  EXPECT_TRUE(ParseOnInconsistent("fresh").ok());
  EXPECT_EQ(ParseOnInconsistent("sometimes").status().message(),
            "recovery_on_inconsistent: 'sometimes' is not one of checkpoint, fresh, refuse");
}

TEST(RecoverInstanceTest, NothingFoundCreates) {
  auto r = RecoverInstance(Opts(UniqueInstance("none")), OnInconsistent::kRefuse, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->plan.action, Action::kCreate);
  EXPECT_EQ(r->state, nullptr);
}

TEST(RecoverInstanceTest, ConsistentStateIsAdoptedInPlace) {
  const auto o = Opts(UniqueInstance("adopt"));
  uint64_t before = 0;
  ASSERT_NO_FATAL_FAILURE(CrashedState(o, 6, &before));
  auto r = RecoverInstance(o, OnInconsistent::kRefuse, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->plan.action, Action::kAdopt);
  EXPECT_EQ(r->plan.step, 6u);
  TrainingState& s = *r->state;
  EXPECT_EQ(s.Checksum(), before);  // mapped, not re-initialized
  EXPECT_EQ(s.control().next_step, 7u);
  EXPECT_EQ(s.control().hostd_pid, static_cast<uint64_t>(getpid()));
  EXPECT_EQ(s.control().abort_epoch, 4u);  // old waiters see an abort
  EXPECT_EQ(s.rank_slot(1).attached, 0u);
  EXPECT_EQ(s.chunk_slot(0, 2).state, shm::kSlotEmpty);
  s.set_remove_on_destroy(true);
  r->state.reset();
  EXPECT_FALSE(AnySegment(o.instance));
}

TEST(RecoverInstanceTest, MidUpdateLayerIsRefusedOrStartedFresh) {
  const auto o = Opts(UniqueInstance("torn"));
  ASSERT_NO_FATAL_FAILURE(CrashedState(o, 3, nullptr));
  {
    auto s = TrainingState::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    (*s)->BeginLayerWrite(1, 4);  // hostd died while writing layer 1's step 4
  }
  auto refused = RecoverInstance(o, OnInconsistent::kRefuse, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(refused.status().message());
  EXPECT_NE(msg.find("layer 1 (pending version 4, committed 3)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("slidedpctl cleanup --instance " + o.instance), std::string::npos) << msg;
  EXPECT_TRUE(AnySegment(o.instance));  // refuse leaves the evidence

  auto fresh = RecoverInstance(o, OnInconsistent::kFresh, nullptr);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->plan.action, Action::kStartFresh);
  EXPECT_FALSE(AnySegment(o.instance));
}

TEST(RecoverInstanceTest, AnotherModelsStateIsNotAdopted) {
  auto o = Opts(UniqueInstance("foreign"));
  ASSERT_NO_FATAL_FAILURE(CrashedState(o, 2, nullptr));
  auto other = o;
  other.model.manifest.mutable_layers(1)->mutable_tensors(0)->set_shape(1, 4);
  auto opened = TrainingState::Open(other);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(opened.status().message().find("manifest_hash (another model's state) is"),
            std::string::npos)
      << opened.status();
  auto world = o;
  world.world_size = 2;
  opened = TrainingState::Open(world);
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("expected"), std::string::npos) << opened.status();
  {
    // An older build's segment: the ABI version is named, found and expected.
    auto seg = ShmSegment::Open(SegmentName(o.instance, shm::SegmentKind::kParams), true);
    ASSERT_TRUE(seg.ok());
    seg->at<shm::SegmentHeader>(0)->abi_version = shm::kAbiVersion + 1;
  }
  opened = TrainingState::Open(o);
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find(absl::StrCat("abi_version is ", shm::kAbiVersion + 1,
                                                        ", expected ", shm::kAbiVersion)),
            std::string::npos)
      << opened.status();
  auto fresh = RecoverInstance(o, OnInconsistent::kCheckpoint, nullptr);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->plan.action, Action::kStartFresh);
  EXPECT_FALSE(AnySegment(o.instance));
}

TEST(InstanceLockTest, OneOwnerAndCleanupNeverTouchesALiveOne) {
  const std::string inst = UniqueInstance("lock");
  auto lock = InstanceLock::Acquire(inst);
  ASSERT_TRUE(lock.ok()) << lock.status();
  EXPECT_EQ(InstanceLockHolder(inst), getpid());
  auto second = InstanceLock::Acquire(inst);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(absl::StrCat("in use by hostd pid ", getpid())),
            std::string::npos)
      << second.status();
  ASSERT_NO_FATAL_FAILURE(CrashedState(Opts(inst), 1, nullptr));
  auto listed = ListInstanceFiles(inst);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].files.size(), 5u);  // four segments and the lock
  EXPECT_EQ((*listed)[0].live_pid, getpid());
  auto refused = RemoveStaleInstance(inst, CleanupOwnerCheck());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(AnySegment(inst));

  lock->reset();  // the owner goes: the lock file goes with it, the segments stay
  struct stat st;
  EXPECT_NE(stat(InstanceLockPath(inst).c_str(), &st), 0);
  listed = ListInstanceFiles(inst);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].live_pid, 0);
  const uint64_t bytes = (*listed)[0].bytes;
  auto removed = RemoveStaleInstance(inst, CleanupOwnerCheck());
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(removed->files.size(), 4u);
  EXPECT_EQ(removed->bytes, bytes);
  EXPECT_FALSE(AnySegment(inst));
  EXPECT_NE(stat(InstanceLockPath(inst).c_str(), &st), 0);
  EXPECT_EQ(InstanceLock::Acquire("bad/name").status().code(), absl::StatusCode::kInvalidArgument);
}

// The report of issue #17: segments another user made (any user can: world-writable, and as root
// this test also chowns them to nobody) carry headers anyone can predict, so they look like a
// crashed hostd's consistent state. Whatever recovery_on_inconsistent says, hostd neither adopts
// nor removes them: FAILED_PRECONDITION naming the file, its owner and mode, what was expected
// and what to do; every segment stays as it was. Also for inconsistent state, where `fresh` and
// `checkpoint` would remove it.
TEST(RecoverInstanceTest, ForeignSegmentsAreNeitherAdoptedNorRemovedWhateverThePolicy) {
  for (const bool consistent : {true, false}) {
    const auto o = Opts(UniqueInstance("planted"));
    ShmJanitor janitor{o.instance, {}};
    uint64_t before = 0;
    ASSERT_NO_FATAL_FAILURE(CrashedState(o, 6, &before));
    if (!consistent) {
      auto s = TrainingState::Open(o);
      ASSERT_TRUE(s.ok()) << s.status();
      (*s)->BeginLayerWrite(1, 7);
    }
    for (auto kind : kKinds) {
      ASSERT_EQ(chmod(ShmPath(o.instance, kind).c_str(), 0666), 0);
      if (geteuid() == 0) {
        ASSERT_EQ(chown(ShmPath(o.instance, kind).c_str(), 65534, 65534), 0);
      }
    }
    const std::string control = ShmPath(o.instance, shm::SegmentKind::kControl);
    for (auto policy :
         {OnInconsistent::kRefuse, OnInconsistent::kFresh, OnInconsistent::kCheckpoint}) {
      auto r =
          RecoverInstance(o, policy, [] { return std::optional<std::string>("/nonexistent"); });
      if (r.ok()) {
        ADD_FAILURE() << (consistent ? "consistent" : "inconsistent") << " state, policy "
                      << kPolicyNames[static_cast<int>(policy)] << ": "
                      << RecoveryActionName(r->plan.action);
        continue;
      }
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      const std::string msg(r.status().message());
      for (const std::string& part :
           {"instance '" + o.instance + "'", "segment " + control, std::string("mode 0666"),
            std::string("mode 0600 or narrower"), std::string("check who created it"),
            "rm " + control}) {
        EXPECT_NE(msg.find(part), std::string::npos) << "no '" << part << "' in: " << msg;
      }
      if (geteuid() == 0) {
        EXPECT_NE(msg.find("owned by uid 65534 (nobody)"), std::string::npos) << msg;
      }
      for (auto kind : kKinds) {
        struct stat st;
        EXPECT_EQ(stat(ShmPath(o.instance, kind).c_str(), &st), 0) << ShmPath(o.instance, kind);
        EXPECT_EQ(st.st_mode & 0777, 0666u);  // not even re-permissioned
      }
    }
  }
}

// The lock file is opened without following a link: a link in its place (here to a file of ours
// whose content must survive) is refused, as is a lock file of a wider mode or another user's,
// even when nobody holds it.
TEST(InstanceLockTest, LinkedWideOrForeignLockFileIsRefused) {
  const std::string inst = UniqueInstance("locklink");
  const std::string lock = InstanceLockPath(inst);
  const std::string target = "/dev/shm/slidedp-test-target-" + inst;
  ShmJanitor janitor{inst, {target}};
  { std::ofstream(target) << "precious\n"; }
  ASSERT_EQ(symlink(target.c_str(), lock.c_str()), 0);
  auto linked = InstanceLock::Acquire(inst);
  ASSERT_FALSE(linked.ok()) << "followed the link to " << ReadFile(target);
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition) << linked.status();
  EXPECT_NE(linked.status().message().find("lock file " + lock + " is a symbolic link"),
            std::string::npos)
      << linked.status();
  EXPECT_EQ(ReadFile(target), "precious\n");
  ASSERT_EQ(unlink(lock.c_str()), 0);

  { std::ofstream(lock) << "1\n"; }
  ASSERT_EQ(chmod(lock.c_str(), 0666), 0);
  auto wide = InstanceLock::Acquire(inst);
  ASSERT_FALSE(wide.ok());
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kFailedPrecondition) << wide.status();
  EXPECT_NE(wide.status().message().find("mode 0666"), std::string::npos) << wide.status();
  if (geteuid() == 0) {
    ASSERT_EQ(chmod(lock.c_str(), 0600), 0);
    ASSERT_EQ(chown(lock.c_str(), 65534, 65534), 0);
    auto foreign = InstanceLock::Acquire(inst);
    ASSERT_FALSE(foreign.ok());
    EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition) << foreign.status();
    EXPECT_NE(foreign.status().message().find("owned by uid 65534 (nobody)"), std::string::npos)
        << foreign.status();
  }
  ASSERT_EQ(unlink(lock.c_str()), 0);
  // shm_mode 0660 with a group: the lock file gets both.
  InstanceLock::Options options;
  options.mode = 0660;
  options.group = testing::OtherGroup();
  auto ours = InstanceLock::Acquire(inst, options);
  ASSERT_TRUE(ours.ok()) << ours.status();
  struct stat st;
  ASSERT_EQ(lstat(lock.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  EXPECT_EQ(st.st_gid, options.group);
}

// An unknown shm_group is INVALID_ARGUMENT naming the key and the value; a name or a number of
// an existing group resolves; empty is the process's own group (-1: no chown).
TEST(InstanceLockTest, ResolveShmGroup) {
  EXPECT_EQ(*ResolveShmGroup(""), static_cast<gid_t>(-1));
  EXPECT_EQ(*ResolveShmGroup("root"), 0u);
  EXPECT_EQ(*ResolveShmGroup("0"), 0u);
  auto unknown = ResolveShmGroup("slidedp-no-such-group");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(
      unknown.status().message().find("shm_group: group 'slidedp-no-such-group' does not exist"),
      std::string::npos)
      << unknown.status();
}

// `slidedpctl cleanup`'s removal: a link or anything but a regular file in a segment's place is
// never removed (the instance is refused whole, the lock file goes), nor, for a non-root user,
// another user's file; root removes its service user's stale state. A FIFO cannot block it.
TEST(InstanceLockTest, CleanupRemovesOnlyWhatItMay) {
  const std::string inst = UniqueInstance("cleanlink");
  const std::string target = "/dev/shm/slidedp-test-target-" + inst;
  ShmJanitor janitor{inst, {target}};
  ASSERT_NO_FATAL_FAILURE(CrashedState(Opts(inst), 1, nullptr));
  { std::ofstream(target) << "precious\n"; }
  const std::string params = ShmPath(inst, shm::SegmentKind::kParams);
  ASSERT_EQ(unlink(params.c_str()), 0);
  ASSERT_EQ(symlink(target.c_str(), params.c_str()), 0);
  auto linked = RemoveStaleInstance(inst, CleanupOwnerCheck());
  ASSERT_FALSE(linked.ok());
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition) << linked.status();
  EXPECT_NE(linked.status().message().find(params + " is a symbolic link"), std::string::npos)
      << linked.status();
  EXPECT_TRUE(AnySegment(inst));
  struct stat st;
  EXPECT_EQ(lstat(params.c_str(), &st), 0);
  EXPECT_EQ(ReadFile(target), "precious\n");
  EXPECT_NE(lstat(InstanceLockPath(inst).c_str(), &st), 0);  // taken and released
  ASSERT_EQ(unlink(params.c_str()), 0);
  ASSERT_EQ(mkfifo(params.c_str(), 0600), 0);
  const std::string control = ShmPath(inst, shm::SegmentKind::kControl);
  ASSERT_EQ(unlink(control.c_str()), 0);
  ASSERT_EQ(mkfifo(control.c_str(), 0600), 0);  // read for a legacy hostd's pid: must not block
  auto fifo = RemoveStaleInstance(inst, CleanupOwnerCheck());
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("is a FIFO"), std::string::npos) << fifo.status();
  ASSERT_EQ(unlink(params.c_str()), 0);
  ASSERT_EQ(unlink(control.c_str()), 0);

  if (geteuid() == 0) {
    const std::string state = ShmPath(inst, shm::SegmentKind::kState);
    ASSERT_EQ(chown(state.c_str(), 65534, 65534), 0);
    // A user other than the owner (the check a non-root cleanup makes) may not remove it ...
    const OwnerCheck as_user{geteuid(), 07777, OwnerCheck::kAnyGid};
    auto refused = RemoveStaleInstance(inst, as_user);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find("owned by uid 65534 (nobody)"), std::string::npos)
        << refused.status();
    EXPECT_TRUE(ShmSegment::Exists(SegmentName(inst, shm::SegmentKind::kState)));
  }
  // ... root may (and a user its own).
  auto removed = RemoveStaleInstance(inst, CleanupOwnerCheck());
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(removed->files.size(), 2u);
  EXPECT_FALSE(AnySegment(inst));
}

}  // namespace
}  // namespace slidedp::hostd
