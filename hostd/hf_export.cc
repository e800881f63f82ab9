#include "hostd/hf_export.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "common/unique_fd.h"
#include "common/version.h"
#include "hostd/state.h"
#include "model/manifest.h"
#include "nlohmann/json.hpp"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

// Thread ranges of the cast start on whole cache lines of BF16 output.
constexpr size_t kCastAlignElements = 1024;

uint64_t ElementBytes(ExportDtype dtype) { return dtype == ExportDtype::kFp32 ? 4 : 2; }
const char* SafetensorsName(ExportDtype dtype) {
  return dtype == ExportDtype::kFp32 ? "F32" : "BF16";
}
const char* TorchName(ExportDtype dtype) {
  return dtype == ExportDtype::kFp32 ? "float32" : "bfloat16";
}

absl::Status ErrnoAt(absl::string_view what, const std::string& path, int err = errno) {
  return ErrnoStatus(absl::StrCat(what, " ", path), err);
}

absl::Status FsyncPath(const std::string& path, bool directory) {
  UniqueFd fd(open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC));
  if (!fd.valid()) return ErrnoAt("open", path);
  if (fsync(fd.get()) != 0) return ErrnoAt("fsync", path);
  return absl::OkStatus();
}

// A file being written in the export directory.
class OutFile {
 public:
  static absl::StatusOr<OutFile> Create(std::string path) {
    UniqueFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!fd.valid()) return ErrnoAt("create", path);
    return OutFile(std::move(path), std::move(fd));
  }
  absl::Status Write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = write(fd_.get(), p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoAt("write", path_);
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }
  absl::Status Write(std::string_view s) { return Write(s.data(), s.size()); }
  // fsync, then close (a close error after a failed writeback is reported too).
  absl::Status Finish() {
    if (fsync(fd_.get()) != 0) return ErrnoAt("fsync", path_);
    return fd_.Close(path_);
  }

 private:
  OutFile(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}
  std::string path_;
  UniqueFd fd_;
};

absl::Status WriteTextFile(const std::string& path, std::string_view text) {
  ASSIGN_OR_RETURN(OutFile f, OutFile::Create(path));
  RETURN_IF_ERROR(f.Write(text));
  return f.Finish();
}

