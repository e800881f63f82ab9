#include "hostd/checkpoint.h"

#include <fcntl.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"
#include "gtest/gtest.h"
#include "hostd/config.h"
#include "hostd/engine.h"
#include "hostd/optimizer.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;
namespace v1 = slidedp::v1;
using testing::SmallModel;
using testing::UniqueInstance;

v1::OptimizerConfig Cfg() {
  v1::OptimizerConfig c;
  c.set_lr(1e-2);
  c.set_beta1(0.9);
  c.set_beta2(0.999);
  c.set_eps(1e-8);
  c.set_weight_decay(0.1);
  return *model::NormalizeOptimizerConfig(c);
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Rewrites the committed checkpoint at `path` as hostd wrote it in format 1 or 2: the layer
// headers' format (and format 1's data right after the 64-byte header), meta.json without an
// instance, the marker, and the unscoped directory name step-<t>. Returns the new path.
std::string AsOldFormat(const std::string& path, uint32_t format) {
  auto info = model::ReadCheckpointInfo(path);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return path;
  nlohmann::json meta = nlohmann::json::parse(ReadFile(fs::path(path) / "meta.json"));
  for (size_t i = 0; i < info->files.size(); ++i) {
    const fs::path file = fs::path(path) / info->files[i].name;
    const std::string bytes = ReadFile(file);
    model::LayerFileHeader h{};
    std::memcpy(&h, bytes.data(), sizeof(h));
    h.format = format;
    std::string head(model::LayerDataOffset(format), '\0');
    std::memcpy(head.data(), &h, sizeof(h));
    const std::string out = head + bytes.substr(4096);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << out;
    meta["files"][i]["size_bytes"] = out.size();
    meta["files"][i]["xxh64"] = absl::StrFormat("%016x", XXH3_64bits(out.data(), out.size()));
  }
  meta["format_version"] = format;
  meta.erase("instance");
  const std::string text = meta.dump(2);
  std::ofstream(fs::path(path) / "meta.json", std::ios::trunc) << text;
  std::ofstream(fs::path(path) / "COMMITTED", std::ios::trunc)
      << absl::StrFormat("slidedp-checkpoint %u step %u meta_xxh64 %016x\n", format, info->step,
                         XXH3_64bits(text.data(), text.size()));
  const std::string legacy =
      (fs::path(path).parent_path() / model::CheckpointDirName(info->step)).string();
  fs::rename(path, legacy);
  return legacy;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / UniqueInstance("ckpt");
    fs::create_directories(dir_);
    pool_ = std::move(*ThreadPool::Create({.num_threads = 2}));
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<TrainingState> NewState(uint64_t seed) {
    TrainingState::Options o;
    o.instance = UniqueInstance("ck");
    o.model = SmallModel();
    o.model.manifest.set_manifest_hash(
        model::ManifestHashHex(model::ManifestHash(o.model.manifest)));
    o.seed = seed;
    o.mlock = MlockPolicy::kOff;
    auto s = std::move(*TrainingState::Create(o, pool_.get()));
    s->set_remove_on_destroy(true);
    return s;
  }

  model::CheckpointInfo Describe(const TrainingState& s) {
    model::CheckpointInfo info;
    info.job_id = "default";
    info.manifest_hash = model::ManifestHashHex(s.manifest_hash());
    *info.spec.mutable_manifest() = s.model().manifest;
    *info.spec.mutable_optimizer() = Cfg();
    info.spec.set_world_size(1);
    info.initializer_range = 0.02;
    info.model_source = "test";
    return info;
  }

  // Runs `steps` updates of every layer (highest first, as backward does) from version
  // state.committed_version(0), gradients drawn from `rng`.
  static void Train(UpdateWorker& w, TrainingState& s, int steps, std::mt19937& rng) {
    std::normal_distribution<float> nd(0, 1);
    for (int k = 0; k < steps; ++k) {
      const uint64_t step = s.committed_version(0) + 1;
      std::vector<std::vector<float>> grads(s.num_layers());
      for (uint32_t l = s.num_layers(); l-- > 0;) {
        grads[l].resize(s.layers()[l].numel);
        for (float& g : grads[l]) g = nd(rng);
        ASSERT_TRUE(
            w.Submit(l, step, {grads[l].data(), kernels::GradType::kFp32, grads[l].size()}, nullptr)
                .ok());
      }
      for (uint32_t l = 0; l < s.num_layers(); ++l) {
        while (s.committed_version(l) < step)
          std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  // The name of a checkpoint the fixture's checkpointers write (instance and job "default").
  static std::string Name(uint64_t step) {
    return model::CheckpointDirName(step, {"default", "default"});
  }

  fs::path dir_;
  std::unique_ptr<ThreadPool> pool_;
};

// A checkpoint taken at version t while step t+1's updates already run holds exactly version t;
// restored into another state it reproduces master, m, v, params and versions. Pool sizes: none
// (every layer waits for the writer or is written live: the stall path), and room for all.
TEST_F(CheckpointTest, ConsistentWhileTrainingAndRestores) {
  for (uint64_t pool_bytes : {uint64_t{0}, uint64_t{1} << 30}) {
    SCOPED_TRACE(pool_bytes);
    auto state = NewState(1);
    UpdateWorker worker(state.get(), pool_.get(), {kernels::BestIsa(), 8192}, Cfg());
    Checkpointer cp(state.get(), pool_.get(), {.keep_last = 0, .snapshot_pool_bytes = pool_bytes});
    worker.SetBeforeWriteHook([&cp](uint32_t l, uint64_t s) { cp.BeforeLayerWrite(l, s); });
    worker.Start();
    std::mt19937 rng(7);
    Train(worker, *state, 3, rng);
    std::vector<uint64_t> at_t;
    for (uint32_t l = 0; l < state->num_layers(); ++l) at_t.push_back(state->LayerChecksum(l));
    const std::string sub = (dir_ / absl::StrCat("p", pool_bytes)).string();
    ASSERT_TRUE(cp.Start(sub, 3, Describe(*state)).ok());
    Train(worker, *state, 2, rng);  // steps 4, 5 overlap the write
    auto r = cp.Wait(3, 60000);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->step, 3u);
    EXPECT_TRUE(fs::exists(fs::path(r->path) / "COMMITTED"));
    worker.Stop();

    auto info = FindLatestCheckpoint(sub);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->step, 3u);
    ASSERT_TRUE(model::VerifyCheckpointData(*info).ok());
    auto restored = NewState(99);
    ASSERT_NE(restored->LayerChecksum(0), at_t[0]);
    ASSERT_TRUE(RestoreCheckpoint(*info, restored.get(), pool_.get()).ok());
    for (uint32_t l = 0; l < restored->num_layers(); ++l) {
      EXPECT_EQ(restored->LayerChecksum(l), at_t[l]) << "layer " << l;
      EXPECT_EQ(restored->committed_version(l), 3u);
    }
    const CheckpointStats st = cp.stats();
    EXPECT_EQ(st.checkpoints_committed, 1u);
    EXPECT_EQ(st.layers_snapshotted + st.layers_copied_by_writer + st.layers_written_live,
              state->num_layers());
    if (pool_bytes == 0) {
      EXPECT_EQ(st.layers_snapshotted + st.layers_copied_by_writer, 0u);
      EXPECT_EQ(st.pool_high_water_bytes, 0u);
    }
  }
}

// The snapshot buffers stay for the next checkpoint (keep_snapshot_pool): the next pool size
// is asked with them counted as room, trimmed to it, and the next checkpoint, copying into them,
// is as consistent as the first. Off: nothing is kept.
TEST_F(CheckpointTest, KeepsSnapshotBuffersForTheNextCheckpointUpToItsPool) {
  for (bool keep : {true, false}) {
    SCOPED_TRACE(keep);
    auto state = NewState(1);
    const uint64_t state_bytes = 12 * state->total_params();
    UpdateWorker worker(state.get(), pool_.get(), {kernels::BestIsa(), 8192}, Cfg());
    std::vector<uint64_t> asked_with_kept;
    std::vector<uint64_t> pools = {uint64_t{1} << 30, uint64_t{1} << 30, 0};
    Checkpointer::Options o;
    o.keep_last = 0;
    o.keep_snapshot_pool = keep;
    o.snapshot_pool_at_start = [&](uint64_t kept) {
      asked_with_kept.push_back(kept);
      return pools[asked_with_kept.size() - 1];
    };
    Checkpointer cp(state.get(), pool_.get(), o);
    worker.SetBeforeWriteHook([&cp](uint32_t l, uint64_t s) { cp.BeforeLayerWrite(l, s); });
    worker.Start();
    std::mt19937 rng(11);
    const std::string sub = (dir_ / absl::StrCat("keep", keep)).string();
    for (uint64_t version : {2, 4}) {
      Train(worker, *state, static_cast<int>(version - state->committed_version(0)), rng);
      std::vector<uint64_t> at_t;
      for (uint32_t l = 0; l < state->num_layers(); ++l) at_t.push_back(state->LayerChecksum(l));
      ASSERT_TRUE(cp.Start(sub, version, Describe(*state)).ok());
      Train(worker, *state, 1, rng);  // the next step's updates find the layers captured
      auto r = cp.Wait(version, 60000);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(cp.stats().pool_kept_bytes, keep ? state_bytes : 0u);
      auto info = FindLatestCheckpoint(sub);
      ASSERT_TRUE(info.ok()) << info.status();
      ASSERT_EQ(info->step, version);
      auto restored = NewState(99);
      ASSERT_TRUE(RestoreCheckpoint(*info, restored.get(), pool_.get()).ok());
      for (uint32_t l = 0; l < restored->num_layers(); ++l) {
        EXPECT_EQ(restored->LayerChecksum(l), at_t[l]) << "version " << version << " layer " << l;
      }
    }
    EXPECT_EQ(cp.stats().layers_written_live, 0u);
    // A third checkpoint whose pool is 0 gives every kept buffer back at its start.
    Train(worker, *state, static_cast<int>(7 - state->committed_version(0)), rng);
    ASSERT_TRUE(cp.Start(sub, 7, Describe(*state)).ok());
    EXPECT_EQ(cp.stats().pool_kept_bytes, 0u);
    ASSERT_TRUE(cp.Wait(7, 60000).ok());
    worker.Stop();
    EXPECT_EQ(asked_with_kept,
              (std::vector<uint64_t>{0, keep ? state_bytes : 0, keep ? state_bytes : 0}));
  }
}

// PreparePool allocates the next checkpoint's buffers ahead (highest layer first, up to the pool
// the checkpoint would get now) and keeps them: the checkpoint then copies every layer into
// them and allocates nothing. A pool too small for every layer gets the highest ones; without
// keep_snapshot_pool nothing is prepared.
TEST_F(CheckpointTest, PreparedPoolIsAllocatedAheadAndTheCheckpointAllocatesNothing) {
  auto state = NewState(1);
  const uint64_t state_bytes = 12 * state->total_params();
  auto wait_prepared = [](Checkpointer& cp, uint64_t bytes) {
    for (int i = 0; i < 2000 && cp.stats().pool_kept_bytes < bytes; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return cp.stats().pool_kept_bytes;
  };
  {
    UpdateWorker worker(state.get(), pool_.get(), {kernels::BestIsa(), 8192}, Cfg());
    Checkpointer::Options o;
    o.keep_last = 0;
    o.snapshot_pool_at_start = [&](uint64_t) { return state_bytes; };
    Checkpointer full(state.get(), pool_.get(), o);
    worker.SetBeforeWriteHook([&full](uint32_t l, uint64_t s) { full.BeforeLayerWrite(l, s); });
    worker.Start();
    full.PreparePool();
    ASSERT_EQ(wait_prepared(full, state_bytes), state_bytes);
    EXPECT_EQ(full.stats().snapshot_buffers_allocated, state->num_layers());
    EXPECT_EQ(full.stats().pool_prepared_bytes, state_bytes);
    full.PreparePool();  // nothing more to prepare
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(full.stats().snapshot_buffers_allocated, state->num_layers());
    std::mt19937 rng(5);
    Train(worker, *state, 2, rng);
    const std::string sub = (dir_ / "prepared").string();
    ASSERT_TRUE(full.Start(sub, 2, Describe(*state)).ok());
    Train(worker, *state, 1, rng);
    ASSERT_TRUE(full.Wait(2, 60000).ok());
    const CheckpointStats st = full.stats();
    EXPECT_EQ(st.layers_written_live, 0u);
    EXPECT_EQ(st.layers_copied_by_writer + st.layers_snapshotted, state->num_layers());
    EXPECT_EQ(st.snapshot_buffers_allocated, state->num_layers()) << "the checkpoint allocated";
    EXPECT_EQ(st.pool_kept_bytes, state_bytes);
    worker.Stop();
  }
  {
    // A plain pool size with room for the highest layer only.
    const uint32_t top = state->num_layers() - 1;
    const uint64_t top_bytes = 12 * state->layers()[top].numel;
    Checkpointer small(state.get(), pool_.get(),
                       {.keep_last = 0, .snapshot_pool_bytes = top_bytes});
    small.PreparePool();
    EXPECT_EQ(wait_prepared(small, top_bytes), top_bytes);
    Checkpointer off(
        state.get(), pool_.get(),
        {.keep_last = 0, .snapshot_pool_bytes = state_bytes, .keep_snapshot_pool = false});
    off.PreparePool();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(off.stats().snapshot_buffers_allocated, 0u);
    EXPECT_EQ(off.stats().pool_kept_bytes, 0u);
  }
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// No memory for snapshot buffers (an address-space limit below one buffer, in a child process):
// the preparation stops with nothing kept, and a checkpoint taken while training runs writes
// every layer from the live state (updates wait for the disk), commits and restores exactly
// version t. Before, the failed mmap threw std::bad_alloc and ended hostd.
TEST_F(CheckpointTest, NoMemoryForSnapshotsWritesLiveAndCommits) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto make_state = [&](uint64_t seed) -> std::unique_ptr<TrainingState> {
    TrainingState::Options so;
    so.instance = UniqueInstance("ckmem");
    so.model = SmallModel();
    auto* big = so.model.manifest.add_layers();  // layer 2: 16M parameters, 192 MiB snapshot
    big->set_name("block2");
    big->set_kind(v1::LAYER_KIND_DECODER);
    auto* t = big->add_tensors();
    t->set_name("block2.proj.weight");
    t->add_shape(4096);
    t->add_shape(4096);
    t->set_dtype(v1::DTYPE_BF16);
    so.model.manifest.set_manifest_hash(
        model::ManifestHashHex(model::ManifestHash(so.model.manifest)));
    so.seed = seed;
    so.mlock = MlockPolicy::kOff;
    auto created = TrainingState::Create(so, pool_.get());
    if (!created.ok()) std::exit(10);
    (*created)->set_remove_on_destroy(true);
    return std::move(*created);
  };
  // Returns 0 or the number of the check that failed; every state is destroyed on return (its
  // segments removed), which std::exit from inside would skip.
  auto body = [&]() -> int {
    std::unique_ptr<TrainingState> state = make_state(3);
    UpdateWorker worker(state.get(), pool_.get(), {kernels::BestIsa(), 8192}, Cfg());
    Checkpointer::Options o;
    o.keep_last = 0;
    o.snapshot_pool_bytes = 12 * state->total_params();
    Checkpointer cp(state.get(), pool_.get(), o);
    worker.SetBeforeWriteHook([&cp](uint32_t l, uint64_t s) { cp.BeforeLayerWrite(l, s); });
    worker.Start();
    std::mt19937 rng(3);
    Train(worker, *state, 1, rng);
    // Room for threads, the 64 MiB gradient of Train and small allocations (one malloc arena:
    // each thread's own would reserve 64 MiB of address space), not for a 192 MiB buffer.
    mallopt(M_ARENA_MAX, 1);
    std::ifstream st("/proc/self/statm");
    uint64_t vm_pages = 0;
    st >> vm_pages;
    rlimit old{};
    if (getrlimit(RLIMIT_AS, &old) != 0) return 11;
    const rlim_t limit = vm_pages * sysconf(_SC_PAGESIZE) + (rlim_t{160} << 20);
    const rlimit rl{limit, old.rlim_max};  // the soft limit only: raised again below
    if (setrlimit(RLIMIT_AS, &rl) != 0) return 11;
    cp.PreparePool();
    for (int i = 0;
         i < 200 && cp.stats().snapshot_alloc_failures == 0 && cp.stats().pool_prepare_seconds == 0;
         ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (cp.stats().pool_prepared_bytes != 0 || cp.stats().pool_kept_bytes != 0) return 12;
    std::vector<uint64_t> at_t;
    for (uint32_t l = 0; l < state->num_layers(); ++l) at_t.push_back(state->LayerChecksum(l));
    const std::string sub = (dir_ / "nomem").string();
    if (!cp.Start(sub, 1, Describe(*state)).ok()) return 13;
    Train(worker, *state, 1, rng);  // the update of layer 2 waits for its live write
    if (!cp.Wait(1, 60000).ok()) return 14;
    worker.Stop();
    if (setrlimit(RLIMIT_AS, &old) != 0) return 11;
    const CheckpointStats cs = cp.stats();
    if (cs.snapshot_alloc_failures == 0 || cs.layers_written_live == 0) return 15;
    auto info = FindLatestCheckpoint(sub);
    if (!info.ok() || info->step != 1) return 16;
    auto restored = make_state(99);
    if (!RestoreCheckpoint(*info, restored.get(), pool_.get()).ok()) return 17;
    for (uint32_t l = 0; l < state->num_layers(); ++l) {
      if (restored->LayerChecksum(l) != at_t[l]) return 18;
    }
    return 0;
  };
  EXPECT_EXIT(std::exit(body()), ::testing::ExitedWithCode(0), "");
}
#endif

TEST_F(CheckpointTest, IgnoresTmpAndUnmarkedDirectoriesAndPicksNewestValid) {
  auto state = NewState(1);
  Checkpointer cp(state.get(), pool_.get(), {.keep_last = 0});
  ASSERT_TRUE(cp.Start(dir_.string(), 0, Describe(*state)).ok());
  ASSERT_TRUE(cp.Wait(0, 60000).ok());
  // A later write that crashed before its rename, and one that crashed before its marker.
  fs::create_directories(dir_ / (Name(5) + ".tmp"));
  std::ofstream(dir_ / (Name(5) + ".tmp") / "layer-00000.bin") << "partial";
  fs::copy(dir_ / Name(0), dir_ / Name(4));
  fs::remove(dir_ / Name(4) / "COMMITTED");
  auto info = FindLatestCheckpoint(dir_.string());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step, 0u);
  auto list = model::ListCheckpoints(dir_.string(), true);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 3u);
  EXPECT_TRUE((*list)[0].temporary);
  EXPECT_FALSE((*list)[0].valid);
  EXPECT_EQ((*list)[1].step, 4u);
  EXPECT_FALSE((*list)[1].valid);
  EXPECT_NE((*list)[1].reason.find("no COMMITTED marker"), std::string::npos) << (*list)[1].reason;
  EXPECT_TRUE((*list)[2].valid) << (*list)[2].reason;
  // Naming the unmarked step directory itself is an error, not a fallback.
  EXPECT_TRUE(absl::IsNotFound(FindLatestCheckpoint((dir_ / Name(4)).string()).status()));
  // A directory with none at all.
  fs::create_directories(dir_ / "empty");
  auto none = FindLatestCheckpoint((dir_ / "empty").string());
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
}

TEST_F(CheckpointTest, ANamedPathThatIsNoCheckpointSaysWhatItIs) {
  const std::string nothing = (dir_ / "nothing").string();
  auto r = FindLatestCheckpoint(nothing);
  EXPECT_TRUE(absl::IsNotFound(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("checkpoint path " + nothing + " does not exist"),
            std::string::npos)
      << r.status();
  std::ofstream(dir_ / "file") << "x";
  r = FindLatestCheckpoint((dir_ / "file").string());
  EXPECT_NE(r.status().message().find("is not a directory"), std::string::npos) << r.status();
  // A client's path (CreateJob's resume_path) beyond PATH_MAX: refused, its message bounded (it
  // travels back in gRPC's trailers, which clients cap at 8 KiB).
  r = FindLatestCheckpoint("/" + std::string(64 << 10, 'r'));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status().code();
  EXPECT_NE(r.status().message().find("checkpoint path of 65537 bytes; at most 4095"),
            std::string::npos)
      << r.status().message().substr(0, 200);
  EXPECT_LT(r.status().message().size(), 2048u);
}

TEST_F(CheckpointTest, FlippedByteFailsTheChecksumNamingTheFile) {
  auto state = NewState(1);
  Checkpointer cp(state.get(), pool_.get(), {.keep_last = 0});
  ASSERT_TRUE(cp.Start(dir_.string(), 0, Describe(*state)).ok());
  auto r = cp.Wait(0, 60000);
  ASSERT_TRUE(r.ok());
  const std::string file = (fs::path(r->path) / "layer-00001.bin").string();
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 1000);  // a data byte (past the header block)
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(4096 + 1000);
    f.write(&c, 1);
  }
  auto info = FindLatestCheckpoint(dir_.string());
  ASSERT_TRUE(info.ok());  // sizes and marker are fine: the data is not
  absl::Status v = model::VerifyCheckpointData(*info);
  EXPECT_TRUE(absl::IsDataLoss(v)) << v;
  EXPECT_NE(v.message().find("layer-00001.bin"), std::string::npos) << v;
  auto other = NewState(5);
  absl::Status s = RestoreCheckpoint(*info, other.get(), pool_.get());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("layer-00001.bin"), std::string::npos) << s;

  // A truncated file is caught by the cheap check, naming the file.
  fs::resize_file(file, fs::file_size(file) - 4);
  auto t = model::ReadCheckpointInfo(r->path);
  EXPECT_TRUE(absl::IsDataLoss(t.status())) << t.status();
  EXPECT_NE(t.status().message().find("layer-00001.bin"), std::string::npos);
  EXPECT_NE(t.status().message().find("truncated"), std::string::npos);
  // A corrupted meta.json no longer matches its marker.
  { std::ofstream(fs::path(r->path) / "meta.json", std::ios::app) << " "; }
  auto m = model::ReadCheckpointInfo(r->path);
  EXPECT_TRUE(absl::IsDataLoss(m.status())) << m.status();
  EXPECT_NE(m.status().message().find("meta.json"), std::string::npos);
}

