// Resume (checkpoint.h): finding the newest committed checkpoint, checking it against a model,
// and loading it into a TrainingState.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "common/unique_fd.h"
#include "hostd/checkpoint.h"
#include "kernels/cpu/adamw.h"
#include "model/manifest.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace fs = std::filesystem;
namespace {

std::string ShapeText(const slidedp::v1::TensorSpec& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

// Reads exactly `n` bytes at the file's current offset into `dst`, hashing them.
absl::Status ReadExact(int fd, void* dst, size_t n, const std::string& path, XXH3_state_t* st) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = read(fd, p, std::min<size_t>(n, size_t{64} << 20));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("read " + path);
    }
    if (r == 0) return absl::DataLossError(absl::StrCat("layer file ", path, " is truncated"));
    XXH3_64bits_update(st, p, static_cast<size_t>(r));
    p += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// Says which newer step directories of `dir` were passed over for `found` and why (an
// interrupted write is expected after a crash; a marked one that fails its checks is not).
// `consider`: which listings are candidates at all.
void LogSkipped(const std::string& dir, const model::CheckpointInfo& found,
                const std::function<bool(const model::CheckpointListing&)>& consider) {
  absl::StatusOr<std::vector<model::CheckpointListing>> all = model::ListCheckpoints(dir, false);
  if (!all.ok()) return;
  for (const model::CheckpointListing& l : *all) {  // newest first
    if (l.path == found.path || l.step < found.step) break;
    if (!l.valid && consider(l)) {
      spdlog::warn("checkpoint {}: newer than {} but skipped: {}", l.path, found.path, l.reason);
    }
  }
}

}  // namespace

absl::StatusOr<model::CheckpointInfo> FindLatestCheckpoint(const std::string& path) {
  absl::StatusOr<model::CheckpointInfo> info = model::FindLatestCheckpointInfo(path);
  if (!info.ok() || info->path == path) return info;
  LogSkipped(path, *info, [](const model::CheckpointListing&) { return true; });
  return info;
}

absl::StatusOr<model::CheckpointInfo> FindLatestCheckpoint(const std::string& dir,
                                                           const model::CheckpointScope& scope) {
  absl::StatusOr<model::CheckpointInfo> info = model::FindLatestCheckpointInfo(dir, scope);
  if (!info.ok()) return info;
  const std::string mine = model::CheckpointScopeName(scope);
  LogSkipped(dir, *info,
             [&mine](const model::CheckpointListing& l) { return l.scope_name == mine; });
  return info;
}

absl::Status CheckCheckpointManifest(const model::CheckpointInfo& info,
                                     const slidedp::v1::ModelManifest& manifest) {
  const std::string have = model::ManifestHashHex(model::ManifestHash(manifest));
  const std::string want = model::ManifestHashHex(model::ManifestHash(info.spec.manifest()));
  if (have == want && info.manifest_hash == want) return absl::OkStatus();
  const auto& a = info.spec.manifest();
  std::string diff;
  const int layers = std::min(a.layers_size(), manifest.layers_size());
  for (int l = 0; l < layers && diff.empty(); ++l) {
    const auto& la = a.layers(l);
    const auto& lb = manifest.layers(l);
    if (la.name() != lb.name() || la.kind() != lb.kind()) {
      diff = absl::StrCat("layer ", l, " is '", la.name(), "' in the checkpoint, '", lb.name(),
                          "' in the model");
      break;
    }
    const int tensors = std::min(la.tensors_size(), lb.tensors_size());
    for (int t = 0; t < tensors; ++t) {
      const auto& ta = la.tensors(t);
      const auto& tb = lb.tensors(t);
      if (ta.name() != tb.name() || ShapeText(ta) != ShapeText(tb) || ta.dtype() != tb.dtype() ||
          ta.no_decay() != tb.no_decay()) {
        diff =
            absl::StrCat("first differing tensor: '", ta.name(), "' ", ShapeText(ta),
                         " in the checkpoint, '", tb.name(), "' ", ShapeText(tb), " in the model");
        break;
      }
    }
    if (diff.empty() && la.tensors_size() != lb.tensors_size()) {
      diff = absl::StrCat("layer ", l, " '", la.name(), "' has ", la.tensors_size(),
                          " tensors in the checkpoint, ", lb.tensors_size(), " in the model");
    }
  }
  if (diff.empty() && a.layers_size() != manifest.layers_size()) {
    diff = absl::StrCat("the checkpoint has ", a.layers_size(), " layers, the model ",
                        manifest.layers_size());
  }
  if (diff.empty()) diff = "the model's family, name or tied embeddings differ";
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint ", info.path, " is of model manifest ", want, " (", a.name(),
      "), but the job's model has manifest ", have, " (", manifest.name(), "); ", diff));
}