// The safetensors header of one shard, padded with spaces to a multiple of 8 bytes (as the
// reference writer does, so the data section starts aligned).
std::string ShardHeader(const TrainingState& state, const ExportShard& shard, ExportDtype dtype) {
  OrderedJson h = OrderedJson::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  const auto& layers = state.model().manifest.layers();
  for (const auto& [l, t] : shard.tensors) {
    const auto& spec = layers.Get(static_cast<int>(l)).tensors(static_cast<int>(t));
    const uint64_t bytes = model::TensorNumel(spec) * ElementBytes(dtype);
    OrderedJson shape = OrderedJson::array();
    for (int64_t d : spec.shape()) shape.push_back(d);
    h[spec.name()] = {{"dtype", SafetensorsName(dtype)},
                      {"shape", std::move(shape)},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// Streams one tensor's elements [0, numel) from the FP32 master.
absl::Status WriteTensor(OutFile& out, const float* master, uint64_t numel,
                         const HfExportOptions& o, std::vector<uint16_t>& buffer,
                         ThreadPool* pool) {
  const uint64_t chunk = kExportBufferBytes / ElementBytes(o.dtype);
  for (uint64_t i = 0; i < numel; i += chunk) {
    if (o.cancelled && o.cancelled()) return absl::CancelledError("the export was cancelled");
    const uint64_t n = std::min(chunk, numel - i);
    if (o.dtype == ExportDtype::kFp32) {
      RETURN_IF_ERROR(out.Write(master + i, n * 4));
      continue;
    }
    const float* src = master + i;
    uint16_t* dst = buffer.data();
    if (pool != nullptr && n >= 2 * kCastAlignElements) {
      pool->ParallelFor(n, kCastAlignElements, [&](size_t b, size_t e, int) {
        kernels::CastFp32ToBf16(o.isa, src + b, dst + b, e - b);
      });
    } else {
      kernels::CastFp32ToBf16(o.isa, src, dst, n);
    }
    RETURN_IF_ERROR(out.Write(dst, n * 2));
  }
  return absl::OkStatus();
}

std::string GenerationConfig(const OrderedJson& config) {
  OrderedJson g = OrderedJson::object();
  g["_from_model_config"] = true;
  bool any = false;
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    auto it = config.find(key);
    if (it != config.end() && !it->is_null()) {
      g[key] = *it;
      any = true;
    }
  }
  return any ? g.dump(2) + "\n" : std::string();
}

// A marker is a few hundred bytes; anything much larger is not one.
constexpr size_t kMaxMarkerBytes = 1 << 20;
// Entries named in one error message; the rest are counted.
constexpr size_t kMaxNamedEntries = 12;

std::string MarkerText(const HfExportOptions& o, uint64_t version,
                       const std::vector<std::string>& files) {
  OrderedJson m = OrderedJson::object();
  m["written_by"] = "hostd";
  m["hostd_version"] = kVersion;
  m["job_id"] = o.job_id;
  m["version"] = version;
  m["dtype"] = o.dtype == ExportDtype::kFp32 ? "fp32" : "bf16";
  m["files"] = files;
  return m.dump(2) + "\n";
}

bool PlainName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name != kExportMarkerFile;
}

// The files a marker lists, or why it is not a marker.
absl::StatusOr<std::vector<std::string>> ReadMarker(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (!fs::is_regular_file(st)) return absl::NotFoundError("not a regular file");
  if (fs::file_size(path, ec) > kMaxMarkerBytes || ec) {
    return absl::InvalidArgumentError("too large");
  }
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  if (!f) return absl::InvalidArgumentError("unreadable");
  const nlohmann::json m = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!m.is_object()) return absl::InvalidArgumentError("not a JSON object");
  auto by = m.find("written_by");
  if (by == m.end() || *by != "hostd") {
    return absl::InvalidArgumentError("written_by is not \"hostd\"");
  }
  auto files = m.find("files");
  if (files == m.end() || !files->is_array()) {
    return absl::InvalidArgumentError("no \"files\" array");
  }
  std::vector<std::string> names;
  for (const auto& f : *files) {
    if (!f.is_string() || !PlainName(f.get<std::string>())) {
      return absl::InvalidArgumentError("\"files\" holds something other than file names");
    }
    names.push_back(f.get<std::string>());
  }
  return names;
}

struct DirContents {
  std::vector<std::string> own;  // the listed regular files present, then the marker
  // Everything else: "name/" for a directory, "name (symlink)", an invalid marker with why.
  std::vector<std::string> foreign;
};

absl::StatusOr<DirContents> InspectDir(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) return ErrnoAt("read the directory", dir, ec.value());
  std::sort(names.begin(), names.end());
  DirContents c;
  const bool has_marker = std::find(names.begin(), names.end(), kExportMarkerFile) != names.end();
  std::vector<std::string> listed;
  std::string marker_problem;
  if (has_marker) {
    absl::StatusOr<std::vector<std::string>> files =
        ReadMarker(absl::StrCat(dir, "/", std::string(kExportMarkerFile)));
    if (files.ok()) {
      listed = *std::move(files);
    } else {
      marker_problem = std::string(files.status().message());
    }
  }
  const bool valid = has_marker && marker_problem.empty();
  for (const std::string& name : names) {
    const fs::file_status st = fs::symlink_status(fs::path(dir) / name, ec);
    if (name == kExportMarkerFile) {
      if (!valid) {
        c.foreign.push_back(
            absl::StrCat(name, " (not a valid export marker: ", marker_problem, ")"));
      }
      continue;
    }
    if (valid && fs::is_regular_file(st) &&
        std::find(listed.begin(), listed.end(), name) != listed.end()) {
      c.own.push_back(name);
    } else if (fs::is_symlink(st)) {
      c.foreign.push_back(absl::StrCat(name, " (symlink)"));
    } else if (fs::is_directory(st)) {
      c.foreign.push_back(absl::StrCat(name, "/"));
    } else {
      c.foreign.push_back(name);
    }
  }
  if (valid) c.own.push_back(std::string(kExportMarkerFile));
  return c;
}