// From format 2 each layer file's data starts at 4096 (the header block: the 64-byte header,
// then zeros), so a snapshot buffer goes to disk with O_DIRECT where the file system takes it
// (a probe says whether this one does). A format-1 checkpoint (data right after the 64-byte
// header, no instance, named step-<t>; rewritten here from the format-3 one) still restores the
// same state.
TEST_F(CheckpointTest, Format2DataOnABlockBoundaryAndFormat1StillRestores) {
  auto state = NewState(1);
  Checkpointer cp(state.get(), pool_.get(), {.keep_last = 0});
  ASSERT_TRUE(cp.Start(dir_.string(), 0, Describe(*state)).ok());
  auto r = cp.Wait(0, 60000);
  ASSERT_TRUE(r.ok()) << r.status();
  bool direct_io = false;
  {
    const std::string probe = (dir_ / "probe").string();
    const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0) {
      void* block = std::aligned_alloc(4096, 4096);
      std::memset(block, 0, 4096);
      direct_io = write(fd, block, 4096) == 4096;
      std::free(block);
      close(fd);
    }
    fs::remove(probe);
  }
  const CheckpointStats st = cp.stats();
  EXPECT_EQ(st.layers_copied_by_writer, state->num_layers());  // every layer from the pool
  if (direct_io) {
    // Every whole block of every layer: all but each file's last partial block.
    uint64_t want = 0;
    for (uint32_t l = 0; l < state->num_layers(); ++l) {
      want += 4096 + 12 * state->layers()[l].numel / 4096 * 4096;
    }
    EXPECT_EQ(st.bytes_written_direct, want);
  } else {
    EXPECT_EQ(st.bytes_written_direct, 0u);
  }
  {  // checkpoint.direct_io false: through the page cache
    Checkpointer::Options o;
    o.keep_last = 0;
    o.direct_io = false;
    Checkpointer buffered(state.get(), pool_.get(), o);
    ASSERT_TRUE(buffered.Start((dir_ / "buffered").string(), 0, Describe(*state)).ok());
    ASSERT_TRUE(buffered.Wait(0, 60000).ok());
    EXPECT_EQ(buffered.stats().bytes_written_direct, 0u);
    EXPECT_EQ(buffered.stats().bytes_written, st.bytes_written);
  }
  std::vector<uint64_t> sums;
  for (uint32_t l = 0; l < state->num_layers(); ++l) sums.push_back(state->LayerChecksum(l));

  auto info = model::ReadCheckpointInfo(r->path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->format, 3u);
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(fs::path(r->path) / "meta.json"));
  for (size_t i = 0; i < info->files.size(); ++i) {
    const model::CheckpointFile& f = info->files[i];
    const fs::path path = fs::path(r->path) / f.name;
    ASSERT_EQ(fs::file_size(path), 4096 + 12 * f.numel) << f.name;
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    model::LayerFileHeader h{};
    std::memcpy(&h, bytes.data(), sizeof(h));
    EXPECT_EQ(h.format, 3u);
    EXPECT_GE(bytes.find_first_not_of('\0', sizeof(h)), size_t{4096}) << f.name;  // zeros
  }
  EXPECT_EQ(meta["instance"], "default");
  r->path = AsOldFormat(r->path, 1);

  auto old = model::ReadCheckpointInfo(r->path);
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->format, 1u);
  ASSERT_TRUE(model::VerifyCheckpointData(*old).ok());
  auto restored = NewState(42);
  ASSERT_NE(restored->LayerChecksum(0), sums[0]);
  ASSERT_TRUE(RestoreCheckpoint(*old, restored.get(), pool_.get()).ok());
  for (uint32_t l = 0; l < restored->num_layers(); ++l) {
    EXPECT_EQ(restored->LayerChecksum(l), sums[l]) << "layer " << l;
  }
  // A format this hostd does not know is refused by name.
  std::ifstream meta_in(fs::path(r->path) / "meta.json");
  const std::string text((std::istreambuf_iterator<char>(meta_in)),
                         std::istreambuf_iterator<char>());
  std::ofstream(fs::path(r->path) / "COMMITTED", std::ios::trunc) << absl::StrFormat(
      "slidedp-checkpoint 4 step 0 meta_xxh64 %016x\n", XXH3_64bits(text.data(), text.size()));
  auto future = model::ReadCheckpointInfo(r->path);
  EXPECT_TRUE(absl::IsInvalidArgument(future.status())) << future.status();
  EXPECT_NE(future.status().message().find("format version 4"), std::string::npos);
}

