// libFuzzer target: the safetensors reader (model/safetensors.h), which treats every checkpoint
// as hostile input.
//
// Byte 0 picks the entry point; the rest is its input:
//   0: ParseSafetensorsFile (a whole file in memory), then the same bytes written to a file and
//      opened with SafetensorsFile::Open, every tensor read back through Read and widened;
//   1: ParseSafetensorsIndex (model.safetensors.index.json text);
//   2: a sharded checkpoint directory: the rest is split at the first "\n--SHARD--\n" into the
//      index JSON and one shard file named "a.safetensors", opened with
//      SafetensorsCheckpoint::Open on the directory;
//   3: ParseSafetensorsHeader (JSON text) with a data section size from the next 8 bytes.
// Oracles besides the sanitizers: every accepted header satisfies the reader's contract (ranges
// inside the data section, end - begin == numel * dtype size, no overlaps); the in-memory and
// the file parsers agree; a read of an accepted tensor succeeds and matches the file's bytes.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "model/safetensors.h"

namespace slidedp::hostd {
namespace {

#define FUZZ_CHECK(cond)                                                                          \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      fprintf(stderr, "fuzz_safetensors: check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      abort();                                                                                    \
    }                                                                                             \
  } while (0)

const std::string& Dir() {
  static const std::string dir = [] {
    std::string d =
        (std::filesystem::temp_directory_path() / ("slidedp-fuzz-st-" + std::to_string(getpid())))
            .string();
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

void WriteFile(const std::string& path, std::string_view bytes) {
  FILE* f = fopen(path.c_str(), "wb");
  FUZZ_CHECK(f != nullptr);
  if (!bytes.empty()) FUZZ_CHECK(fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size());
  FUZZ_CHECK(fclose(f) == 0);
}

// The reader's contract for an accepted header.
void CheckHeader(const model::SafetensorsHeader& h) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, t] : h.tensors) {
    FUZZ_CHECK(t.shape.size() <= model::kSafetensorsMaxDims);
    uint64_t numel = 1;
    for (uint64_t d : t.shape) {
      FUZZ_CHECK(d == 0 || numel <= UINT64_MAX / d);
      numel *= d;
    }
    FUZZ_CHECK(numel == t.numel);
    FUZZ_CHECK(t.begin <= t.end && t.end <= h.data_bytes);
    FUZZ_CHECK(numel <= UINT64_MAX / model::SafetensorsDtypeBytes(t.dtype));
    FUZZ_CHECK(t.end - t.begin == numel * model::SafetensorsDtypeBytes(t.dtype));
    if (t.end > t.begin) ranges.emplace_back(t.begin, t.end);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) FUZZ_CHECK(ranges[i - 1].second <= ranges[i].first);
}

void FuzzFile(std::string_view bytes) {
  absl::StatusOr<model::SafetensorsHeader> parsed = slidedp::model::ParseSafetensorsFile(bytes);
  if (parsed.ok()) {
    CheckHeader(*parsed);
    FUZZ_CHECK(parsed->data_offset + parsed->data_bytes == bytes.size());
  }
  const std::string path = Dir() + "/one.safetensors";
  WriteFile(path, bytes);
  absl::StatusOr<std::unique_ptr<model::SafetensorsFile>> file = model::SafetensorsFile::Open(path);
  FUZZ_CHECK(file.ok() == parsed.ok());
  if (!file.ok()) return;
  const model::SafetensorsHeader& h = (*file)->header();
  FUZZ_CHECK(h.tensors.size() == parsed->tensors.size());
  std::vector<uint8_t> buf;
  std::vector<float> widened;
  for (const auto& [name, t] : h.tensors) {
    FUZZ_CHECK((*file)->Find(name) == &t);
    const uint64_t n = t.end - t.begin;
    if (n > (1u << 20)) continue;
    buf.assign(n, 0);
    FUZZ_CHECK((*file)->Read(t, 0, buf.data(), n).ok());
    FUZZ_CHECK(n == 0 || std::memcmp(buf.data(), bytes.data() + h.data_offset + t.begin, n) == 0);
    // One byte past the tensor is OUT_OF_RANGE, never a read of the next tensor.
    FUZZ_CHECK((*file)->Read(t, n, buf.data(), 1).code() == absl::StatusCode::kOutOfRange);
    widened.resize(t.numel);
    model::WidenToFp32(t.dtype, buf.data(), widened.data(), t.numel);
  }
}

void FuzzCheckpoint(std::string_view rest) {
  constexpr std::string_view kSep = "\n--SHARD--\n";
  const size_t cut = rest.find(kSep);
  const std::string_view index = rest.substr(0, cut);
  const std::string_view shard =
      cut == std::string_view::npos ? std::string_view() : rest.substr(cut + kSep.size());
  const std::string dir = Dir() + "/ckpt";
  std::filesystem::create_directories(dir);
  std::filesystem::remove(dir + "/model.safetensors");
  WriteFile(dir + "/model.safetensors.index.json", index);
  WriteFile(dir + "/a.safetensors", shard);
  absl::StatusOr<std::unique_ptr<model::SafetensorsCheckpoint>> ckpt =
      model::SafetensorsCheckpoint::Open(dir);
  if (!ckpt.ok()) return;
  absl::StatusOr<std::map<std::string, std::string, std::less<>>> map =
      slidedp::model::ParseSafetensorsIndex(index);
  FUZZ_CHECK(map.ok());
  // Every weight_map entry resolves to its tensor in the shard it names (shards may hold more).
  FUZZ_CHECK((*ckpt)->tensors().size() >= map->size());
  for (const auto& [name, shard] : *map) {
    const model::SafetensorsCheckpoint::Entry* entry = (*ckpt)->Find(name);
    FUZZ_CHECK(entry != nullptr && entry->file != nullptr && entry->tensor != nullptr);
    FUZZ_CHECK(std::filesystem::path(entry->file->path()).filename() == shard);
    FUZZ_CHECK(entry->file->Find(name) == entry->tensor);
  }
  for (const auto& [name, entry] : (*ckpt)->tensors()) CheckHeader(entry.file->header());
}

}  // namespace
}  // namespace slidedp::hostd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slidedp::hostd;
  if (size < 1) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      FuzzFile(rest);
      break;
    case 1: {
      auto map = slidedp::model::ParseSafetensorsIndex(rest);
      if (map.ok()) {
        for (const auto& [name, file] : *map) {
          FUZZ_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." &&
                     file != "..");
        }
      }
      break;
    }
    case 2:
      FuzzCheckpoint(rest);
      break;
    case 3: {
      if (rest.size() < 8) return 0;
      uint64_t data_bytes;
      std::memcpy(&data_bytes, rest.data(), 8);
      auto h = slidedp::model::ParseSafetensorsHeader(rest.substr(8), data_bytes);
      if (h.ok()) {
        FUZZ_CHECK(h->data_bytes == data_bytes);
        CheckHeader(*h);
      }
      break;
    }
  }
  return 0;
}