absl::Status RestoreCheckpoint(const model::CheckpointInfo& info, TrainingState* state,
                               ThreadPool* pool,
                               const std::function<bool(uint32_t layers_done)>& progress) {
  RETURN_IF_ERROR(CheckCheckpointManifest(info, state->model().manifest));
  if (info.files.size() != state->num_layers()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": ", info.files.size(),
                                            " layer files for ", state->num_layers(), " layers"));
  }
  for (const model::CheckpointFile& f : info.files) {
    if (f.numel != state->layers()[f.layer].numel) {
      return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": layer file ", f.name,
                                              " holds ", f.numel, " elements, layer ", f.layer,
                                              " has ", state->layers()[f.layer].numel));
    }
  }
  const kernels::Isa isa = kernels::BestIsa();
  uint32_t restored = 0;
  for (const model::CheckpointFile& f : info.files) {
    const std::string path = (fs::path(info.path) / f.name).string();
    UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return ErrnoStatus("open " + path);
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    model::LayerFileHeader h{};
    absl::Status s = ReadExact(fd.get(), &h, sizeof(h), path, st);
    // The rest of the header block (zeros; hashed like every byte of the file).
    std::vector<char> pad(model::LayerDataOffset(info.format) - sizeof(h));
    if (s.ok() && !pad.empty()) s = ReadExact(fd.get(), pad.data(), pad.size(), path, st);
    const uint32_t l = f.layer;
    for (float* dst : {state->master(l), state->exp_avg(l), state->exp_avg_sq(l)}) {
      if (s.ok()) s = ReadExact(fd.get(), dst, f.numel * sizeof(float), path, st);
    }
    char extra = 0;
    if (s.ok() && read(fd.get(), &extra, 1) > 0) {
      s = absl::DataLossError(absl::StrCat("layer file ", path, " is longer than meta.json says"));
    }
    fd.reset();
    const uint64_t hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    if (!s.ok()) return Annotate(s, absl::StrCat("checkpoint ", info.path));
    if (hash != f.xxh64) {
      return absl::DataLossError(absl::StrFormat(
          "checkpoint %s: layer file %s has checksum %016x, meta.json says %016x (corrupted)",
          info.path, f.name, hash, f.xxh64));
    }
    if (std::memcmp(h.magic, model::kLayerFileMagic, sizeof(h.magic)) != 0 || h.layer != l ||
        h.numel != f.numel || h.step != info.step || h.format != info.format) {
      return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": layer file ", f.name,
                                              " has a header that does not match meta.json"));
    }
    const float* w = state->master(l);
    uint16_t* p = state->params(l);
    auto cast = [&](size_t b, size_t e, int) { kernels::CastFp32ToBf16(isa, w + b, p + b, e - b); };
    if (pool != nullptr) {
      pool->ParallelFor(f.numel, 64, cast);
    } else {
      cast(0, f.numel, 0);
    }
    ++restored;
    if (progress && !progress(restored)) {
      return absl::CancelledError(absl::StrCat("the restore of checkpoint ", info.path,
                                               " was cancelled after ", restored, " layers"));
    }
  }
  for (uint32_t l = 0; l < state->num_layers(); ++l) {
    state->BeginLayerWrite(l, info.step);
    state->PublishLayer(l, info.step);
  }
  shm::Atomic(state->control().next_step).store(info.step + 1, std::memory_order_release);
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