// checkpoint.max_write_mb_per_s: the writes from the pool keep the pace (a checkpoint of B
// bytes at B/s takes at least the second less the quarter second of credit), and Unpace (a
// stop, a final checkpoint) lifts it for the checkpoint in flight: at B/100 per second it
// would take 100 s.
TEST_F(CheckpointTest, PacedWriteKeepsItsPaceAndUnpaceLiftsIt) {
  auto state = NewState(1);
  const uint64_t bytes = 12 * state->total_params();
  for (bool unpace : {false, true}) {
    SCOPED_TRACE(unpace);
    Checkpointer::Options o;
    o.keep_last = 0;
    o.max_write_bytes_per_s = unpace ? bytes / 100 : bytes;
    Checkpointer cp(state.get(), pool_.get(), o);
    const std::string sub = (dir_ / absl::StrCat("u", unpace)).string();
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(cp.Start(sub, 0, Describe(*state)).ok());
    if (unpace) {
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      EXPECT_TRUE(cp.in_flight());
      cp.Unpace();
    }
    auto r = cp.Wait(0, 30000);
    ASSERT_TRUE(r.ok()) << r.status();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const CheckpointStats st = cp.stats();
    EXPECT_GT(st.paced_seconds, 0.3);
    if (!unpace) {
      EXPECT_GE(s, 0.7);
      EXPECT_GE(st.paced_seconds, 0.5);
    }
    EXPECT_EQ(st.checkpoints_committed, 1u);
  }
}

