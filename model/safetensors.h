// Reading Hugging Face safetensors checkpoints (https://github.com/huggingface/safetensors),
// treating every file as hostile input.
//
// File format: an 8-byte little-endian header length N, N bytes of JSON, then the data section.
// The JSON is an object mapping each tensor name to {"dtype", "shape", "data_offsets": [begin,
// end]} (offsets in bytes from the start of the data section), plus an optional "__metadata__"
// object of string values. What this reader accepts:
//   - N <= kSafetensorsMaxHeaderBytes and 8 + N <= the file size;
//   - the JSON is one object (trailing whitespace allowed), no duplicate keys at any level, no
//     field other than dtype, shape and data_offsets in a tensor entry (each required once);
//   - dtype F32, BF16 or F16 (any other dtype is INVALID_ARGUMENT naming tensor and dtype);
//   - shape a list of at most kSafetensorsMaxDims non-negative integers (rank 0 is a scalar);
//   - data_offsets two integers with begin <= end <= the size of the data section, and
//     end - begin == numel * dtype size, computed without overflow;
//   - no two tensors' byte ranges overlap (gaps between them are allowed).
// Parsing never allocates more than a small multiple of the header size and never recurses on
// the input (a SAX parser with a fixed-depth schema), so a header may come from anywhere: the
// pure parsing functions below are the entry points for a fuzzer.
//
// A checkpoint is a single .safetensors file or a directory holding model.safetensors, or
// model.safetensors.index.json whose weight_map maps tensor names to shard files in the same
// directory (plain file names only: no '/', not "." or ".."). A tensor name must be in exactly
// one shard, and every weight_map entry must be in the shard it names.
//
// Errors: INVALID_ARGUMENT for any malformed content, with a message naming the file, the tensor
// and the field; NOT_FOUND for a missing file or shard; DATA_LOSS when a file is shorter than its
// header says (it changed after it was opened); other errno-based codes for I/O failures.
// Thread safety: the parsing functions are pure; an opened SafetensorsFile or
// SafetensorsCheckpoint is immutable and its Read may be called from any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace slidedp::model {

// The largest JSON header accepted (the reference implementation uses the same limit).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = uint64_t{100} << 20;
// The largest model.safetensors.index.json accepted.
inline constexpr uint64_t kSafetensorsMaxIndexBytes = uint64_t{64} << 20;
// The most dimensions a tensor may have.
inline constexpr size_t kSafetensorsMaxDims = 16;
// The most shard files an index may name.
inline constexpr size_t kSafetensorsMaxShards = 10000;

inline constexpr std::string_view kSafetensorsSingleFile = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndexFile = "model.safetensors.index.json";

enum class SafetensorsDtype { kF32, kBF16, kF16 };

// "F32", "BF16", "F16", and their element sizes (4, 2, 2).
std::string_view SafetensorsDtypeName(SafetensorsDtype dtype);
size_t SafetensorsDtypeBytes(SafetensorsDtype dtype);

struct SafetensorsTensor {
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<uint64_t> shape;
  uint64_t numel = 1;
  uint64_t begin = 0;  // bytes from the start of the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::map<std::string, SafetensorsTensor, std::less<>> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"
  uint64_t data_offset = 0;  // file offset of the data section: 8 + header length
  uint64_t data_bytes = 0;   // size of the data section
};

// Parses the JSON header text for a data section of `data_bytes` bytes (data_offset is left 0).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json,
                                                         uint64_t data_bytes);

// Parses the header of a whole file held in memory: the length prefix, then the JSON, with the
// rest of `file` as the data section.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsFile(std::string_view file);

// Parses model.safetensors.index.json text into its weight_map (tensor name -> shard file name).
// Checks that the document is an object whose "weight_map" is an object of strings, and that
// every shard name is a plain file name. Other top-level keys ("metadata") are ignored.
absl::StatusOr<std::map<std::string, std::string, std::less<>>> ParseSafetensorsIndex(
    std::string_view json);

// The exact widening of an IEEE binary16 value (subnormals, infinities and NaN payloads kept).
float F16ToFp32(uint16_t h);

// Converts `n` elements of `dtype` (little-endian, unaligned allowed) to FP32 exactly.
void WidenToFp32(SafetensorsDtype dtype, const void* src, float* dst, size_t n);

// One opened .safetensors file: the parsed header and a descriptor for reading tensor bytes.
// Bytes are read with pread rather than mapped: a file truncated by another process while it is
// read gives DATA_LOSS here instead of SIGBUS in the daemon.
class SafetensorsFile {
 public:
  // Opens and parses `path` (a regular file). Errors name the path.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // Null when the file has no tensor `name`.
  const SafetensorsTensor* Find(std::string_view name) const;

  // Copies `size_bytes` bytes from offset `offset_bytes` of tensor `t`'s data into `dst`.
  // `t` must come from this file's header. OUT_OF_RANGE when the range is not inside the tensor.
  absl::Status Read(const SafetensorsTensor& t, uint64_t offset_bytes, void* dst,
                    size_t size_bytes) const;

 private:
  SafetensorsFile(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}

  std::string path_;
  UniqueFd fd_;
  SafetensorsHeader header_;
};

// A checkpoint: one file or a directory of shards (see the overview above).
class SafetensorsCheckpoint {
 public:
  struct Entry {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* tensor = nullptr;
  };

  // `path` is a .safetensors file, a model.safetensors.index.json, or a directory holding
  // model.safetensors (preferred, as in transformers) or model.safetensors.index.json.
  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& path);

  // True when `dir` is a directory that holds model.safetensors or
  // model.safetensors.index.json.
  static bool DirectoryHasCheckpoint(const std::string& dir);

  // The file that defines the checkpoint: the .safetensors file or the index.
  const std::string& path() const { return path_; }
  size_t num_files() const { return files_.size(); }
  const std::map<std::string, Entry, std::less<>>& tensors() const { return tensors_; }
  // Null when the checkpoint has no tensor `name`.
  const Entry* Find(std::string_view name) const;

 private:
  SafetensorsCheckpoint() = default;

  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry, std::less<>> tensors_;
};

}  // namespace slidedp::model