std::string NameEntries(const std::vector<std::string>& entries) {
  if (entries.size() <= kMaxNamedEntries) return absl::StrJoin(entries, ", ");
  return absl::StrCat(absl::StrJoin(entries.begin(), entries.begin() + kMaxNamedEntries, ", "),
                      " and ", entries.size() - kMaxNamedEntries, " more");
}

absl::Status NotHostds(absl::string_view role, const std::string& dir,
                       const std::vector<std::string>& foreign, absl::string_view remedy) {
  return absl::FailedPreconditionError(absl::StrCat(
      "out_dir: ", role, dir, " holds entries hostd did not write: ", NameEntries(foreign),
      "; hostd replaces or removes only an empty directory or an earlier export of its own (",
      std::string(kExportMarkerFile), " and only the files it lists), never anything else; ",
      remedy));
}

// Unlinks `names` inside `dir` (each may be missing), then removes `dir` itself: what another
// process put there meanwhile stays, and so does `dir` (ENOTEMPTY).
absl::Status RemoveOwn(const std::string& dir, const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(dir, "/", name);
    if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoAt("unlink", path);
  }
  if (rmdir(dir.c_str()) != 0) return ErrnoAt("rmdir", dir);
  return absl::OkStatus();
}

// Checks "<out>.tmp": absent, or a directory that is empty or an unfinished export of hostd.
absl::StatusOr<std::optional<DirContents>> CheckLeftoverTmp(const std::string& tmp) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(tmp, ec);
  if (!fs::exists(st)) return std::nullopt;
  if (!fs::is_directory(st)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "out_dir: ", tmp,
        " exists and is not a directory (hostd stages an export there); remove it or choose "
        "another out_dir"));
  }
  ASSIGN_OR_RETURN(DirContents c, InspectDir(tmp));
  if (!c.foreign.empty()) {
    return NotHostds("the staging directory ", tmp, c.foreign,
                     "move them away or choose another out_dir");
  }
  return c;
}

}  // namespace

std::vector<ExportShard> PlanExportShards(const slidedp::v1::ModelManifest& manifest,
                                          ExportDtype dtype, uint64_t max_shard_bytes) {
  if (max_shard_bytes == 0) max_shard_bytes = kDefaultMaxShardBytes;
  std::vector<ExportShard> shards;
  for (int l = 0; l < manifest.layers_size(); ++l) {
    const auto& layer = manifest.layers(l);
    for (int t = 0; t < layer.tensors_size(); ++t) {
      const uint64_t bytes = model::TensorNumel(layer.tensors(t)) * ElementBytes(dtype);
      if (shards.empty() ||
          (!shards.back().tensors.empty() && shards.back().bytes + bytes > max_shard_bytes)) {
        shards.emplace_back();
      }
      shards.back().tensors.emplace_back(static_cast<uint32_t>(l), static_cast<uint32_t>(t));
      shards.back().bytes += bytes;
    }
  }
  if (shards.size() == 1) {
    shards[0].file = "model.safetensors";
  } else {
    for (size_t i = 0; i < shards.size(); ++i) {
      shards[i].file = absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
    }
  }
  return shards;
}

absl::StatusOr<std::string> ExportConfigJson(std::string_view config_json,
                                             const slidedp::v1::ModelManifest& manifest,
                                             ExportDtype dtype) {
  if (config_json.empty()) {
    return absl::InvalidArgumentError(
        "config_json: the job has no HF config (it was created over RPC); pass the model's "
        "config.json text");
  }
  auto described = model::ManifestFromHfConfig(config_json, "config_json");
  if (!described.ok()) return described.status();
  if (model::ManifestHash(described->manifest) != model::ManifestHash(manifest)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config_json: describes a model with manifest hash ",
                     model::ManifestHashHex(model::ManifestHash(described->manifest)),
                     " but the job's is ", model::ManifestHashHex(model::ManifestHash(manifest)),
                     "; pass the config of the job's model"));
  }
  OrderedJson config = OrderedJson::parse(config_json.begin(), config_json.end());
  config["torch_dtype"] = TorchName(dtype);
  if (config.contains("dtype")) config["dtype"] = TorchName(dtype);
  config["tie_word_embeddings"] = manifest.tie_word_embeddings();
  return config.dump(2) + "\n";
}