// A write that fails mid-file (a full disk; RLIMIT_FSIZE stands in for it: write() gets EFBIG,
// on the O_DIRECT path as on the buffered one): the checkpoint fails naming the layer file, its
// .tmp directory is removed, the previous checkpoint stays the newest, and the state is intact:
// the same step checkpoints once there is room again.
TEST_F(CheckpointTest, FailedWriteKeepsThePreviousCheckpointAndTheState) {
  auto state = NewState(1);
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct);
    const fs::path sub = dir_ / absl::StrCat("d", direct);
    Checkpointer::Options o;
    o.keep_last = 0;
    o.direct_io = direct;
    Checkpointer cp(state.get(), pool_.get(), o);
    ASSERT_TRUE(cp.Start(sub.string(), 0, Describe(*state)).ok());
    ASSERT_TRUE(cp.Wait(0, 60000).ok());
    for (uint32_t l = 0; l < state->num_layers(); ++l) {  // version 1: the data as it is
      state->BeginLayerWrite(l, 1);
      state->PublishLayer(l, 1);
    }
    std::vector<uint64_t> sums;
    for (uint32_t l = 0; l < state->num_layers(); ++l) sums.push_back(state->LayerChecksum(l));

    rlimit old{};
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
    auto* prev = signal(SIGXFSZ, SIG_IGN);
    rlimit small = old;
    small.rlim_cur = 3 * 4096;  // the header block and a little data
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
    ASSERT_TRUE(cp.Start(sub.string(), 1, Describe(*state)).ok());
    auto failed = cp.Wait(1, 60000);
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, prev);
    ASSERT_FALSE(failed.ok());
    EXPECT_NE(failed.status().message().find("write "), std::string::npos) << failed.status();
    EXPECT_NE(failed.status().message().find("layer-0000"), std::string::npos) << failed.status();
    // The system's text once (not "File too large: File too large").
    const std::string text = std::strerror(EFBIG);
    const std::string msg(failed.status().message());
    EXPECT_EQ(msg.find(text), msg.rfind(text)) << msg;
    EXPECT_EQ(cp.stats().checkpoints_failed, 1u);
    EXPECT_FALSE(fs::exists(sub / (Name(1) + ".tmp")));
    EXPECT_FALSE(fs::exists(sub / Name(1)));
    auto latest = FindLatestCheckpoint(sub.string());
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(latest->step, 0u);
    ASSERT_TRUE(model::VerifyCheckpointData(*latest).ok());

    ASSERT_TRUE(cp.Start(sub.string(), 1, Describe(*state)).ok());
    auto r = cp.Wait(1, 60000);
    ASSERT_TRUE(r.ok()) << r.status();
    auto info = FindLatestCheckpoint(sub.string());
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->step, 1u);
    auto restored = NewState(77);
    ASSERT_TRUE(RestoreCheckpoint(*info, restored.get(), pool_.get()).ok());
    for (uint32_t l = 0; l < restored->num_layers(); ++l) {
      EXPECT_EQ(restored->LayerChecksum(l), sums[l]) << "layer " << l;
    }
    state = NewState(1);  // versions back at 0 for the other write path
  }
}

