#include "model/checkpoint_format.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/unique_fd.h"
#include "model/job_spec.h"
#include "nlohmann/json.hpp"

namespace slidedp::model {
namespace fs = std::filesystem;
namespace {

constexpr size_t kIoBytes = size_t{64} << 20;  // per read() call
// Per write() of layer data: small enough to stay in the cache between its hash and its write,
// and to pace checkpoint.max_write_mb_per_s smoothly.
constexpr uint64_t kPieceBytes = uint64_t{8} << 20;
constexpr uint64_t kDirectAlign = 4096;  // O_DIRECT's alignment (covers 512-byte sectors too)
constexpr std::string_view kStepPrefix = "step-";
constexpr std::string_view kTmpSuffix = ".tmp";

absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path,
                      XXH3_state_t* hash) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const size_t want = std::min(n, kIoBytes);
    const ssize_t w = write(fd, p, want);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write " + path);
    }
    if (hash != nullptr) XXH3_64bits_update(hash, p, static_cast<size_t>(w));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status FsyncPath(const std::string& path, bool directory) {
  UniqueFd fd(open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus("open " + path + " for fsync");
  if (fsync(fd.get()) != 0) return ErrnoStatus("fsync " + path);
  return fd.Close(path);
}

// Writes `text` to `path` (truncating) and fsyncs it.
absl::Status WriteSmallFile(const std::string& path, std::string_view text) {
  UniqueFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoStatus("create " + path);
  RETURN_IF_ERROR(WriteAll(fd.get(), text.data(), text.size(), path, nullptr));
  if (fsync(fd.get()) != 0) return ErrnoStatus("fsync " + path);
  return fd.Close(path);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return ss.str();
}

uint64_t Xxh3(std::string_view s) { return XXH3_64bits(s.data(), s.size()); }

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

bool ParseHex(std::string_view s, uint64_t* out) {
  if (s.size() != 16) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, 16);
  return ec == std::errc() && p == s.data() + s.size();
}

bool SafeNameToken(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
}

// An instance or job id as it appears in a directory name: itself when that is safe in a path
// component (and free of the name's '.' separators), else "~" and its XXH3-64.
std::string NameToken(std::string_view s) {
  return SafeNameToken(s) ? std::string(s) : "~" + Hex(Xxh3(s));
}

bool ValidNameToken(std::string_view s) {
  uint64_t h = 0;
  return SafeNameToken(s) || (s.size() == 17 && s[0] == '~' && ParseHex(s.substr(1), &h));
}

std::string ScopeText(const std::string& instance, const std::string& job_id) {
  if (instance.empty()) {
    return absl::StrCat("job '", job_id, "' (format 1-2: no instance)");
  }
  return absl::StrCat("instance '", instance, "' job '", job_id, "'");
}

// "step-<digits>[.<instance>.<job>][.tmp]": the step, whether it is a .tmp directory and the
// "<instance>.<job>" part (empty for the unscoped names of formats 1 and 2); false for other
// names.
bool ParseStepDirName(std::string_view name, uint64_t* step, bool* tmp, std::string* scope) {
  if (!name.starts_with(kStepPrefix)) return false;
  name.remove_prefix(kStepPrefix.size());
  const size_t dot = name.find('.');
  const std::string_view digits = name.substr(0, dot);
  if (digits.empty() || digits.size() > 20) return false;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), *step);
  if (ec != std::errc() || p != digits.data() + digits.size()) return false;
  std::vector<std::string_view> parts;
  for (size_t b = dot; b != std::string_view::npos;) {
    const size_t e = name.find('.', b + 1);
    parts.push_back(name.substr(b + 1, e == std::string_view::npos ? e : e - b - 1));
    b = e;
  }
  *tmp = parts.size() % 2 == 1 && parts.back() == kTmpSuffix.substr(1);
  if (*tmp) parts.pop_back();
  scope->clear();
  if (parts.empty()) return true;
  if (parts.size() != 2 || !ValidNameToken(parts[0]) || !ValidNameToken(parts[1])) return false;
  *scope = std::string(parts[0]) + "." + std::string(parts[1]);
  return true;
}

std::string MarkerText(uint64_t step, uint64_t meta_hash) {
  return absl::StrCat(kCheckpointMagic, " ", kCheckpointFormatVersion, " step ", step,
                      " meta_xxh64 ", Hex(meta_hash), "\n");
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string LayerFileName(uint32_t layer) { return absl::StrFormat("layer-%05u.bin", layer); }

}  // namespace

