#include "hostd/hf_export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/str_format.h"
#include "common/thread_pool.h"
#include "gtest/gtest.h"
#include "hostd/engine.h"
#include "hostd/state.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"
#include "model/checkpoint_format.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using testing::UniqueInstance;

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/slidedp-export-test-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  std::string path;
};

std::unique_ptr<TrainingState> MakeState(const std::string& model) {
  auto loaded = model::LoadModel(model);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  TrainingState::Options o;
  o.instance = UniqueInstance("export");
  o.model = *loaded;
  o.model.manifest.set_manifest_hash(model::ManifestHashHex(model::ManifestHash(o.model.manifest)));
  o.seed = 11;
  o.mlock = MlockPolicy::kBestEffort;
  auto s = TrainingState::Create(o, nullptr);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  (*s)->set_remove_on_destroy(true);
  return std::move(*s);
}

std::string ReadText(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::set<std::string> Listing(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

// Every manifest tensor is in the checkpoint with the manifest's shape and exactly `expect`'s
// bytes; the checkpoint has no other tensor.
template <typename Expect>
void CheckTensors(const TrainingState& s, const std::string& dir, model::SafetensorsDtype dtype,
                  Expect expect) {
  auto ckpt = model::SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  size_t count = 0;
  for (const LayerInfo& l : s.layers()) {
    for (size_t t = 0; t < l.tensors.size(); ++t) {
      const TensorRange& r = l.tensors[t];
      const auto* e = (*ckpt)->Find(r.name);
      ASSERT_NE(e, nullptr) << r.name;
      EXPECT_EQ(e->tensor->dtype, dtype) << r.name;
      const auto& spec =
          s.model().manifest.layers(static_cast<int>(l.index)).tensors(static_cast<int>(t));
      ASSERT_EQ(e->tensor->shape.size(), static_cast<size_t>(spec.shape_size())) << r.name;
      for (int d = 0; d < spec.shape_size(); ++d) {
        EXPECT_EQ(e->tensor->shape[d], static_cast<uint64_t>(spec.shape(d))) << r.name;
      }
      const size_t bytes = r.numel * model::SafetensorsDtypeBytes(dtype);
      std::vector<unsigned char> got(bytes);
      ASSERT_TRUE(e->file->Read(*e->tensor, 0, got.data(), bytes).ok());
      EXPECT_EQ(std::memcmp(got.data(), expect(l.index, r.offset), bytes), 0) << r.name;
      count++;
    }
  }
  EXPECT_EQ((*ckpt)->tensors().size(), count);
}

TEST(HfExportTest, Fp32SingleFileIsTheMasterBitForBit) {
  auto s = MakeState("tiny");
  ASSERT_NE(s, nullptr);
  TempDir tmp;
  HfExportOptions o;
  o.out_dir = tmp.path + "/out";
  o.dtype = ExportDtype::kFp32;
  o.config_json = s->model().config_json;
  auto r = ExportHf(*s, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->files, (std::vector<std::string>{"model.safetensors", "config.json"}));
  EXPECT_EQ(Listing(o.out_dir), (std::set<std::string>{"model.safetensors", "config.json",
                                                       std::string(kExportMarkerFile)}));
  EXPECT_FALSE(fs::exists(o.out_dir + ".tmp"));
  // The marker names hostd, the version and the files.
  const Json marker = Json::parse(ReadText(o.out_dir + "/" + std::string(kExportMarkerFile)));
  EXPECT_EQ(marker.at("written_by"), "hostd");
  EXPECT_EQ(marker.at("version"), 0);
  EXPECT_EQ(marker.at("dtype"), "fp32");
  EXPECT_EQ(marker.at("files"), Json(r->files));
  EXPECT_FALSE(marker.at("hostd_version").get<std::string>().empty());
  EXPECT_EQ(r->tensor_bytes, s->total_params() * 4);
  CheckTensors(*s, o.out_dir, model::SafetensorsDtype::kF32, [&](uint32_t l, uint64_t off) {
    return static_cast<const void*>(s->master(l) + off);
  });
  const Json config = Json::parse(ReadText(o.out_dir + "/config.json"));
  EXPECT_EQ(config.at("torch_dtype"), "float32");
  EXPECT_EQ(config.at("tie_word_embeddings"), false);
  EXPECT_EQ(config.at("model_type"), "qwen3");
  // The header carries format "pt" (transformers refuses other formats).
  auto file = model::SafetensorsFile::Open(o.out_dir + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->header().metadata.at("format"), "pt");
  EXPECT_EQ((*file)->header().data_offset % 8, 0u);
}

TEST(HfExportTest, Bf16ShardsWithIndexEqualTheServedParams) {
  for (const char* model : {"tiny", "tiny-tied"}) {
    SCOPED_TRACE(model);
    auto s = MakeState(model);
    ASSERT_NE(s, nullptr);
    ThreadPool::Options po;
    po.num_threads = 2;
    auto pool = ThreadPool::Create(po);
    ASSERT_TRUE(pool.ok());
    TempDir tmp;
    HfExportOptions o;
    o.out_dir = tmp.path + "/out/";  // a trailing '/' is normalized away
    o.max_shard_bytes = 40000;       // the 512x64 embedding (64 KiB) gets a shard of its own
    o.config_json = s->model().config_json;
    auto r = ExportHf(*s, o, pool->get());
    ASSERT_TRUE(r.ok()) << r.status();
    const std::string out = tmp.path + "/out";
    EXPECT_EQ(r->out_dir, out);
    const auto shards = PlanExportShards(s->model().manifest, ExportDtype::kBf16, 40000);
    ASSERT_GT(shards.size(), 3u);
    EXPECT_EQ(shards[0].file, absl::StrFormat("model-00001-of-%05d.safetensors", shards.size()));
    EXPECT_EQ(shards[0].tensors.size(), 1u);  // the embedding alone, over the limit
    for (const ExportShard& sh : shards) {
      EXPECT_TRUE(sh.bytes <= 40000 || sh.tensors.size() == 1) << sh.file;
      EXPECT_TRUE(fs::exists(out + "/" + sh.file)) << sh.file;
    }
    const Json index = Json::parse(ReadText(out + "/model.safetensors.index.json"));
    EXPECT_EQ(index.at("metadata").at("total_size"), s->total_params() * 2);
    EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
    EXPECT_EQ(index.at("weight_map").contains("lm_head.weight"), std::string(model) == "tiny");
    CheckTensors(*s, out, model::SafetensorsDtype::kBF16, [&](uint32_t l, uint64_t off) {
      return static_cast<const void*>(s->params(l) + off);
    });
    const Json config = Json::parse(ReadText(out + "/config.json"));
    EXPECT_EQ(config.at("torch_dtype"), "bfloat16");
    EXPECT_EQ(config.at("tie_word_embeddings"), std::string(model) == "tiny-tied");
  }
}

TEST(HfExportTest, GenerationConfigWhenTheConfigNamesTokens) {
  auto s = MakeState("tiny");
  ASSERT_NE(s, nullptr);
  Json config = Json::parse(s->model().config_json);
  config["eos_token_id"] = 2;
  config["bos_token_id"] = 1;
  TempDir tmp;
  HfExportOptions o;
  o.out_dir = tmp.path + "/out";
  o.config_json = config.dump();
  auto r = ExportHf(*s, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  const Json g = Json::parse(ReadText(o.out_dir + "/generation_config.json"));
  EXPECT_EQ(g.at("eos_token_id"), 2);
  EXPECT_EQ(g.at("bos_token_id"), 1);
  EXPECT_FALSE(g.contains("pad_token_id"));
}

TEST(HfExportTest, BadDestinationsAndConfigs) {
  auto s = MakeState("tiny");
  ASSERT_NE(s, nullptr);
  TempDir tmp;
  HfExportOptions o;
  o.config_json = s->model().config_json;
  auto expect = [&](const std::string& out, absl::StatusCode code, const std::string& text) {
    o.out_dir = out;
    auto r = ExportHf(*s, o, nullptr);
    ASSERT_FALSE(r.ok()) << out;
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status();
  };
  expect("relative/out", absl::StatusCode::kInvalidArgument, "out_dir: expected an absolute path");
  expect("/", absl::StatusCode::kInvalidArgument, "below '/'");
  expect(tmp.path + "/missing/out", absl::StatusCode::kNotFound, "does not exist");
  { std::ofstream(tmp.path + "/file") << "x"; }
  expect(tmp.path + "/file/out", absl::StatusCode::kFailedPrecondition, "is not a directory");
  expect(tmp.path + "/file", absl::StatusCode::kFailedPrecondition,
         "exists and is not a directory");
  fs::create_directory(tmp.path + "/full");
  { std::ofstream(tmp.path + "/full/keep.txt") << "user data"; }
  expect(tmp.path + "/full", absl::StatusCode::kAlreadyExists, "exists and is not empty");
  EXPECT_TRUE(fs::exists(tmp.path + "/full/keep.txt"));
  // A "<out>.tmp" that is not an unfinished export is never removed.
  fs::create_directory(tmp.path + "/x.tmp");
  { std::ofstream(tmp.path + "/x.tmp/mine.txt") << "user data"; }
  expect(tmp.path + "/x", absl::StatusCode::kFailedPrecondition,
         tmp.path + "/x.tmp holds entries hostd did not write: mine.txt");
  EXPECT_EQ(ReadText(tmp.path + "/x.tmp/mine.txt"), "user data");
  { std::ofstream(tmp.path + "/w.tmp") << "a file"; }
  expect(tmp.path + "/w", absl::StatusCode::kFailedPrecondition, "exists and is not a directory");
  EXPECT_TRUE(fs::exists(tmp.path + "/w.tmp"));
  // The config must describe this model.
  auto other = model::LoadModel("tiny-tied");
  ASSERT_TRUE(other.ok());
  o.config_json = other->config_json;
  expect(tmp.path + "/y", absl::StatusCode::kInvalidArgument, "config_json: describes a model");
  o.config_json = "";
  expect(tmp.path + "/y", absl::StatusCode::kInvalidArgument, "config_json: the job has no HF");
  o.config_json = R"({"model_type": "gpt2"})";
  expect(tmp.path + "/y", absl::StatusCode::kInvalidArgument, "model_type");
  EXPECT_FALSE(fs::exists(tmp.path + "/y"));
  EXPECT_FALSE(fs::exists(tmp.path + "/y.tmp"));
  o.config_json = s->model().config_json;
  // Cancelled in the middle: nothing left under either name.
  o.cancelled = [] { return true; };
  expect(tmp.path + "/z", absl::StatusCode::kCancelled, "cancelled");
  EXPECT_FALSE(fs::exists(tmp.path + "/z"));
  EXPECT_FALSE(fs::exists(tmp.path + "/z.tmp"));
  o.cancelled = nullptr;
  if (geteuid() != 0) {  // root writes anywhere
    fs::create_directory(tmp.path + "/ro");
    fs::permissions(tmp.path + "/ro", fs::perms::owner_read | fs::perms::owner_exec);
    expect(tmp.path + "/ro/out", absl::StatusCode::kPermissionDenied, "mkdir");
  }
}

// Writes a marker as an export of hostd does, listing `files`.
void WriteMarker(const std::string& dir, const std::vector<std::string>& files) {
  std::ofstream(dir + "/" + std::string(kExportMarkerFile))
      << Json{{"written_by", "hostd"}, {"version", 1}, {"files", files}}.dump();
}

// --overwrite replaces an earlier export of hostd, and only that: a directory that holds anything
// else is refused, naming it, and keeps every entry (issue #17: "--out /var/lib/slidedp
// --overwrite" removed every checkpoint).
TEST(HfExportTest, OverwriteReplacesOnlyAnEarlierExportOfHostd) {
  auto s = MakeState("tiny");
  ASSERT_NE(s, nullptr);
  TempDir tmp;
  const std::string out = tmp.path + "/out";
  HfExportOptions o;
  o.out_dir = out;
  o.dtype = ExportDtype::kFp32;
  o.config_json = s->model().config_json;
  auto r = ExportHf(*s, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  // An earlier export (BF16, sharded) is replaced.
  o.overwrite = true;
  o.dtype = ExportDtype::kBf16;
  o.max_shard_bytes = 40000;
  r = ExportHf(*s, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  std::set<std::string> expected(r->files.begin(), r->files.end());
  expected.insert(std::string(kExportMarkerFile));
  EXPECT_EQ(Listing(out), expected);
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  // ...and back to one file.
  o.dtype = ExportDtype::kFp32;
  o.max_shard_bytes = 0;
  r = ExportHf(*s, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Listing(out), (std::set<std::string>{"model.safetensors", "config.json",
                                                 std::string(kExportMarkerFile)}));

  // An export with a file of someone else's, a sub-directory and a symlink under a listed name.
  { std::ofstream(out + "/notes.txt") << "mine"; }
  fs::create_directory(out + "/data");
  { std::ofstream(out + "/data/keep.bin") << "mine too"; }
  auto refused = ExportHf(*s, o, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(
      refused.status().message().find(absl::StrCat("out_dir: ", out,
                                                   " holds entries hostd did not write: data/, "
                                                   "notes.txt")),
      std::string::npos)
      << refused.status();
  EXPECT_EQ(ReadText(out + "/notes.txt"), "mine");
  EXPECT_EQ(ReadText(out + "/data/keep.bin"), "mine too");
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + ".tmp"));

  // A directory of checkpoints (no marker) is refused: nothing in it is hostd's export.
  const std::string ckpt = tmp.path + "/ckpt";
  fs::create_directories(ckpt + "/step-5");
  { std::ofstream(ckpt + "/step-5/COMMITTED") << "x"; }
  { std::ofstream(ckpt + "/config.json") << "{}"; }
  o.out_dir = ckpt;
  refused = ExportHf(*s, o, nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("config.json, step-5/"), std::string::npos)
      << refused.status();
  EXPECT_TRUE(fs::exists(ckpt + "/step-5/COMMITTED"));
  EXPECT_EQ(ReadText(ckpt + "/config.json"), "{}");

  // A marker naming a file that is a symlink (or a directory) does not make it hostd's.
  const std::string linked = tmp.path + "/linked";
  fs::create_directory(linked);
  { std::ofstream(tmp.path + "/precious") << "precious"; }
  fs::create_symlink(tmp.path + "/precious", linked + "/model.safetensors");
  WriteMarker(linked, {"model.safetensors", "config.json"});
  o.out_dir = linked;
  refused = ExportHf(*s, o, nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("model.safetensors (symlink)"), std::string::npos)
      << refused.status();
  EXPECT_EQ(ReadText(tmp.path + "/precious"), "precious");
  // A marker that is not hostd's JSON: every entry is foreign.
  const std::string forged = tmp.path + "/forged";
  fs::create_directory(forged);
  std::ofstream(forged + "/" + std::string(kExportMarkerFile)) << "not json";
  { std::ofstream(forged + "/config.json") << "{}"; }
  o.out_dir = forged;
  refused = ExportHf(*s, o, nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("(not a valid export marker"), std::string::npos)
      << refused.status();
  EXPECT_TRUE(fs::exists(forged + "/config.json"));

  // An empty out_dir is used without overwrite.
  fs::create_directory(tmp.path + "/empty");
  o.out_dir = tmp.path + "/empty";
  o.overwrite = false;
  r = ExportHf(*s, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(fs::exists(tmp.path + "/empty/model.safetensors"));
}

// A crashed export's "<out>.tmp": what its marker lists is removed, anything else is not.
TEST(HfExportTest, LeftoverTmpLosesOnlyWhatItsMarkerLists) {
  auto s = MakeState("tiny");
  ASSERT_NE(s, nullptr);
  TempDir tmp;
  const std::string out = tmp.path + "/out";
  HfExportOptions o;
  o.out_dir = out;
  o.dtype = ExportDtype::kFp32;
  o.config_json = s->model().config_json;
  // Left by a crash in the middle of the second shard.
  fs::create_directory(out + ".tmp");
  WriteMarker(out + ".tmp", {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                             "config.json"});
  { std::ofstream(out + ".tmp/model-00001-of-00002.safetensors") << "complete"; }
  { std::ofstream(out + ".tmp/model-00002-of-00002.safetensors") << "partial"; }
  auto r = ExportHf(*s, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));

  // The same leftover with a file someone put there: refused, and all of it stays.
  const std::string out2 = tmp.path + "/out2";
  o.out_dir = out2;
  fs::create_directory(out2 + ".tmp");
  WriteMarker(out2 + ".tmp", {"model.safetensors", "config.json"});
  { std::ofstream(out2 + ".tmp/model.safetensors") << "partial"; }
  { std::ofstream(out2 + ".tmp/user.txt") << "not hostd's"; }
  auto refused = ExportHf(*s, o, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find(out2 + ".tmp holds entries hostd did not write: "
                                                   "user.txt"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(Listing(out2 + ".tmp"), (std::set<std::string>{std::string(kExportMarkerFile),
                                                           "model.safetensors", "user.txt"}));
  EXPECT_FALSE(fs::exists(out2));
}

// What appears in the export's own directories while it runs is not hostd's either: a failed
// export removes only its files, and an earlier export that gained a foreign entry after the
// check is swapped back, not removed.
TEST(HfExportTest, EntriesAddedDuringTheExportAreKept) {
  auto s = MakeState("tiny");
  ASSERT_NE(s, nullptr);
  TempDir tmp;
  const std::string out = tmp.path + "/out";
  HfExportOptions o;
  o.out_dir = out;
  o.dtype = ExportDtype::kFp32;
  o.config_json = s->model().config_json;
  // `cancelled` is polled between writes: it plants a file in the staging directory, then
  // cancels the export.
  o.cancelled = [&] {
    std::ofstream(out + ".tmp/planted.txt") << "planted";
    return true;
  };
  auto r = ExportHf(*s, o, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_EQ(Listing(out + ".tmp"), (std::set<std::string>{"planted.txt"}));
  EXPECT_FALSE(fs::exists(out));
  fs::remove(out + ".tmp/planted.txt");
  fs::remove(out + ".tmp");

  o.cancelled = nullptr;
  ASSERT_TRUE(ExportHf(*s, o, nullptr).ok());
  // Now an overwrite during which a file lands in the export being replaced.
  o.overwrite = true;
  o.cancelled = [&] {
    std::ofstream(out + "/late.txt") << "late";
    return false;
  };
  r = ExportHf(*s, o, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("late.txt"), std::string::npos) << r.status();
  EXPECT_EQ(ReadText(out + "/late.txt"), "late");
  EXPECT_EQ(Listing(out), (std::set<std::string>{"model.safetensors", "config.json", "late.txt",
                                                 std::string(kExportMarkerFile)}));
  EXPECT_FALSE(fs::exists(out + ".tmp"));
}

TEST(HfExportTest, PlanPutsEveryTensorOnceInOrder) {
  auto m = model::LoadModel("tiny");
  ASSERT_TRUE(m.ok());
  for (uint64_t max : {uint64_t{0}, uint64_t{1}, uint64_t{10000}, uint64_t{1} << 40}) {
    const auto shards = PlanExportShards(m->manifest, ExportDtype::kFp32, max);
    std::vector<std::pair<uint32_t, uint32_t>> all;
    for (const auto& sh : shards) all.insert(all.end(), sh.tensors.begin(), sh.tensors.end());
    size_t expected = 0;
    for (const auto& l : m->manifest.layers()) expected += static_cast<size_t>(l.tensors_size());
    ASSERT_EQ(all.size(), expected) << max;
    for (size_t i = 1; i < all.size(); ++i) EXPECT_LT(all[i - 1], all[i]);
    if (max == 1) {
      EXPECT_EQ(shards.size(), expected);  // one tensor per shard
    }
    if (max == 0 || max == (uint64_t{1} << 40)) {
      ASSERT_EQ(shards.size(), 1u);
      EXPECT_EQ(shards[0].file, "model.safetensors");
    }
  }
}

// Engine::ExportHF: bad input, and the step boundary: an export asked for while a step's updates
// are outstanding waits for the step to complete and exports its version.
TEST(HfExportEngineTest, WaitsForTheStepBoundaryAndValidatesInput) {
  TempDir tmp;
  HostdConfig config;
  config.instance = UniqueInstance("exp-eng");
  config.socket = tmp.path + "/hostd.sock";
  config.model = "tiny";
  config.update_threads = 2;
  config.mlock = "best_effort";
  config.optimizer.set_lr(1e-3);
  config.routes.set_chunk_bytes(16 << 20);
  config.output_roots = {tmp.path};
  auto created = Engine::Create(config);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> engine = std::move(*created);
  TrainingState* s = engine->state();

  slidedp::v1::ExportHFRequest req;
  req.set_out_dir(tmp.path + "/bad");
  req.set_dtype(static_cast<slidedp::v1::DType>(7));
  auto bad = engine->ExportHF(req);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("dtype: expected DTYPE_BF16 or DTYPE_FP32, got 7"),
            std::string::npos)
      << bad.status();
  req.set_dtype(slidedp::v1::DTYPE_BF16);
  req.set_job_id("nope");
  EXPECT_EQ(engine->ExportHF(req).status().code(), absl::StatusCode::kNotFound);
  req.set_job_id("");
  req.set_out_dir("rel");
  EXPECT_EQ(engine->ExportHF(req).status().code(), absl::StatusCode::kInvalidArgument);

  std::vector<std::vector<uint16_t>> grads;
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0, 1e-2f);
  for (const LayerInfo& l : s->layers()) {
    grads.emplace_back(l.numel);
    for (auto& x : grads.back()) x = kernels::RoundToBf16(d(rng));
  }
  const uint32_t n = s->num_layers();
  // Step 1 runs: every layer but layer 0 has its gradient.
  for (uint32_t l = n; l-- > 1;) {
    ASSERT_TRUE(
        engine->SubmitGradient(l, 1, {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
            .ok());
  }
  req.set_out_dir(tmp.path + "/out");
  auto exported = std::async(std::launch::async, [&] { return engine->ExportHF(req); });
  EXPECT_EQ(exported.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  ASSERT_TRUE(
      engine->SubmitGradient(0, 1, {grads[0].data(), kernels::GradType::kBf16, grads[0].size()})
          .ok());
  auto r = exported.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version(), 1u);
  const Json marker = Json::parse(ReadText(tmp.path + "/out/" + std::string(kExportMarkerFile)));
  EXPECT_EQ(marker.at("job_id"), "default");
  EXPECT_EQ(marker.at("version"), 1);
  EXPECT_EQ(r->dtype(), slidedp::v1::DTYPE_BF16);
  for (uint32_t l = 0; l < n; ++l) EXPECT_EQ(s->committed_version(l), 1u);
  CheckTensors(
      *s, tmp.path + "/out", model::SafetensorsDtype::kBF16,
      [&](uint32_t l, uint64_t off) { return static_cast<const void*>(s->params(l) + off); });
  // A second export into the same, now non-empty, directory is refused unless overwrite.
  auto again = engine->ExportHF(req);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  req.set_overwrite(true);
  req.set_dtype(slidedp::v1::DTYPE_FP32);
  r = engine->ExportHF(req);
  ASSERT_TRUE(r.ok()) << r.status();
  CheckTensors(*s, tmp.path + "/out", model::SafetensorsDtype::kF32, [&](uint32_t l, uint64_t off) {
    return static_cast<const void*>(s->master(l) + off);
  });
  // A step can run after the export (nothing is left held).
  for (uint32_t l = n; l-- > 0;) {
    ASSERT_TRUE(
        engine->SubmitGradient(l, 2, {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
            .ok());
  }
  for (uint32_t l = 0; l < n; ++l) {
    ASSERT_TRUE(engine->WaitLayerVersion(l, 2, std::chrono::seconds(10)).ok());
  }
  engine->Shutdown(/*remove_state=*/true).IgnoreError();
}

// Engine::Checkpoint's dir and Engine::ExportHF's out_dir: absolute, and under checkpoint.dir (a
// checkpoint) or output_roots, after resolving ".." and symlinks (issue #17).
TEST(EngineOutputDirTest, RequestedDirsMustBeAbsoluteAndUnderTheRoots) {
  TempDir tmp;
  const std::string ckpt = tmp.path + "/ckpt";
  const std::string root = tmp.path + "/root";
  fs::create_directories(root);
  fs::create_directories(tmp.path + "/outside");
  fs::create_symlink(tmp.path + "/outside", root + "/link");
  HostdConfig config;
  config.instance = UniqueInstance("out-dirs");
  config.socket = tmp.path + "/hostd.sock";
  config.model = "tiny";
  config.update_threads = 1;
  config.mlock = "best_effort";
  config.checkpoint.dir = ckpt;
  config.checkpoint.prepare_snapshot_pool = false;
  auto created = Engine::Create(config);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> engine = std::move(*created);
  auto checkpoint = [&](const std::string& dir) {
    slidedp::v1::CheckpointRequest req;
    req.set_dir(dir);
    req.set_wait(true);
    return engine->Checkpoint(req);
  };
  auto expect_refused = [](const absl::Status& st, absl::StatusCode code,
                           const std::vector<std::string>& fragments) {
    EXPECT_EQ(st.code(), code) << st;
    for (const std::string& f : fragments) {
      EXPECT_NE(st.message().find(f), std::string::npos) << "'" << f << "' not in: " << st;
    }
  };
  // No output_roots: checkpoints go to checkpoint.dir or below it, exports nowhere.
  expect_refused(checkpoint("rel/ckpt").status(), absl::StatusCode::kInvalidArgument,
                 {"dir: expected an absolute path", "'rel/ckpt'"});
  expect_refused(checkpoint(tmp.path + "/outside").status(), absl::StatusCode::kPermissionDenied,
                 {"dir: '" + tmp.path + "/outside'", "checkpoint.dir ('" + ckpt + "')",
                  "output_roots (none set)", "set output_roots"});
  expect_refused(checkpoint(ckpt + "/../outside").status(), absl::StatusCode::kPermissionDenied,
                 {"(resolved: '" + tmp.path + "/outside')"});
  EXPECT_FALSE(fs::exists(tmp.path + "/outside/step-0"));
  auto in_ckpt = checkpoint(ckpt + "/extra");
  ASSERT_TRUE(in_ckpt.ok()) << in_ckpt.status();
  EXPECT_EQ(in_ckpt->path(),
            ckpt + "/extra/" + model::CheckpointDirName(0, {config.instance, "default"}));
  slidedp::v1::ExportHFRequest ex;
  ex.set_out_dir(root + "/export");
  expect_refused(engine->ExportHF(ex).status(), absl::StatusCode::kPermissionDenied,
                 {"out_dir: '" + root + "/export' is not below one of output_roots (none set)",
                  "\"/\" allows any directory"});
  ex.set_out_dir("relative/export");
  expect_refused(engine->ExportHF(ex).status(), absl::StatusCode::kInvalidArgument,
                 {"out_dir: expected an absolute path"});
  engine->Shutdown(/*remove_state=*/true).IgnoreError();
  engine.reset();

  // With a root: below it, and not out of it through ".." or a symlink.
  config.instance = UniqueInstance("out-dirs");
  config.output_roots = {root};
  created = Engine::Create(config);
  ASSERT_TRUE(created.ok()) << created.status();
  engine = std::move(*created);
  auto in_root = checkpoint(root + "/c");
  ASSERT_TRUE(in_root.ok()) << in_root.status();
  EXPECT_EQ(in_root->path(),
            root + "/c/" + model::CheckpointDirName(0, {config.instance, "default"}));
  expect_refused(checkpoint(root + "/link/c").status(), absl::StatusCode::kPermissionDenied,
                 {"(resolved: '" + tmp.path + "/outside/c')", "(" + root + ")"});
  ex.set_out_dir(root + "/export");
  auto exported = engine->ExportHF(ex);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_TRUE(fs::exists(root + "/export/model.safetensors"));
  for (const std::string& bad :
       {root + "/../outside/x", root + "/link/x", root + "/link", root, tmp.path + "/rootx"}) {
    ex.set_out_dir(bad);
    expect_refused(engine->ExportHF(ex).status(), absl::StatusCode::kPermissionDenied,
                   {"out_dir: '" + bad + "'", "output_roots (" + root + ")"});
  }
  EXPECT_TRUE(fs::is_empty(tmp.path + "/outside"));
  engine->Shutdown(/*remove_state=*/true).IgnoreError();
}

}  // namespace
}  // namespace slidedp::hostd