// checkpoint.capture_timeout_s: an update waits for the checkpoint to capture its layer only so
// long. The writer hangs in the write of layer 1 (the writer's trace blocks, as a hung disk
// would; no pool, so layer 1 is written from the live state and its update must wait). The
// update of layer 1 for the next step gives up after the timeout: the checkpoint fails at once
// (Wait returns the error naming the layer, both steps and the wait; counted; logged once)
// while its writer is still stuck, no later update waits for it, and the previous checkpoint
// stays the newest. When the write returns, the writer removes its .tmp directory, nothing
// commits, and the same step checkpoints afterwards.
TEST_F(CheckpointTest, HungWriteFailsTheCheckpointAfterCaptureTimeoutAndTheUpdateGoesOn) {
  auto state = NewState(1);
  struct {
    absl::Mutex mu;
    bool hang ABSL_GUARDED_BY(mu) = false;
    bool hung ABSL_GUARDED_BY(mu) = false;
    bool release ABSL_GUARDED_BY(mu) = false;
  } disk;
  Checkpointer::Options o;
  o.keep_last = 0;
  o.snapshot_pool_bytes = 0;
  o.capture_timeout_ms = 50;
  o.writer.trace = [&](std::string_view op, const std::string& path) {
    if (op != "write" || fs::path(path).filename() != "layer-00001.bin") return;
    absl::MutexLock l(&disk.mu);
    if (!disk.hang) return;
    disk.hung = true;
    disk.mu.Await(absl::Condition(&disk.release));
  };
  std::ostringstream log;
  auto logger = std::make_shared<spdlog::logger>(
      "ckpt-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(log));
  const auto previous_logger = spdlog::default_logger();
  spdlog::set_default_logger(logger);
  struct RestoreLogger {
    std::shared_ptr<spdlog::logger> l;
    ~RestoreLogger() { spdlog::set_default_logger(l); }
  } restore{previous_logger};

  Checkpointer cp(state.get(), pool_.get(), o);
  ASSERT_TRUE(cp.Start(dir_.string(), 0, Describe(*state)).ok());
  ASSERT_TRUE(cp.Wait(0, 60000).ok());
  for (uint32_t l = 0; l < state->num_layers(); ++l) {  // version 1: the data as it is
    state->BeginLayerWrite(l, 1);
    state->PublishLayer(l, 1);
  }
  {
    absl::MutexLock l(&disk.mu);
    disk.hang = true;
  }
  ASSERT_TRUE(cp.Start(dir_.string(), 1, Describe(*state)).ok());
  {
    absl::MutexLock l(&disk.mu);
    ASSERT_TRUE(disk.mu.AwaitWithTimeout(absl::Condition(&disk.hung), absl::Seconds(60)));
  }
  // The update of layer 1 for step 2. On a bounded wait it returns while the write still hangs;
  // the guard only keeps a wait without a deadline from hanging the test.
  auto update = std::async(std::launch::async, [&] { cp.BeforeLayerWrite(1, 2); });
  const bool returned = update.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  EXPECT_TRUE(returned) << "the update still waits for the hung write after 60 s";
  if (returned) {
    auto failed = cp.Wait(1, 60000);
    ASSERT_FALSE(failed.ok());
    EXPECT_TRUE(absl::IsDeadlineExceeded(failed.status())) << failed.status();
    const std::string msg(failed.status().message());
    for (const char* want :
         {"the update of layer 1 for step 2 waited 0.05 s (checkpoint.capture_timeout_s)",
          "the checkpoint of step 1", "writing it to disk from the live state"}) {
      EXPECT_NE(msg.find(want), std::string::npos) << want << " in: " << msg;
    }
    CheckpointStats st = cp.stats();
    EXPECT_EQ(st.checkpoints_failed, 1u);
    EXPECT_EQ(st.checkpoints_committed, 1u);
    EXPECT_GT(st.stall_seconds, 0.0);
    // The writer is still stuck: no new checkpoint, and no update waits for the failed one
    // (layer 0 is still pending; waiting for it would count as stall).
    const absl::Status busy = cp.Start(dir_.string(), 2, Describe(*state));
    EXPECT_TRUE(absl::IsFailedPrecondition(busy)) << busy;
    EXPECT_NE(busy.message().find("has not returned"), std::string::npos) << busy;
    cp.BeforeLayerWrite(0, 2);
    EXPECT_EQ(cp.stats().stall_seconds, st.stall_seconds);
    auto latest = FindLatestCheckpoint(dir_.string());
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(latest->step, 0u);
  }
  {
    absl::MutexLock l(&disk.mu);
    disk.release = true;
    disk.hang = false;
  }
  update.wait();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (cp.in_flight() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(cp.in_flight());
  const CheckpointStats st = cp.stats();
  EXPECT_EQ(st.checkpoints_failed, 1u);  // once, not again when the writer returned
  EXPECT_EQ(st.checkpoints_committed, 1u);
  EXPECT_FALSE(fs::exists(dir_ / (Name(1) + ".tmp")));
  EXPECT_FALSE(fs::exists(dir_ / Name(1)));
  auto latest = FindLatestCheckpoint(dir_.string());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->step, 0u);
  EXPECT_TRUE(model::VerifyCheckpointData(*latest).ok());
  logger->flush();
  const std::string text = log.str();
  const std::string line = "checkpoint of step 1 failed";
  EXPECT_NE(text.find(line), std::string::npos) << text;
  EXPECT_EQ(text.find(line), text.rfind(line)) << "logged more than once:\n" << text;
  // The same step commits once the disk is back.
  ASSERT_TRUE(cp.Start(dir_.string(), 1, Describe(*state)).ok());
  auto r = cp.Wait(1, 60000);
  ASSERT_TRUE(r.ok()) << r.status();
}

// Two instances and a second job share one directory (issue #17). Each checkpoint says whose it
// is (meta.json and its directory name), so the same step of each commits side by side, keep_last
// prunes only the writer's own, and the latest of a scope is its own. Named explicitly, a step
// directory of anyone's resumes; a directory of several jobs' checkpoints is ambiguous and the
// error lists them. Format-2 checkpoints (no instance) are never picked nor pruned by scope, and
// resume when named. The old code refused the second instance's checkpoint of a step the first
// had written (ALREADY_EXISTS) and pruned across instances.
TEST_F(CheckpointTest, InstancesAndJobsSharingADirectoryKeepToTheirOwn) {
  auto a = NewState(1);
  auto b = NewState(2);  // the same model, other weights
  Checkpointer ca(a.get(), pool_.get(), {.instance = "ia", .keep_last = 2});
  Checkpointer cb(b.get(), pool_.get(), {.instance = "ib", .keep_last = 2});
  Checkpointer cj(a.get(), pool_.get(), {.instance = "ia", .keep_last = 2});
  model::CheckpointInfo other_job = Describe(*a);
  other_job.job_id = "job-2";
  const std::string dir = dir_.string();
  std::vector<uint64_t> sums_a;
  for (uint64_t t = 1; t <= 4; ++t) {
    for (TrainingState* s : {a.get(), b.get()}) {
      for (uint32_t l = 0; l < s->num_layers(); ++l) {
        s->BeginLayerWrite(l, t);
        s->PublishLayer(l, t);
      }
    }
    ASSERT_TRUE(ca.Start(dir, t, Describe(*a)).ok());
    ASSERT_TRUE(ca.Wait(t, 60000).ok());
    const absl::Status sb = cb.Start(dir, t, Describe(*b));
    ASSERT_TRUE(sb.ok()) << sb;
    auto rb = cb.Wait(t, 60000);
    ASSERT_TRUE(rb.ok()) << rb.status();
  }
  for (uint32_t l = 0; l < a->num_layers(); ++l) sums_a.push_back(a->LayerChecksum(l));
  ASSERT_TRUE(cj.Start(dir, 4, other_job).ok());
  ASSERT_TRUE(cj.Wait(4, 60000).ok());
  const model::CheckpointScope ia{"ia", "default"}, ib{"ib", "default"}, ij{"ia", "job-2"};
  auto names = [&] {
    std::set<std::string> n;
    for (const auto& e : fs::directory_iterator(dir_)) n.insert(e.path().filename().string());
    return n;
  };
  EXPECT_EQ(names(),
            (std::set<std::string>{model::CheckpointDirName(3, ia), model::CheckpointDirName(4, ia),
                                   model::CheckpointDirName(3, ib), model::CheckpointDirName(4, ib),
                                   model::CheckpointDirName(4, ij)}));
  for (const auto& [scope, want] :
       std::vector<std::pair<model::CheckpointScope, uint64_t>>{{ia, 4}, {ib, 4}, {ij, 4}}) {
    auto found = FindLatestCheckpoint(dir, scope);
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->step, want);
    EXPECT_EQ(found->instance, scope.instance);
    EXPECT_EQ(found->job_id, scope.job_id);
    EXPECT_EQ(fs::path(found->path).filename(), model::CheckpointDirName(want, scope));
  }
  {
    auto found = FindLatestCheckpoint(dir, ia);
    ASSERT_TRUE(found.ok());
    auto restored = NewState(9);
    ASSERT_TRUE(RestoreCheckpoint(*found, restored.get(), pool_.get()).ok());
    for (uint32_t l = 0; l < restored->num_layers(); ++l) {
      EXPECT_EQ(restored->LayerChecksum(l), sums_a[l]) << "layer " << l;
    }
  }
  auto none = FindLatestCheckpoint(dir, {"ic", "default"});
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  EXPECT_NE(none.status().message().find("5 of other instances or jobs"), std::string::npos)
      << none.status();
  // Named explicitly: a step directory is anyone's to resume; the directory is ambiguous.
  auto named = FindLatestCheckpoint((dir_ / model::CheckpointDirName(3, ib)).string());
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->instance, "ib");
  auto ambiguous = FindLatestCheckpoint(dir);
  EXPECT_TRUE(absl::IsInvalidArgument(ambiguous.status())) << ambiguous.status();
  for (const std::string& want :
       {std::string("holds the checkpoints of 3 jobs"), std::string("instance 'ia' job 'default'"),
        std::string("instance 'ib' job 'default'"), std::string("instance 'ia' job 'job-2'"),
        (dir_ / model::CheckpointDirName(4, ib)).string(),
        std::string("name the step directory")}) {
    EXPECT_NE(ambiguous.status().message().find(want), std::string::npos)
        << want << " in: " << ambiguous.status();
  }
  // A directory name that contradicts meta.json is refused.
  fs::rename(dir_ / model::CheckpointDirName(3, ib),
             dir_ / model::CheckpointDirName(3, {"ix", "default"}));
  auto renamed =
      model::ReadCheckpointInfo((dir_ / model::CheckpointDirName(3, {"ix", "default"})).string());
  EXPECT_TRUE(absl::IsDataLoss(renamed.status())) << renamed.status();
  EXPECT_NE(renamed.status().message().find("instance 'ib' job 'default'"), std::string::npos)
      << renamed.status();
  fs::rename(dir_ / model::CheckpointDirName(3, {"ix", "default"}),
             dir_ / model::CheckpointDirName(3, ib));

  // A format-2 checkpoint (step 9, newer than all) in the same directory.
  {
    for (uint32_t l = 0; l < b->num_layers(); ++l) {
      b->BeginLayerWrite(l, 9);
      b->PublishLayer(l, 9);
    }
    Checkpointer cl(b.get(), pool_.get(), {.keep_last = 0});
    ASSERT_TRUE(cl.Start((dir_ / "src").string(), 9, Describe(*b)).ok());
    auto r = cl.Wait(9, 60000);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(AsOldFormat(r->path, 2), (dir_ / "src" / model::CheckpointDirName(9)).string());
    auto only_old = FindLatestCheckpoint((dir_ / "src").string());  // one job's: unambiguous
    ASSERT_TRUE(only_old.ok()) << only_old.status();
    EXPECT_EQ(only_old->step, 9u);
    EXPECT_EQ(only_old->format, 2u);
    EXPECT_EQ(only_old->instance, "");
    fs::rename(dir_ / "src" / model::CheckpointDirName(9), dir_ / model::CheckpointDirName(9));
    fs::remove_all(dir_ / "src");
  }
  auto mine = FindLatestCheckpoint(dir, ia);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->step, 4u);  // not the newer unscoped step 9
  for (uint32_t l = 0; l < a->num_layers(); ++l) {
    a->BeginLayerWrite(l, 5);
    a->PublishLayer(l, 5);
  }
  ASSERT_TRUE(ca.Start(dir, 5, Describe(*a)).ok());  // prunes ia's step 3, nothing else
  ASSERT_TRUE(ca.Wait(5, 60000).ok());
  EXPECT_EQ(names(),
            (std::set<std::string>{model::CheckpointDirName(4, ia), model::CheckpointDirName(5, ia),
                                   model::CheckpointDirName(3, ib), model::CheckpointDirName(4, ib),
                                   model::CheckpointDirName(4, ij), model::CheckpointDirName(9)}));
  auto legacy = FindLatestCheckpoint((dir_ / model::CheckpointDirName(9)).string());
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  EXPECT_EQ(legacy->job_id, "default");
  ASSERT_TRUE(model::VerifyCheckpointData(*legacy).ok());
  auto restored = NewState(10);
  ASSERT_TRUE(RestoreCheckpoint(*legacy, restored.get(), pool_.get()).ok());
  EXPECT_EQ(restored->committed_version(0), 9u);
  auto listed = model::ListCheckpoints(dir, false);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 6u);
  EXPECT_EQ((*listed)[0].step, 9u);
  EXPECT_TRUE((*listed)[0].valid) << (*listed)[0].reason;
  EXPECT_EQ((*listed)[0].instance, "");
  EXPECT_EQ((*listed)[0].scope_name, "");
}