std::string CheckpointDirName(uint64_t step) { return absl::StrFormat("step-%012u", step); }

std::string CheckpointScopeName(const CheckpointScope& scope) {
  return absl::StrCat(NameToken(scope.instance), ".", NameToken(scope.job_id));
}

std::string CheckpointDirName(uint64_t step, const CheckpointScope& scope) {
  return absl::StrCat(CheckpointDirName(step), ".", CheckpointScopeName(scope));
}

// ---------------------------------------------------------------------------------------------
// Writer

absl::StatusOr<std::unique_ptr<CheckpointDirWriter>> CheckpointDirWriter::Begin(
    const std::string& dir, uint64_t step, const CheckpointScope& scope, Options options) {
  if (scope.instance.empty() || scope.job_id.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint of step ", step, ": the instance and the job id must be set"));
  }
  std::unique_ptr<CheckpointDirWriter> w(new CheckpointDirWriter());
  w->options_ = std::move(options);
  w->dir_ = dir;
  w->step_ = step;
  w->scope_ = scope;
  w->final_ = (fs::path(dir) / CheckpointDirName(step, scope)).string();
  w->tmp_ = w->final_ + std::string(kTmpSuffix);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint.dir: cannot create ", dir, ": ", ec.message()));
    }
  }
  if (fs::exists(w->final_, ec)) {
    if (fs::exists(fs::path(w->final_) / kCheckpointMarker, ec)) {
      return absl::AlreadyExistsError(
          absl::StrCat("checkpoint ", w->final_, " already exists (committed)"));
    }
    // A directory renamed but never marked: an interrupted commit; it is garbage.
    fs::remove_all(w->final_, ec);
  }
  fs::remove_all(w->tmp_, ec);
  if (mkdir(w->tmp_.c_str(), 0755) != 0) return ErrnoStatus("mkdir " + w->tmp_);
  w->Trace("mkdir", w->tmp_);
  return w;
}

CheckpointDirWriter::~CheckpointDirWriter() {
  if (!committed_ && !tmp_.empty()) {
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }
}

void CheckpointDirWriter::Trace(std::string_view op, const std::string& path) const {
  if (options_.trace) options_.trace(op, path);
}