absl::StatusOr<std::string> CheckExportDestination(const std::string& out_dir, bool overwrite) {
  if (out_dir.empty() || out_dir.front() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "out_dir: expected an absolute path (hostd writes it, in its own working directory), "
        "got '",
        out_dir, "'"));
  }
  fs::path p = fs::path(out_dir).lexically_normal();
  if (p.has_filename() == false) p = p.parent_path();  // a trailing '/'
  if (p == p.root_path()) {
    return absl::InvalidArgumentError("out_dir: expected a directory below '/', got '/'");
  }
  std::error_code ec;
  const fs::path parent = p.parent_path();
  const fs::file_status ps = fs::status(parent, ec);
  if (!fs::exists(ps)) {
    return absl::NotFoundError(
        absl::StrCat("out_dir: the parent directory ", parent.string(), " does not exist"));
  }
  if (!fs::is_directory(ps)) {
    return absl::FailedPreconditionError(
        absl::StrCat("out_dir: ", parent.string(), " is not a directory"));
  }
  const fs::file_status st = fs::symlink_status(p, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) {
      return absl::FailedPreconditionError(
          absl::StrCat("out_dir: ", p.string(), " exists and is not a directory"));
    }
    if (!fs::is_empty(p, ec)) {
      if (!overwrite) {
        return absl::AlreadyExistsError(absl::StrCat(
            "out_dir: ", p.string(),
            " exists and is not empty; choose another directory or pass overwrite (slidedpctl "
            "export --overwrite) to replace an earlier export"));
      }
      ASSIGN_OR_RETURN(const DirContents c, InspectDir(p.string()));
      if (!c.foreign.empty()) {
        return NotHostds("", p.string(), c.foreign, "move them away or choose another directory");
      }
    }
  }
  RETURN_IF_ERROR(CheckLeftoverTmp(p.string() + ".tmp").status());
  return p.string();
}