// The same between two hostd engines: instances A and B share checkpoint.dir, the model and the
// job id. A checkpoints steps 1 to 4, B (other weights) runs 6 steps and checkpoints 5 and 6;
// keep_last 2 each. Neither prunes the other's. Then A starts again over a state it cannot
// re-adopt (another model's, left by a crash): recovery restores A's own newest checkpoint (step
// 4, A's weights), not B's newer one. The old code's B removed A's checkpoints, and A's recovery
// restored B's step 6.
TEST(CheckpointScopeEngineTest, InstancesSharingADirectoryNeitherPruneNorRestoreEachOthers) {
  const fs::path dir = fs::temp_directory_path() / UniqueInstance("ckshare");
  const std::string ck = (dir / "ck").string();
  auto config = [&](const std::string& instance, uint64_t seed) {
    HostdConfig c;
    c.instance = instance;
    c.model = "tiny";
    c.seed = seed;
    c.update_threads = 1;
    c.mlock = "best_effort";
    c.optimizer.set_lr(1e-3);
    c.routes.set_chunk_bytes(1 << 20);
    c.checkpoint.dir = ck;
    c.checkpoint.keep_last = 2;
    c.checkpoint.on_stop = false;
    c.checkpoint.prepare_snapshot_pool = false;
    return c;
  };
  auto step = [](Engine& e, uint64_t t) {
    TrainingState* s = e.state();
    for (uint32_t l = s->num_layers(); l-- > 0;) {
      std::vector<uint16_t> g(s->layers()[l].numel, kernels::RoundToBf16(1e-2f * (1 + t + l)));
      absl::Status submitted =
          e.SubmitGradient(l, t, {g.data(), kernels::GradType::kBf16, g.size()});
      ASSERT_TRUE(submitted.ok()) << submitted;
      ASSERT_TRUE(e.WaitLayerVersion(l, t, std::chrono::seconds(30)).ok());
    }
    // The last layer's version is published just before the worker's callback closes the step:
    // the next step's first gradient must not come in between.
    for (int i = 0; i < 30000; ++i) {
      auto st = e.GetStats(v1::GetStatsRequest());
      ASSERT_TRUE(st.ok()) << st.status();
      if (st->steps_completed() >= t) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    FAIL() << "step " << t << " did not complete";
  };
  auto checkpoint = [](Engine& e, uint64_t t) {
    v1::CheckpointRequest req;
    req.set_wait(true);
    auto r = e.Checkpoint(req);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->step(), t);
  };
  const std::string ia = UniqueInstance("ia"), ib = UniqueInstance("ib");
  std::vector<uint64_t> sums_a;
  {
    auto ea = Engine::Create(config(ia, 1));
    ASSERT_TRUE(ea.ok()) << ea.status();
    auto eb = Engine::Create(config(ib, 2));
    ASSERT_TRUE(eb.ok()) << eb.status();
    for (uint64_t t = 1; t <= 6; ++t) {
      if (t <= 4) {
        ASSERT_NO_FATAL_FAILURE(step(**ea, t));
        ASSERT_NO_FATAL_FAILURE(checkpoint(**ea, t));
      }
      ASSERT_NO_FATAL_FAILURE(step(**eb, t));
      if (t >= 5) {
        ASSERT_NO_FATAL_FAILURE(checkpoint(**eb, t));
      }
    }
    for (uint32_t l = 0; l < (*ea)->state()->num_layers(); ++l) {
      sums_a.push_back((*ea)->state()->LayerChecksum(l));
    }
    (*ea)->Shutdown(/*remove_state=*/true).IgnoreError();
    (*eb)->Shutdown(/*remove_state=*/true).IgnoreError();
  }
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(ck)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{model::CheckpointDirName(3, {ia, "default"}),
                                          model::CheckpointDirName(4, {ia, "default"}),
                                          model::CheckpointDirName(5, {ib, "default"}),
                                          model::CheckpointDirName(6, {ib, "default"})}));
  {
    // A crash left instance A's segments holding another model's state: not adoptable.
    TrainingState::Options so;
    so.instance = ia;
    so.model = SmallModel();
    so.mlock = MlockPolicy::kOff;
    ASSERT_TRUE(TrainingState::Create(so, nullptr).ok());  // left in /dev/shm
  }
  auto again = Engine::Create(config(ia, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  Engine& e = **again;
  EXPECT_EQ(e.state()->committed_version(0), 4u);
  for (uint32_t l = 0; l < e.state()->num_layers() && l < sums_a.size(); ++l) {
    EXPECT_EQ(e.state()->LayerChecksum(l), sums_a[l]) << "layer " << l;
  }
  auto status = e.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(fs::path(status->job().resumed_from()).filename(),
            model::CheckpointDirName(4, {ia, "default"}));
  e.Shutdown(/*remove_state=*/true).IgnoreError();
  again->reset();
  fs::remove_all(dir);
}

TEST_F(CheckpointTest, KeepLastDeletesOlderOnlyAfterCommit) {
  auto state = NewState(1);
  UpdateWorker worker(state.get(), pool_.get(), {kernels::BestIsa(), 8192}, Cfg());
  Checkpointer cp(state.get(), pool_.get(), {.keep_last = 2});
  worker.SetBeforeWriteHook([&cp](uint32_t l, uint64_t s) { cp.BeforeLayerWrite(l, s); });
  worker.Start();
  std::mt19937 rng(1);
  for (uint64_t t = 1; t <= 5; ++t) {
    Train(worker, *state, 1, rng);
    ASSERT_TRUE(cp.Start(dir_.string(), t, Describe(*state)).ok());
    ASSERT_TRUE(cp.Wait(t, 60000).ok());
  }
  worker.Stop();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{Name(4), Name(5)}));
  // A second checkpoint of a committed step is refused.
  EXPECT_TRUE(absl::IsAlreadyExists(cp.Start(dir_.string(), 5, Describe(*state))));
}