absl::StatusOr<uint64_t> CheckpointDirWriter::WriteLayer(uint32_t layer, uint64_t numel,
                                                         const float* master, const float* m,
                                                         const float* v, const LayerWrite& how) {
  const std::string name = LayerFileName(layer);
  const std::string path = (fs::path(tmp_) / name).string();
  const uint64_t data_bytes = 3 * numel * sizeof(float);
  const uint64_t block = LayerDataOffset(kCheckpointFormatVersion);
  // O_DIRECT needs the buffer, the file offset and the length on block boundaries: the header
  // block is one, a snapshot buffer is page-aligned, and only its last partial block goes
  // through the page cache.
  bool direct = how.direct && m == master + numel && v == m + numel &&
                reinterpret_cast<uintptr_t>(master) % kDirectAlign == 0 &&
                data_bytes >= kDirectAlign;
  constexpr int kFlags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  int raw = open(path.c_str(), kFlags | (direct ? O_DIRECT : 0), 0644);
  if (raw < 0 && direct && errno == EINVAL) {  // a file system without O_DIRECT (tmpfs)
    direct = false;
    raw = open(path.c_str(), kFlags, 0644);
  }
  UniqueFd fd(raw);
  if (!fd.valid()) return ErrnoStatus("create " + path);
  auto set_direct = [&](bool on) -> absl::Status {
    const int fl = fcntl(fd.get(), F_GETFL);
    if (fl < 0 || fcntl(fd.get(), F_SETFL, on ? (fl | O_DIRECT) : (fl & ~O_DIRECT)) != 0) {
      return ErrnoStatus("fcntl O_DIRECT " + path);
    }
    direct = on;
    return absl::OkStatus();
  };
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash_state(XXH3_createState(),
                                                                      &XXH3_freeState);
  if (!hash_state) return absl::ResourceExhaustedError("checkpoint: no memory for a hash state");
  XXH3_state_t* st = hash_state.get();
  XXH3_64bits_reset(st);
  // Hashes the piece (which pulls it into the cache the write then reads from) and writes it
  // whole; a file system that refuses an O_DIRECT write (EINVAL) gets the rest buffered.
  auto put = [&](const void* data, size_t n) -> absl::Status {
    XXH3_64bits_update(st, data, n);
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = write(fd.get(), p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EINVAL && direct) {
          RETURN_IF_ERROR(set_direct(false));
          continue;
        }
        return ErrnoStatus("write " + path);
      }
      if (direct) bytes_direct_ += static_cast<uint64_t>(w);
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  };
  auto put_paced = [&](const void* data, uint64_t n) -> absl::Status {
    const char* p = static_cast<const char*>(data);
    for (uint64_t done = 0; done < n;) {
      const uint64_t k = std::min<uint64_t>(kPieceBytes, n - done);
      RETURN_IF_ERROR(put(p + done, k));
      done += k;
      if (how.after_piece) how.after_piece(k);
    }
    return absl::OkStatus();
  };
  absl::Status s;
  {
    LayerFileHeader h{};
    std::memcpy(h.magic, kLayerFileMagic, sizeof(h.magic));
    h.format = kCheckpointFormatVersion;
    h.layer = layer;
    h.numel = numel;
    h.step = step_;
    std::unique_ptr<char, decltype(&std::free)> head(
        static_cast<char*>(std::aligned_alloc(kDirectAlign, block)), &std::free);
    if (!head) return absl::ResourceExhaustedError("checkpoint: no memory for a header block");
    std::memset(head.get(), 0, block);
    std::memcpy(head.get(), &h, sizeof(h));
    s = put(head.get(), block);
  }
  if (direct) {
    const uint64_t whole = data_bytes / kDirectAlign * kDirectAlign;
    if (s.ok()) s = put_paced(master, whole);
    if (s.ok() && whole < data_bytes) s = set_direct(false);
    if (s.ok()) s = put_paced(reinterpret_cast<const char*>(master) + whole, data_bytes - whole);
  } else {
    for (const float* a : {master, m, v}) {
      if (s.ok()) s = put_paced(a, numel * sizeof(float));
    }
  }
  const uint64_t hash = XXH3_64bits_digest(st);
  RETURN_IF_ERROR(s);
  Trace("write", path);
  if (fsync(fd.get()) != 0) return ErrnoStatus("fsync " + path);
  Trace("fsync", path);
  // The file is on disk and is read again only by a restore: its pages leave the page cache now
  // (a checkpoint is as large as the state) instead of being reclaimed later under pressure.
  posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  RETURN_IF_ERROR(fd.Close(path));
  const uint64_t size = block + data_bytes;
  files_.push_back({name, layer, numel, size, hash});
  bytes_written_ += size;
  return size;
}

