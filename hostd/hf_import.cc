#include "hostd/hf_import.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"

namespace slidedp::hostd {
namespace {

// Elements per read: bounds each thread's buffer for 16-bit sources (512 KiB) and keeps reads
// large enough to run at the page cache's copy speed.
constexpr size_t kImportChunkElements = size_t{1} << 18;
// Thread ranges start at multiples of this many elements (whole pages of the FP32 master).
constexpr size_t kImportAlignElements = 1024;
// Missing tensors named in one error message.
constexpr size_t kMaxNamedMissing = 8;

template <typename Dims>
std::string ShapeText(const Dims& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool SameShape(const slidedp::v1::TensorSpec& spec, const model::SafetensorsTensor& t) {
  if (static_cast<size_t>(spec.shape_size()) != t.shape.size()) return false;
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (spec.shape(static_cast<int>(i)) < 0 ||
        static_cast<uint64_t>(spec.shape(static_cast<int>(i))) != t.shape[i]) {
      return false;
    }
  }
  return true;
}

// Index of the first element of dst[0, n) that is Inf or NaN, or n.
size_t FirstNonFinite(const float* dst, size_t n) {
  // Branch-free scan first (vectorizes); the position is looked up only when there is one.
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) {
    any |= static_cast<uint32_t>((std::bit_cast<uint32_t>(dst[i]) & 0x7f800000u) == 0x7f800000u);
  }
  if (any == 0) return n;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(dst[i])) return i;
  }
  return n;
}

}  // namespace

absl::Status ImportPlan::Check(const std::vector<LayerInfo>& layers) const {
  bool fits = sources.size() == layers.size();
  for (size_t l = 0; fits && l < layers.size(); ++l) {
    fits = sources[l].size() == layers[l].tensors.size();
    for (size_t t = 0; fits && t < layers[l].tensors.size(); ++t) {
      fits = sources[l][t].name == layers[l].tensors[t].name &&
             sources[l][t].tensor->numel == layers[l].tensors[t].numel;
    }
  }
  if (!fits) {
    return absl::InvalidArgumentError(
        absl::StrCat("the import plan of ", checkpoint, " was not made for this model's manifest"));
  }
  return absl::OkStatus();
}

std::string ImportPlan::Describe() const {
  std::string out = absl::StrCat("safetensors ", checkpoint);
  if (num_files > 1) absl::StrAppend(&out, " (", num_files, " files)");
  return out;
}

absl::Status ImportPlan::Fill(uint32_t layer, uint32_t tensor, float* dst, ThreadPool* pool) const {
  return ImportTensor(sources[layer][tensor], dst, pool);
}

absl::StatusOr<ImportPlan> PlanImport(const slidedp::v1::ModelManifest& manifest,
                                      const model::SafetensorsCheckpoint& checkpoint) {
  ImportPlan plan;
  plan.checkpoint = checkpoint.path();
  plan.num_files = checkpoint.num_files();
  std::vector<std::string> missing;
  size_t used = 0;
  for (const auto& layer : manifest.layers()) {
    std::vector<ImportSource>& sources = plan.sources.emplace_back();
    for (const auto& spec : layer.tensors()) {
      const model::SafetensorsCheckpoint::Entry* e = checkpoint.Find(spec.name());
      if (e == nullptr) {
        missing.push_back(spec.name());
        continue;
      }
      if (!SameShape(spec, *e->tensor)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", spec.name(), "' in ", e->file->path(), ": shape ",
                         ShapeText(e->tensor->shape), " does not match the model's ",
                         ShapeText(spec.shape()), " (layer '", layer.name(), "')"));
      }
      sources.push_back(ImportSource{spec.name(), e->file, e->tensor});
      plan.bytes += e->tensor->end - e->tensor->begin;
      ++used;
    }
  }
  if (!missing.empty()) {
    const size_t named = std::min(missing.size(), kMaxNamedMissing);
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", checkpoint.path(), " lacks ", missing.size(), " of the model's tensors: '",
        absl::StrJoin(missing.begin(), missing.begin() + static_cast<std::ptrdiff_t>(named),
                      "', '"),
        "'", missing.size() > named ? ", ..." : ""));
  }
  if (used < checkpoint.tensors().size()) {
    std::unordered_set<const model::SafetensorsTensor*> taken;
    for (const auto& layer : plan.sources) {
      for (const ImportSource& s : layer) taken.insert(s.tensor);
    }
    for (const auto& [name, entry] : checkpoint.tensors()) {
      if (taken.count(entry.tensor) == 0) plan.ignored.push_back(name);
    }
  }
  return plan;
}

absl::Status ImportTensor(const ImportSource& source, float* dst, ThreadPool* pool) {
  const model::SafetensorsTensor& t = *source.tensor;
  const size_t esize = model::SafetensorsDtypeBytes(t.dtype);
  const bool direct = t.dtype == model::SafetensorsDtype::kF32;
  const int threads = pool != nullptr ? pool->size() : 1;
  std::vector<absl::Status> errors(static_cast<size_t>(threads));
  std::vector<uint64_t> first_bad(static_cast<size_t>(threads), UINT64_MAX);
  auto work = [&](size_t begin, size_t end, int thread) {
    std::vector<unsigned char> buffer;
    if (!direct) buffer.resize(std::min(end - begin, kImportChunkElements) * esize);
    for (size_t i = begin; i < end;) {
      const size_t n = std::min(end - i, kImportChunkElements);
      absl::Status s = source.file->Read(
          t, i * esize, direct ? static_cast<void*>(dst + i) : static_cast<void*>(buffer.data()),
          n * esize);
      if (!s.ok()) {
        errors[static_cast<size_t>(thread)] = std::move(s);
        return;
      }
      if (!direct) model::WidenToFp32(t.dtype, buffer.data(), dst + i, n);
      const size_t bad = FirstNonFinite(dst + i, n);
      if (bad < n) {
        first_bad[static_cast<size_t>(thread)] = i + bad;
        return;
      }
      i += n;
    }
  };
  if (pool != nullptr) {
    pool->ParallelFor(t.numel, kImportAlignElements, work);
  } else {
    work(0, t.numel, 0);
  }
  for (absl::Status& s : errors) {
    if (!s.ok()) return Annotate(s, absl::StrCat("tensor '", source.name, "'"));
  }
  const uint64_t bad = *std::min_element(first_bad.begin(), first_bad.end());
  if (bad != UINT64_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", source.name, "' in ", source.file->path(), ": element ", bad, " is ",
        std::isnan(dst[bad]) ? "NaN" : "infinite", "; a checkpoint to train from must be finite"));
  }
  return absl::OkStatus();
}

WeightsInit ResolveWeightsInit(std::string_view init, std::string_view model_dir) {
  if (init == "random") return {WeightsInit::Kind::kRandom, ""};
  if (init == "zeros") return {WeightsInit::Kind::kZeros, ""};
  if (init == "auto") {
    if (!model_dir.empty() &&
        model::SafetensorsCheckpoint::DirectoryHasCheckpoint(std::string(model_dir))) {
      return {WeightsInit::Kind::kSafetensors, std::string(model_dir)};
    }
    return {WeightsInit::Kind::kRandom, ""};
  }
  return {WeightsInit::Kind::kSafetensors, std::string(init)};
}

}  // namespace slidedp::hostd