// R5: each layer file is fsynced before meta.json; the .tmp directory before the rename; the
// parent directory after it; the marker is the last file written, then its directory fsynced.
TEST_F(CheckpointTest, DurableWriteOrder) {
  std::vector<std::pair<std::string, std::string>> ops;
  model::CheckpointDirWriter::Options o;
  o.trace = [&ops](std::string_view op, const std::string& path) {
    ops.emplace_back(std::string(op), fs::path(path).filename().string());
  };
  auto w = model::CheckpointDirWriter::Begin(dir_.string(), 7, {"default", "default"}, o);
  ASSERT_TRUE(w.ok());
  std::vector<float> a(100, 1.0f);
  auto state = NewState(1);
  model::CheckpointInfo info = Describe(*state);
  for (uint32_t l = 0; l < 2; ++l)
    ASSERT_TRUE((*w)->WriteLayer(l, 100, a.data(), a.data(), a.data()).ok());
  ASSERT_TRUE((*w)->Commit(info).ok());
  const std::string tmp = Name(7) + ".tmp";
  const std::string fin = Name(7);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"mkdir", tmp},
      {"write", "layer-00000.bin"},
      {"fsync", "layer-00000.bin"},
      {"write", "layer-00001.bin"},
      {"fsync", "layer-00001.bin"},
      {"write", "meta.json"},
      {"fsync", "meta.json"},
      {"fsync_dir", tmp},
      {"rename", fin},
      {"fsync_dir", dir_.filename().string()},
      {"write", "COMMITTED.tmp"},
      {"fsync", "COMMITTED.tmp"},
      {"rename", "COMMITTED"},
      {"fsync_dir", fin}};
  EXPECT_EQ(ops, want);
}

TEST_F(CheckpointTest, ManifestMismatchNamesBothHashesAndTheTensor) {
  auto state = NewState(1);
  Checkpointer cp(state.get(), pool_.get(), {.keep_last = 0});
  ASSERT_TRUE(cp.Start(dir_.string(), 0, Describe(*state)).ok());
  ASSERT_TRUE(cp.Wait(0, 60000).ok());
  auto info = FindLatestCheckpoint(dir_.string());
  ASSERT_TRUE(info.ok());
  v1::ModelManifest other = state->model().manifest;
  other.mutable_layers(1)->mutable_tensors(0)->set_shape(1, 4);
  absl::Status s = CheckCheckpointManifest(*info, other);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find(model::ManifestHashHex(model::ManifestHash(other))), std::string::npos)
      << s;
  EXPECT_NE(s.message().find(info->manifest_hash), std::string::npos) << s;
  EXPECT_NE(s.message().find("block1.proj.weight"), std::string::npos) << s;
  EXPECT_TRUE(CheckCheckpointManifest(*info, state->model().manifest).ok());
}

}  // namespace
}  // namespace slidedp::hostd