absl::StatusOr<CheckpointInfo> CheckpointDirWriter::Commit(CheckpointInfo info) {
  const int num_layers = info.spec.manifest().layers_size();
  std::sort(files_.begin(), files_.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.layer < b.layer; });
  if (files_.size() != static_cast<size_t>(num_layers)) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", tmp_, ": ", files_.size(),
                                                      " layer files written, the manifest has ",
                                                      num_layers, " layers"));
  }
  for (int l = 0; l < num_layers; ++l) {
    if (files_[static_cast<size_t>(l)].layer != static_cast<uint32_t>(l)) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", tmp_, ": layer ", l, " was not written"));
    }
  }
  info.step = step_;
  info.format = kCheckpointFormatVersion;
  info.instance = scope_.instance;
  info.job_id = scope_.job_id;
  info.files = files_;
  if (info.created_unix_ms == 0) info.created_unix_ms = NowUnixMs();

  std::string spec_json;
  google::protobuf::util::JsonPrintOptions jo;
  jo.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(info.spec, &spec_json, jo).ok()) {
    return absl::InternalError("checkpoint: cannot serialize the job spec to JSON");
  }
  nlohmann::json meta;
  meta["magic"] = kCheckpointMagic;
  meta["format_version"] = kCheckpointFormatVersion;
  meta["step"] = info.step;
  meta["instance"] = info.instance;
  meta["job_id"] = info.job_id;
  meta["manifest_hash"] = info.manifest_hash;
  meta["spec"] = nlohmann::json::parse(spec_json);
  meta["lr_schedule"] = {
      {"position_step", info.step}, {"next_step", info.step + 1}, {"next_lr", info.next_lr}};
  meta["model"] = {{"initializer_range", info.initializer_range},
                   {"config_json", info.config_json},
                   {"source", info.model_source},
                   {"weights_source", info.weights_source}};
  meta["hostd_version"] = info.hostd_version;
  meta["created_unix_ms"] = info.created_unix_ms;
  meta["checksum"] = "xxh3_64";
  nlohmann::json files = nlohmann::json::array();
  uint64_t total = 0;
  for (const CheckpointFile& f : files_) {
    files.push_back({{"name", f.name},
                     {"layer", f.layer},
                     {"numel", f.numel},
                     {"size_bytes", f.size_bytes},
                     {"xxh64", Hex(f.xxh64)}});
    total += f.size_bytes;
  }
  meta["files"] = std::move(files);
  const std::string meta_text = meta.dump(1) + "\n";
  const std::string meta_path = (fs::path(tmp_) / kCheckpointMeta).string();
  RETURN_IF_ERROR(WriteSmallFile(meta_path, meta_text));
  Trace("write", meta_path);
  Trace("fsync", meta_path);
  RETURN_IF_ERROR(FsyncPath(tmp_, true));
  Trace("fsync_dir", tmp_);
  if (rename(tmp_.c_str(), final_.c_str()) != 0) {
    return ErrnoStatus(absl::StrCat("rename ", tmp_, " -> ", final_));
  }
  Trace("rename", final_);
  committed_ = true;  // the .tmp name is gone; a failure below leaves an unmarked directory
  RETURN_IF_ERROR(FsyncPath(dir_, true));
  Trace("fsync_dir", dir_);
  const std::string marker_text = MarkerText(step_, Xxh3(meta_text));
  const std::string marker = (fs::path(final_) / kCheckpointMarker).string();
  const std::string marker_tmp = marker + std::string(kTmpSuffix);
  RETURN_IF_ERROR(WriteSmallFile(marker_tmp, marker_text));
  Trace("write", marker_tmp);
  Trace("fsync", marker_tmp);
  if (rename(marker_tmp.c_str(), marker.c_str()) != 0) return ErrnoStatus("rename " + marker);
  Trace("rename", marker);
  RETURN_IF_ERROR(FsyncPath(final_, true));
  Trace("fsync_dir", final_);
  info.path = final_;
  info.total_bytes = total + meta_text.size() + marker_text.size();
  return info;
}

// ---------------------------------------------------------------------------------------------
// Reader

absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& step_dir) {
  std::error_code ec;
  if (!fs::is_directory(step_dir, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", step_dir, ": no such directory"));
  }
  const std::string marker_path = (fs::path(step_dir) / kCheckpointMarker).string();
  if (!fs::exists(marker_path, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", step_dir, ": no ", kCheckpointMarker,
                                            " marker (the write did not complete)"));
  }
  ASSIGN_OR_RETURN(const std::string marker, ReadSmallFile(marker_path));
  const std::string meta_path = (fs::path(step_dir) / kCheckpointMeta).string();
  auto meta_text = ReadSmallFile(meta_path);
  if (!meta_text.ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", step_dir, ": ", kCheckpointMeta, " is missing"));
  }
  // The marker names meta.json's checksum; a marker of another format is not ours.
  std::istringstream ms(marker);
  std::string magic, step_word, hash_word, hash_hex;
  uint32_t format = 0;
  uint64_t marker_step = 0;
  ms >> magic >> format >> step_word >> marker_step >> hash_word >> hash_hex;
  uint64_t want_hash = 0;
  if (!ms || magic != kCheckpointMagic || step_word != "step" || hash_word != "meta_xxh64" ||
      !ParseHex(hash_hex, &want_hash)) {
    return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, ": ", kCheckpointMarker,
                                            " is malformed: '", marker.substr(0, 120), "'"));
  }
  if (format < kOldestCheckpointFormatRead || format > kCheckpointFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", step_dir, ": format version ", format, "; this hostd reads format versions ",
        kOldestCheckpointFormatRead, " to ", kCheckpointFormatVersion));
  }
  const uint64_t have_hash = Xxh3(*meta_text);
  if (have_hash != want_hash) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", step_dir, ": ", kCheckpointMeta, " has xxh64 ", Hex(have_hash),
                     " but ", kCheckpointMarker, " says ", Hex(want_hash), " (corrupted)"));
  }
  CheckpointInfo info;
  info.path = step_dir;
  try {
    const nlohmann::json meta = nlohmann::json::parse(*meta_text);
    if (meta.at("magic").get<std::string>() != kCheckpointMagic) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint ", step_dir, ": meta.json magic is not ", kCheckpointMagic));
    }
    info.format = meta.at("format_version").get<uint32_t>();
    if (info.format != format) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", step_dir, ": format_version ",
                                                     info.format, " but ", kCheckpointMarker,
                                                     " says format ", format));
    }
    info.step = meta.at("step").get<uint64_t>();
    if (info.format >= kFirstScopedCheckpointFormat) {
      info.instance = meta.at("instance").get<std::string>();
      if (info.instance.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint ", step_dir, ": meta.json instance is empty"));
      }
    }
    info.job_id = meta.at("job_id").get<std::string>();
    info.manifest_hash = meta.at("manifest_hash").get<std::string>();
    const auto parsed =
        google::protobuf::util::JsonStringToMessage(meta.at("spec").dump(), &info.spec);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint ", step_dir, ": meta.json spec: ", parsed.ToString()));
    }
    const auto& model = meta.at("model");
    info.initializer_range = model.at("initializer_range").get<double>();
    info.config_json = model.at("config_json").get<std::string>();
    info.model_source = model.at("source").get<std::string>();
    info.weights_source = model.at("weights_source").get<std::string>();
    info.hostd_version = meta.at("hostd_version").get<std::string>();
    info.created_unix_ms = meta.at("created_unix_ms").get<int64_t>();
    info.next_lr = meta.at("lr_schedule").at("next_lr").get<double>();
    for (const auto& f : meta.at("files")) {
      CheckpointFile cf;
      cf.name = f.at("name").get<std::string>();
      cf.layer = f.at("layer").get<uint32_t>();
      cf.numel = f.at("numel").get<uint64_t>();
      cf.size_bytes = f.at("size_bytes").get<uint64_t>();
      if (!ParseHex(f.at("xxh64").get<std::string>(), &cf.xxh64) ||
          cf.name.find('/') != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint ", step_dir, ": meta.json file entry '", cf.name, "' is bad"));
      }
      info.files.push_back(std::move(cf));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", step_dir, ": meta.json: ", e.what()));
  }
  if (info.step != marker_step) {
    return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, ": meta.json says step ",
                                            info.step, ", ", kCheckpointMarker, " says step ",
                                            marker_step));
  }
  uint64_t dir_step = 0;
  bool tmp = false;
  std::string dir_scope;
  if (ParseStepDirName(fs::path(step_dir).lexically_normal().filename().string(), &dir_step, &tmp,
                       &dir_scope)) {
    if (tmp || dir_step != info.step) {
      return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, ": holds step ", info.step,
                                              " but its directory name says ", dir_step));
    }
    // An unscoped name is what formats 1 and 2 wrote (or a renamed directory: meta.json says
    // whose it is); a scoped one must agree with meta.json.
    if (!dir_scope.empty() &&
        (info.instance.empty() || dir_scope != CheckpointScopeName({info.instance, info.job_id}))) {
      return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, ": holds the checkpoint of ",
                                              ScopeText(info.instance, info.job_id),
                                              " but its directory name says ", dir_scope));
    }
  }
  if (info.files.size() != static_cast<size_t>(info.spec.manifest().layers_size())) {
    return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, ": ", info.files.size(),
                                            " layer files listed, the manifest has ",
                                            info.spec.manifest().layers_size(), " layers"));
  }
  uint64_t total = meta_text->size() + marker.size();
  for (size_t i = 0; i < info.files.size(); ++i) {
    const CheckpointFile& f = info.files[i];
    const std::string path = (fs::path(step_dir) / f.name).string();
    const uint64_t want = LayerDataOffset(info.format) + 3 * f.numel * sizeof(float);
    if (f.layer != i || f.size_bytes != want) {
      return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, ": meta.json entry of ",
                                              f.name, " is inconsistent (layer ", f.layer,
                                              ", size ", f.size_bytes, ", expected ", want, ")"));
    }
    const auto size = fs::file_size(path, ec);
    if (ec) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", step_dir, ": layer file ", f.name, " is missing"));
    }
    if (size != f.size_bytes) {
      return absl::DataLossError(absl::StrCat("checkpoint ", step_dir, ": layer file ", f.name,
                                              " has ", size, " bytes, expected ", f.size_bytes,
                                              size < f.size_bytes ? " (truncated)" : ""));
    }
    total += size;
  }
  info.total_bytes = total;
  return info;
}