absl::StatusOr<HfExportResult> ExportHf(const TrainingState& state, const HfExportOptions& o,
                                        ThreadPool* pool) {
  const auto t0 = std::chrono::steady_clock::now();
  const slidedp::v1::ModelManifest& manifest = state.model().manifest;
  ASSIGN_OR_RETURN(const std::string out, CheckExportDestination(o.out_dir, o.overwrite));
  ASSIGN_OR_RETURN(const std::string config_text,
                   ExportConfigJson(o.config_json, manifest, o.dtype));
  const std::string tmp = out + ".tmp";
  // An unfinished export's leftover: only what its marker lists goes.
  ASSIGN_OR_RETURN(std::optional<DirContents> leftover, CheckLeftoverTmp(tmp));
  if (leftover) {
    RETURN_IF_ERROR(Annotate(RemoveOwn(tmp, leftover->own), "remove the unfinished export"));
  }

  const std::vector<ExportShard> shards = PlanExportShards(manifest, o.dtype, o.max_shard_bytes);
  const std::string generation =
      GenerationConfig(OrderedJson::parse(o.config_json.begin(), o.config_json.end()));
  std::vector<std::string> planned;
  for (const ExportShard& shard : shards) planned.push_back(shard.file);
  if (shards.size() > 1) planned.push_back("model.safetensors.index.json");
  planned.push_back("config.json");
  if (!generation.empty()) planned.push_back("generation_config.json");
  const uint64_t version = state.num_layers() > 0 ? state.committed_version(0) : 0;

  if (mkdir(tmp.c_str(), 0755) != 0) return ErrnoAt("mkdir", tmp);
  // What tmp holds that hostd wrote, removed on failure: this export's files until the rename,
  // the old out_dir's after a swap.
  std::vector<std::string> remove_at_tmp = planned;
  remove_at_tmp.push_back(std::string(kExportMarkerFile));
  bool keep = false;
  absl::Cleanup remove_tmp = [&] {
    if (!keep) RemoveOwn(tmp, remove_at_tmp).IgnoreError();
  };
  // The marker first: whatever a crash leaves in tmp, the marker covers it.
  RETURN_IF_ERROR(WriteTextFile(absl::StrCat(tmp, "/", std::string(kExportMarkerFile)),
                                MarkerText(o, version, planned)));

  HfExportResult result;
  result.out_dir = out;
  std::vector<uint16_t> buffer;
  if (o.dtype == ExportDtype::kBf16) buffer.resize(kExportBufferBytes / 2);
  OrderedJson weight_map = OrderedJson::object();
  for (const ExportShard& shard : shards) {
    const std::string path = absl::StrCat(tmp, "/", shard.file);
    ASSIGN_OR_RETURN(OutFile f, OutFile::Create(path));
    const std::string header = ShardHeader(state, shard, o.dtype);
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(header.size() >> (8 * i));
    RETURN_IF_ERROR(f.Write(len, 8));
    RETURN_IF_ERROR(f.Write(header));
    for (const auto& [l, t] : shard.tensors) {
      const TensorRange& range = state.layers()[l].tensors[t];
      RETURN_IF_ERROR(
          Annotate(WriteTensor(f, state.master(l) + range.offset, range.numel, o, buffer, pool),
                   absl::StrCat("tensor '", range.name, "'")));
      weight_map[range.name] = shard.file;
      result.tensors++;
    }
    RETURN_IF_ERROR(f.Finish());
    result.tensor_bytes += shard.bytes;
    result.files.push_back(shard.file);
  }
  if (shards.size() > 1) {
    OrderedJson index = {{"metadata", {{"total_size", result.tensor_bytes}}},
                         {"weight_map", std::move(weight_map)}};
    RETURN_IF_ERROR(
        WriteTextFile(absl::StrCat(tmp, "/model.safetensors.index.json"), index.dump(2) + "\n"));
    result.files.push_back("model.safetensors.index.json");
  }
  RETURN_IF_ERROR(WriteTextFile(absl::StrCat(tmp, "/config.json"), config_text));
  result.files.push_back("config.json");
  if (!generation.empty()) {
    RETURN_IF_ERROR(WriteTextFile(absl::StrCat(tmp, "/generation_config.json"), generation));
    result.files.push_back("generation_config.json");
  }
  RETURN_IF_ERROR(FsyncPath(tmp, /*directory=*/true));

  // rename(2) replaces an empty directory; a non-empty one (overwrite: an earlier export of
  // hostd, checked above) is swapped atomically, then its files, now at tmp, removed.
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(out, ec));
  if (exists && !fs::is_empty(out, ec)) {
    if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) != 0) {
      return ErrnoAt(absl::StrCat("rename ", tmp, " to"), out);
    }
    // Judge what was swapped out again: something may have been put there since the check.
    absl::StatusOr<DirContents> old = InspectDir(tmp);
    if (!old.ok() || !old->foreign.empty()) {
      if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) != 0) {
        keep = true;  // tmp holds the old out_dir: leave it
        return ErrnoAt(absl::StrCat("swap back ", tmp, " and"), out);
      }
      if (!old.ok()) return old.status();
      return NotHostds("", out, old->foreign, "move them away or choose another directory");
    }
    remove_at_tmp = old->own;
  } else {
    if (rename(tmp.c_str(), out.c_str()) != 0) {
      return ErrnoAt(absl::StrCat("rename ", tmp, " to"), out);
    }
    keep = true;
  }
  std::move(remove_tmp).Invoke();
  RETURN_IF_ERROR(FsyncPath(fs::path(out).parent_path().string(), /*directory=*/true));
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace slidedp::hostd