absl::Status VerifyCheckpointData(const CheckpointInfo& info) {
  std::vector<char> buf(kIoBytes);
  for (const CheckpointFile& f : info.files) {
    const std::string path = (fs::path(info.path) / f.name).string();
    UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return ErrnoStatus("open " + path);
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    uint64_t total = 0;
    LayerFileHeader h{};
    absl::Status s;
    for (;;) {
      const ssize_t r = read(fd.get(), buf.data(), buf.size());
      if (r < 0) {
        if (errno == EINTR) continue;
        s = ErrnoStatus("read " + path);
        break;
      }
      if (r == 0) break;
      if (total < sizeof(h)) {
        const size_t n = std::min<size_t>(sizeof(h) - total, static_cast<size_t>(r));
        std::memcpy(reinterpret_cast<char*>(&h) + total, buf.data(), n);
      }
      XXH3_64bits_update(st, buf.data(), static_cast<size_t>(r));
      total += static_cast<uint64_t>(r);
    }
    const uint64_t hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    RETURN_IF_ERROR(s);
    if (total != f.size_bytes) {
      return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": layer file ", f.name,
                                              " has ", total, " bytes, expected ", f.size_bytes));
    }
    if (hash != f.xxh64) {
      return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": layer file ", f.name,
                                              " has checksum ", Hex(hash), ", meta.json says ",
                                              Hex(f.xxh64), " (corrupted)"));
    }
    if (std::memcmp(h.magic, kLayerFileMagic, sizeof(h.magic)) != 0 || h.layer != f.layer ||
        h.numel != f.numel || h.step != info.step || h.format != info.format) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", info.path, ": layer file ", f.name,
                       " has a header that does not match meta.json (layer/numel/step)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CheckpointListing>> ListCheckpoints(const std::string& dir,
                                                               bool verify_data) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  std::vector<CheckpointListing> out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!entry.is_directory(ec)) continue;
    CheckpointListing l;
    l.name = entry.path().filename().string();
    if (!ParseStepDirName(l.name, &l.step, &l.temporary, &l.scope_name)) continue;
    l.path = entry.path().string();
    for (const auto& f : fs::directory_iterator(entry.path(), ec)) {
      if (f.is_regular_file(ec)) l.size_bytes += f.file_size(ec);
    }
    if (l.temporary) {
      l.reason = "temporary directory (a write in progress or interrupted)";
    } else {
      auto info = ReadCheckpointInfo(l.path);
      absl::Status s = info.status();
      if (s.ok()) {
        l.created_unix_ms = info->created_unix_ms;
        l.instance = info->instance;
        l.job_id = info->job_id;
        if (verify_data) s = VerifyCheckpointData(*info);
      }
      l.valid = s.ok();
      if (!s.ok()) l.reason = std::string(s.message());
    }
    out.push_back(std::move(l));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointListing& a, const CheckpointListing& b) {
    return a.step != b.step ? a.step > b.step : a.temporary < b.temporary;
  });
  return out;
}

absl::StatusOr<CheckpointInfo> FindLatestCheckpointInfo(const std::string& path) {
  // The path comes from a client (CreateJob's resume_path): messages show 1 KiB of it, since
  // they travel back in gRPC's trailers (8 KiB for most clients).
  const std::string shown = ShownText(path, 1024);
  if (path.size() >= PATH_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint path of ", path.size(), " bytes; at most ", PATH_MAX - 1, " ('", shown, "')"));
  }
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint path ", shown,
                     fs::exists(path, ec) ? " is not a directory" : " does not exist"));
  }
  if (fs::exists(fs::path(path) / kCheckpointMarker, ec) ||
      fs::exists(fs::path(path) / kCheckpointMeta, ec)) {
    return ReadCheckpointInfo(path);
  }
  ASSIGN_OR_RETURN(std::vector<CheckpointListing> all, ListCheckpoints(path, false));
  // The jobs whose committed checkpoints these are, each with its newest (the list is newest
  // first); resuming from the directory is unambiguous only with one.
  struct Job {
    const CheckpointListing* newest;
    size_t count;
  };
  std::vector<Job> jobs;
  for (const CheckpointListing& l : all) {
    if (!l.valid) continue;
    auto same = [&l](const Job& j) {
      return j.newest->instance == l.instance && j.newest->job_id == l.job_id;
    };
    auto it = std::find_if(jobs.begin(), jobs.end(), same);
    if (it == jobs.end()) {
      jobs.push_back({&l, 1});
    } else {
      it->count++;
    }
  }
  if (jobs.size() > 1) {
    std::string list;
    for (const Job& j : jobs) {
      absl::StrAppend(&list, "; ", ScopeText(j.newest->instance, j.newest->job_id), ": ", j.count,
                      " checkpoint(s), the newest ", j.newest->path, " (step ", j.newest->step,
                      ")");
    }
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory ", path, " holds the checkpoints of ", jobs.size(),
                     " jobs", list, "; name the step directory to resume from"));
  }
  std::string skipped;
  for (const CheckpointListing& l : all) {
    if (l.valid) return ReadCheckpointInfo(l.path);
    absl::StrAppend(&skipped, "; ", l.name, ": ", l.reason);
  }
  return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", shown,
                                          all.empty() ? " (no step-* directories)" : skipped));
}

absl::StatusOr<CheckpointInfo> FindLatestCheckpointInfo(const std::string& dir,
                                                        const CheckpointScope& scope) {
  ASSIGN_OR_RETURN(std::vector<CheckpointListing> all, ListCheckpoints(dir, false));
  const std::string mine = CheckpointScopeName(scope);
  size_t others = 0;
  size_t unscoped = 0;
  std::string skipped;
  for (const CheckpointListing& l : all) {  // newest first
    if (l.valid) {
      if (l.instance.empty()) {
        ++unscoped;
      } else if (l.instance != scope.instance || l.job_id != scope.job_id) {
        ++others;
      } else {
        return ReadCheckpointInfo(l.path);
      }
    } else if (l.scope_name == mine) {
      absl::StrAppend(&skipped, "; ", l.name, ": ", l.reason);
    }
  }
  std::string passed;
  if (others > 0) absl::StrAppend(&passed, "; ", others, " of other instances or jobs");
  if (unscoped > 0) {
    absl::StrAppend(&passed, "; ", unscoped,
                    " of format 1-2 (no instance: restored only when named, --resume)");
  }
  return absl::NotFoundError(absl::StrCat("no committed checkpoint of ",
                                          ScopeText(scope.instance, scope.job_id), " in ", dir,
                                          skipped, passed));
}

absl::StatusOr<std::vector<std::string>> PruneCheckpoints(const std::string& dir,
                                                          uint32_t keep_last, uint64_t protect_step,
                                                          const CheckpointScope& scope) {
  if (scope.instance.empty()) {
    return absl::InvalidArgumentError("PruneCheckpoints: the scope's instance must be set");
  }
  ASSIGN_OR_RETURN(std::vector<CheckpointListing> all, ListCheckpoints(dir, false));
  const std::string mine = CheckpointScopeName(scope);
  auto own = [&scope](const CheckpointListing& l) {
    return l.valid && l.instance == scope.instance && l.job_id == scope.job_id;
  };
  std::vector<std::string> removed;
  uint64_t newest_valid = 0;
  bool any_valid = false;
  uint32_t kept = 0;
  for (const CheckpointListing& l : all) {  // newest first
    if (!own(l)) continue;
    if (!any_valid) newest_valid = l.step;
    any_valid = true;
    if (keep_last == 0 || kept < keep_last || l.step == protect_step) {
      ++kept;
      continue;
    }
    // The marker goes first (and durably), so a crash in the middle of the removal leaves an
    // unmarked directory that every reader ignores, never a marked one with files missing.
    const std::string marker = (fs::path(l.path) / kCheckpointMarker).string();
    if (unlink(marker.c_str()) != 0) return ErrnoStatus("unlink " + marker);
    RETURN_IF_ERROR(FsyncPath(l.path, true));
    std::error_code ec;
    fs::remove_all(l.path, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("remove ", l.path, ": ", ec.message()));
    }
    removed.push_back(l.path);
  }
  // Our interrupted writes and removals older than our newest commit are garbage; a newer .tmp
  // may be a write in progress. (One hostd per instance: no other writes our scope's names.)
  for (const CheckpointListing& l : all) {
    if (l.valid || !any_valid || l.step >= newest_valid || l.scope_name != mine) continue;
    std::error_code ec;
    fs::remove_all(l.path, ec);
    if (!ec) removed.push_back(l.path);
  }
  return removed;
}

}  // namespace slidedp::model
