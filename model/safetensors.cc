#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/unique_fd.h"
#include "nlohmann/json.hpp"

namespace slidedp::model {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; the F32 path copies it as is");

using Json = nlohmann::json;

// Debian's abseil builds absl::string_view as its own class, not an alias of std::string_view.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A name taken from a file, quoted and escaped for a message (bounded: a hostile name may be
// megabytes long or hold control characters).
std::string Quote(std::string_view s) {
  constexpr size_t kMaxChars = 200;
  std::string out =
      absl::StrCat("'", absl::CHexEscape(Av(s.substr(0, std::min(s.size(), kMaxChars)))), "'");
  if (s.size() > kMaxChars) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

// The parser's message echoes the offending token, which a hostile file can make huge.
std::string Bounded(std::string_view msg) {
  constexpr size_t kMaxChars = 300;
  if (msg.size() <= kMaxChars) return std::string(msg);
  return absl::StrCat(Av(msg.substr(0, kMaxChars)), "... (", msg.size(), " bytes)");
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status Invalid(std::string_view msg) { return absl::InvalidArgumentError(Av(msg)); }

uint64_t LoadLe64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

absl::Status CheckHeaderLength(uint64_t header_bytes, uint64_t file_bytes) {
  if (header_bytes > kSafetensorsMaxHeaderBytes) {
    return Invalid(absl::StrCat("header length ", header_bytes, " exceeds the limit of ",
                                kSafetensorsMaxHeaderBytes, " bytes"));
  }
  if (header_bytes > file_bytes - 8) {
    return Invalid(absl::StrCat("header length ", header_bytes, " exceeds the file (", file_bytes,
                                " bytes: 8-byte length prefix + ", file_bytes - 8, ")"));
  }
  return absl::OkStatus();
}

// A tensor entry as it appears in the header, before its fields are checked.
struct RawEntry {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> offsets;
  bool has_dtype = false;
  bool has_shape = false;
  bool has_offsets = false;
};

// What both SAX handlers share: the first error wins and stops the parse.
class SaxErrors {
 public:
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) {
    return Fail(absl::StrCat("malformed JSON at byte ", position, ": ", Bounded(e.what())));
  }
  bool Fail(std::string msg) {
    if (error_.empty()) error_ = std::move(msg);
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

// SAX handler for the header schema. The schema has a fixed depth (root object -> entry object ->
// shape/offsets array), so anything deeper is rejected at its first token and nothing is ever
// stored beyond kSafetensorsMaxDims numbers per tensor: memory stays proportional to the header.
class HeaderSax : public SaxErrors {
 public:
  bool null() { return Unexpected("null"); }
  bool boolean(bool) { return Unexpected("a boolean"); }
  bool number_integer(Json::number_integer_t v) {
    // nlohmann reports only negative integers here; non-negative ones go to number_unsigned.
    if (InArray()) {
      return Fail(absl::StrCat(FieldWhere(), ": ", v, " is negative; expected integers >= 0"));
    }
    return Unexpected("a number");
  }
  bool number_unsigned(Json::number_unsigned_t v) {
    // A header that is a bare number or string: no frame yet (Top() needs one).
    if (stack_.empty()) return Unexpected("a number");
    if (Top() == Frame::kShape) {
      if (entry_.shape.size() >= kSafetensorsMaxDims) {
        return Fail(absl::StrCat(FieldWhere(), ": more than ", kSafetensorsMaxDims, " dimensions"));
      }
      entry_.shape.push_back(v);
      return true;
    }
    if (Top() == Frame::kOffsets) {
      if (entry_.offsets.size() >= 2) {
        return Fail(absl::StrCat(FieldWhere(), ": more than 2 values; expected [begin, end]"));
      }
      entry_.offsets.push_back(v);
      return true;
    }
    return Unexpected("a number");
  }
  bool number_float(Json::number_float_t, const Json::string_t& text) {
    if (InArray()) {
      return Fail(absl::StrCat(FieldWhere(), ": ", Quote(text), " is not an integer in 0..2^64-1"));
    }
    return Unexpected("a number");
  }
  bool string(Json::string_t& s) {
    if (stack_.empty()) return Unexpected("a string");
    if (Top() == Frame::kEntry && field_ == Field::kDtype) {
      entry_.dtype = std::move(s);
      field_ = Field::kNone;
      return true;
    }
    if (Top() == Frame::kMetadata) {
      metadata_.emplace(std::move(key_), std::move(s));
      return true;
    }
    return Unexpected("a string");
  }
  bool binary(Json::binary_t&) { return Unexpected("binary data"); }

  bool start_object(std::size_t) {
    if (stack_.empty()) {
      stack_.push_back(Frame::kRoot);
      return true;
    }
    if (Top() == Frame::kRoot) {
      if (key_ == "__metadata__") {
        stack_.push_back(Frame::kMetadata);
      } else {
        entry_ = RawEntry{};
        entry_.name = std::move(key_);
        stack_.push_back(Frame::kEntry);
      }
      return true;
    }
    return Unexpected("an object");
  }
  bool key(Json::string_t& k) {
    switch (Top()) {
      case Frame::kRoot:
        if (!root_keys_.insert(k).second) return Fail(absl::StrCat("duplicate key ", Quote(k)));
        key_ = std::move(k);
        return true;
      case Frame::kMetadata:
        if (metadata_.count(k) != 0) {
          return Fail(absl::StrCat("__metadata__: duplicate key ", Quote(k)));
        }
        key_ = std::move(k);
        return true;
      case Frame::kEntry: {
        bool* seen = nullptr;
        if (k == "dtype") {
          field_ = Field::kDtype;
          seen = &entry_.has_dtype;
        } else if (k == "shape") {
          field_ = Field::kShape;
          seen = &entry_.has_shape;
        } else if (k == "data_offsets") {
          field_ = Field::kOffsets;
          seen = &entry_.has_offsets;
        } else {
          return Fail(absl::StrCat("tensor ", Quote(entry_.name), ": unknown field ", Quote(k),
                                   "; expected dtype, shape and data_offsets"));
        }
        if (*seen) {
          return Fail(absl::StrCat("tensor ", Quote(entry_.name), ": duplicate field ", k));
        }
        *seen = true;
        return true;
      }
      case Frame::kShape:
      case Frame::kOffsets:
        break;
    }
    return Fail("unexpected key");  // unreachable: arrays have no keys
  }
  bool end_object() {
    const Frame f = Top();
    stack_.pop_back();
    if (f == Frame::kEntry) {
      for (const auto& [has, name] :
           {std::pair{entry_.has_dtype, "dtype"}, std::pair{entry_.has_shape, "shape"},
            std::pair{entry_.has_offsets, "data_offsets"}}) {
        if (!has) return Fail(absl::StrCat("tensor ", Quote(entry_.name), ": no ", name));
      }
      entries_.push_back(std::move(entry_));
    }
    return true;
  }
  bool start_array(std::size_t) {
    if (!stack_.empty() && Top() == Frame::kEntry) {
      if (field_ == Field::kShape) {
        stack_.push_back(Frame::kShape);
        return true;
      }
      if (field_ == Field::kOffsets) {
        stack_.push_back(Frame::kOffsets);
        return true;
      }
    }
    return Unexpected("an array");
  }
  bool end_array() {
    const Frame f = Top();
    stack_.pop_back();
    if (f == Frame::kOffsets && entry_.offsets.size() != 2) {
      return Fail(absl::StrCat(FieldWhere(), ": ", entry_.offsets.size(),
                               " values; expected [begin, end]"));
    }
    field_ = Field::kNone;
    return true;
  }
  std::vector<RawEntry>& entries() { return entries_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }

 private:
  enum class Frame { kRoot, kEntry, kMetadata, kShape, kOffsets };
  enum class Field { kNone, kDtype, kShape, kOffsets };

  Frame Top() const { return stack_.back(); }
  bool InArray() const {
    return !stack_.empty() && (Top() == Frame::kShape || Top() == Frame::kOffsets);
  }
  std::string FieldWhere() const {
    const char* field = field_ == Field::kDtype   ? "dtype"
                        : field_ == Field::kShape ? "shape"
                                                  : "data_offsets";
    return absl::StrCat("tensor ", Quote(entry_.name), ": ", field);
  }
  // A value of the wrong type where the schema expects something else.
  bool Unexpected(std::string_view got) {
    if (stack_.empty()) {
      return Fail(absl::StrCat("the header is ", Av(got), "; expected a JSON object"));
    }
    switch (Top()) {
      case Frame::kRoot:
        if (key_ == "__metadata__") {
          return Fail(absl::StrCat("__metadata__: expected an object of strings, got ", Av(got)));
        }
        return Fail(absl::StrCat("tensor ", Quote(key_),
                                 ": expected an object {dtype, shape, data_offsets}, got ",
                                 Av(got)));
      case Frame::kMetadata:
        return Fail(absl::StrCat("__metadata__: value of ", Quote(key_),
                                 ": expected a string, got ", Av(got)));
      case Frame::kEntry:
        return Fail(absl::StrCat(FieldWhere(), ": expected ",
                                 field_ == Field::kDtype ? "a string" : "a list of integers",
                                 ", got ", Av(got)));
      case Frame::kShape:
      case Frame::kOffsets:
        return Fail(absl::StrCat(FieldWhere(), ": expected integers >= 0, got ", Av(got)));
    }
    return Fail("unexpected value");
  }

  std::vector<Frame> stack_;
  Field field_ = Field::kNone;
  std::string key_;  // the last key of the root object or of __metadata__
  std::set<std::string> root_keys_;
  RawEntry entry_;
  std::vector<RawEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// SAX handler for model.safetensors.index.json: keeps "weight_map" (an object of strings) and
// skips every other value without storing it, however deep.
class IndexSax : public SaxErrors {
 public:
  bool null() { return Scalar("null"); }
  bool boolean(bool) { return Scalar("a boolean"); }
  bool number_integer(Json::number_integer_t) { return Scalar("a number"); }
  bool number_unsigned(Json::number_unsigned_t) { return Scalar("a number"); }
  bool number_float(Json::number_float_t, const Json::string_t&) { return Scalar("a number"); }
  bool binary(Json::binary_t&) { return Scalar("binary data"); }
  bool string(Json::string_t& s) {
    if (skip_depth_ == 0 && state_ == State::kWeightMap) {
      weight_map_.emplace(std::move(key_), std::move(s));
      return true;
    }
    return Scalar("a string");
  }
  bool start_object(std::size_t) { return Container("an object", /*is_object=*/true); }
  bool start_array(std::size_t) { return Container("an array", /*is_object=*/false); }
  bool end_object() { return End(); }
  bool end_array() { return End(); }
  bool key(Json::string_t& k) {
    if (skip_depth_ > 0) return true;
    if (state_ == State::kRoot) {
      if (!root_keys_.insert(k).second) return Fail(absl::StrCat("duplicate key ", Quote(k)));
    } else if (weight_map_.count(k) != 0) {
      return Fail(absl::StrCat("weight_map: duplicate tensor ", Quote(k)));
    }
    key_ = std::move(k);
    return true;
  }
  bool saw_weight_map() const { return saw_weight_map_; }
  std::map<std::string, std::string, std::less<>>& weight_map() { return weight_map_; }

 private:
  enum class State { kStart, kRoot, kWeightMap };

  bool Scalar(std::string_view got) {
    if (skip_depth_ > 0) return true;
    switch (state_) {
      case State::kStart:
        return Fail(absl::StrCat("the index is ", Av(got), "; expected a JSON object"));
      case State::kRoot:
        if (key_ == "weight_map") {
          return Fail(absl::StrCat("weight_map: expected an object, got ", Av(got)));
        }
        return true;
      case State::kWeightMap:
        return Fail(absl::StrCat("weight_map: value of ", Quote(key_),
                                 ": expected a shard file name (a string), got ", Av(got)));
    }
    return true;
  }
  bool Container(std::string_view what, bool is_object) {
    if (skip_depth_ > 0) {
      ++skip_depth_;
      return true;
    }
    switch (state_) {
      case State::kStart:
        if (!is_object) return Scalar(what);
        state_ = State::kRoot;
        return true;
      case State::kRoot:
        if (key_ == "weight_map") {
          if (!is_object) return Scalar(what);
          state_ = State::kWeightMap;
          saw_weight_map_ = true;
          return true;
        }
        skip_depth_ = 1;
        return true;
      case State::kWeightMap:
        return Scalar(what);
    }
    return true;
  }
  bool End() {
    if (skip_depth_ > 0) {
      --skip_depth_;
    } else if (state_ == State::kWeightMap) {
      state_ = State::kRoot;
    }
    return true;
  }

  State state_ = State::kStart;
  int64_t skip_depth_ = 0;
  bool saw_weight_map_ = false;
  std::string key_;
  std::set<std::string> root_keys_;
  std::map<std::string, std::string, std::less<>> weight_map_;
};

template <typename Sax>
bool RunSax(std::string_view text, Sax* sax) {
  try {
    return Json::sax_parse(text.begin(), text.end(), sax, Json::input_format_t::json,
                           /*strict=*/true);
  } catch (const std::exception& e) {
    // The handlers never throw; this is for allocation failures and library surprises.
    return sax->Fail(absl::StrCat("cannot parse: ", e.what()));
  }
}

absl::StatusOr<SafetensorsDtype> ParseDtype(std::string_view name, std::string_view tensor) {
  if (name == "F32") return SafetensorsDtype::kF32;
  if (name == "BF16") return SafetensorsDtype::kBF16;
  if (name == "F16") return SafetensorsDtype::kF16;
  return Invalid(absl::StrCat("tensor ", Quote(tensor), ": dtype ", Quote(name),
                              " is not supported; expected F32, BF16 or F16"));
}

// Reads exactly `n` bytes at `offset`; DATA_LOSS if the file ends first.
absl::Status PreadAll(int fd, void* dst, size_t n, uint64_t offset) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StrCat("read of ", n, " bytes at offset ", offset));
    }
    if (got == 0) {
      return absl::DataLossError(absl::StrCat(
          "file ends at byte ", offset, " but ", n,
          " more bytes were expected there (was the file changed after it was opened?)"));
    }
    p += got;
    n -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

// Opens `path` read-only as a regular file. O_NONBLOCK keeps open() from blocking on a FIFO; it
// has no effect on reads of a regular file.
absl::StatusOr<UniqueFd> OpenRegularFile(const std::string& path, uint64_t* size) {
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return ErrnoStatus(absl::StrCat(path, ": open"), err);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) {
    const int err = errno;
    return ErrnoStatus(absl::StrCat(path, ": fstat"), err);
  }
  if (!S_ISREG(st.st_mode)) return Invalid(absl::StrCat(path, ": not a regular file"));
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

bool IsPlainFileName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find_first_of(std::string_view("/\0", 2)) == std::string_view::npos;
}

}  // namespace

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kBF16:
      return "BF16";
    case SafetensorsDtype::kF16:
      return "F16";
  }
  return "?";
}

size_t SafetensorsDtypeBytes(SafetensorsDtype dtype) {
  return dtype == SafetensorsDtype::kF32 ? 4 : 2;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view text,
                                                         uint64_t data_bytes) {
  HeaderSax sax;
  if (!RunSax(text, &sax)) return Invalid(sax.error());

  SafetensorsHeader header;
  header.data_bytes = data_bytes;
  header.metadata = std::move(sax.metadata());
  for (RawEntry& e : sax.entries()) {
    SafetensorsTensor t;
    ASSIGN_OR_RETURN(t.dtype, ParseDtype(e.dtype, e.name));
    t.shape = std::move(e.shape);
    const auto where = [&e] { return absl::StrCat("tensor ", Quote(e.name), ": "); };
    uint64_t numel = 1;
    uint64_t bytes = 0;
    for (uint64_t d : t.shape) {
      if (__builtin_mul_overflow(numel, d, &numel)) numel = UINT64_MAX;
    }
    if (numel == UINT64_MAX ||
        __builtin_mul_overflow(numel, SafetensorsDtypeBytes(t.dtype), &bytes)) {
      return Invalid(absl::StrCat(where(), "shape ", ShapeText(t.shape), " of ",
                                  Av(SafetensorsDtypeName(t.dtype)),
                                  " overflows 64-bit byte counts"));
    }
    t.numel = numel;
    t.begin = e.offsets[0];
    t.end = e.offsets[1];
    const std::string offsets = absl::StrCat("data_offsets [", t.begin, ", ", t.end, "]");
    if (t.begin > t.end) return Invalid(absl::StrCat(where(), offsets, ": begin > end"));
    if (t.end > data_bytes) {
      return Invalid(
          absl::StrCat(where(), offsets, " end beyond the data section (", data_bytes, " bytes)"));
    }
    if (t.end - t.begin != bytes) {
      return Invalid(absl::StrCat(where(), offsets, " hold ", t.end - t.begin, " bytes but ",
                                  Av(SafetensorsDtypeName(t.dtype)), " ", ShapeText(t.shape),
                                  " needs ", bytes));
    }
    header.tensors.emplace(std::move(e.name), std::move(t));
  }

  // Overlap: sort the non-empty ranges by begin; each must start at or after the furthest end
  // seen so far.
  std::vector<std::pair<const std::string*, const SafetensorsTensor*>> ranges;
  for (const auto& [name, t] : header.tensors) {
    if (t.end > t.begin) ranges.emplace_back(&name, &t);
  }
  std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
  });
  for (size_t i = 1, far = 0; i < ranges.size(); ++i) {
    if (ranges[i].second->begin < ranges[far].second->end) {
      return Invalid(absl::StrCat("tensors ", Quote(*ranges[far].first), " [",
                                  ranges[far].second->begin, ", ", ranges[far].second->end,
                                  ") and ", Quote(*ranges[i].first), " [", ranges[i].second->begin,
                                  ", ", ranges[i].second->end, ") overlap"));
    }
    if (ranges[i].second->end > ranges[far].second->end) far = i;
  }
  return header;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsFile(std::string_view file) {
  if (file.size() < 8) {
    return Invalid(absl::StrCat("file is ", file.size(),
                                " bytes; a safetensors file starts with an 8-byte header length"));
  }
  const uint64_t n = LoadLe64(reinterpret_cast<const unsigned char*>(file.data()));
  RETURN_IF_ERROR(CheckHeaderLength(n, file.size()));
  ASSIGN_OR_RETURN(SafetensorsHeader h,
                   ParseSafetensorsHeader(file.substr(8, n), file.size() - 8 - n));
  h.data_offset = 8 + n;
  return h;
}

absl::StatusOr<std::map<std::string, std::string, std::less<>>> ParseSafetensorsIndex(
    std::string_view text) {
  IndexSax sax;
  if (!RunSax(text, &sax)) return Invalid(sax.error());
  if (!sax.saw_weight_map()) return Invalid("no \"weight_map\" object");
  for (const auto& [tensor, shard] : sax.weight_map()) {
    if (!IsPlainFileName(shard)) {
      return Invalid(absl::StrCat("weight_map: tensor ", Quote(tensor), " maps to ", Quote(shard),
                                  ", which is not a plain file name (no '/', not . or ..)"));
    }
  }
  return std::move(sax.weight_map());
}

float F16ToFp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in FP32.
    const float f = static_cast<float>(mant) * 0x1p-24f;
    return sign != 0 ? -f : f;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

void WidenToFp32(SafetensorsDtype dtype, const void* src, float* dst, size_t n) {
  // An empty tensor may come with null buffers (an empty vector's data()): memcpy must not see
  // them.
  if (n == 0) return;
  const auto* p = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case SafetensorsDtype::kF32:
      std::memcpy(dst, p, n * sizeof(float));
      return;
    case SafetensorsDtype::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        dst[i] = std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
      }
      return;
    case SafetensorsDtype::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        dst[i] = F16ToFp32(b);
      }
      return;
  }
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  uint64_t size = 0;
  ASSIGN_OR_RETURN(UniqueFd owned_fd, OpenRegularFile(path, &size));
  const int fd = owned_fd.get();
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile(path, std::move(owned_fd)));
  if (size < 8) {
    return Invalid(absl::StrCat(path, ": ", size,
                                " bytes; a safetensors file starts with an 8-byte header length"));
  }
  unsigned char prefix[8];
  RETURN_IF_ERROR(Annotate(PreadAll(fd, prefix, 8, 0), path));
  const uint64_t n = LoadLe64(prefix);
  RETURN_IF_ERROR(Annotate(CheckHeaderLength(n, size), path));
  std::string text(n, '\0');
  RETURN_IF_ERROR(Annotate(PreadAll(fd, text.data(), n, 8), path));
  auto header = ParseSafetensorsHeader(text, size - 8 - n);
  if (!header.ok()) return Annotate(header.status(), path);
  f->header_ = std::move(*header);
  f->header_.data_offset = 8 + n;
  return f;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  const auto it = header_.tensors.find(name);
  return it == header_.tensors.end() ? nullptr : &it->second;
}

absl::Status SafetensorsFile::Read(const SafetensorsTensor& t, uint64_t offset_bytes, void* dst,
                                   size_t size_bytes) const {
  const uint64_t tensor_bytes = t.end - t.begin;
  if (offset_bytes > tensor_bytes || size_bytes > tensor_bytes - offset_bytes) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": read of ", size_bytes, " bytes at offset ",
                                              offset_bytes, " of a tensor of ", tensor_bytes,
                                              " bytes"));
  }
  return Annotate(
      PreadAll(fd_.get(), dst, size_bytes, header_.data_offset + t.begin + offset_bytes), path_);
}

// ---------------------------------------------------------------------------------------------

bool SafetensorsCheckpoint::DirectoryHasCheckpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  return fs::exists(fs::path(dir) / kSafetensorsSingleFile, ec) ||
         fs::exists(fs::path(dir) / kSafetensorsIndexFile, ec);
}

const SafetensorsCheckpoint::Entry* SafetensorsCheckpoint::Find(std::string_view name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::Open(
    const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(path), ec).lexically_normal();
  if (ec) p = fs::path(path);
  const fs::file_status st = fs::status(p, ec);
  if (ec || !fs::exists(st)) {
    return absl::NotFoundError(
        absl::StrCat(p.string(),
                     ": no such file or directory; expected a .safetensors file or a directory "
                     "holding model.safetensors or model.safetensors.index.json"));
  }
  bool sharded = false;
  if (fs::is_directory(st)) {
    if (fs::exists(p / kSafetensorsSingleFile, ec)) {
      p /= kSafetensorsSingleFile;
    } else if (fs::exists(p / kSafetensorsIndexFile, ec)) {
      p /= kSafetensorsIndexFile;
      sharded = true;
    } else {
      return absl::NotFoundError(absl::StrCat(p.string(), ": holds neither ",
                                              Av(kSafetensorsSingleFile), " nor ",
                                              Av(kSafetensorsIndexFile)));
    }
  } else {
    sharded = p.string().ends_with(".index.json");
  }

  std::unique_ptr<SafetensorsCheckpoint> ckpt(new SafetensorsCheckpoint());
  ckpt->path_ = p.string();
  if (!sharded) {
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(ckpt->path_));
    for (const auto& [name, t] : file->header().tensors) {
      ckpt->tensors_.emplace(name, Entry{file.get(), &t});
    }
    ckpt->files_.push_back(std::move(file));
    return ckpt;
  }

  // The index: bounded read, then the weight map.
  uint64_t size = 0;
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(ckpt->path_, &size));
  if (size > kSafetensorsMaxIndexBytes) {
    return Invalid(absl::StrCat(ckpt->path_, ": ", size, " bytes exceeds the limit of ",
                                kSafetensorsMaxIndexBytes, " bytes for an index"));
  }
  std::string text(size, '\0');
  const absl::Status read = PreadAll(fd.get(), text.data(), size, 0);
  fd.reset();
  RETURN_IF_ERROR(Annotate(read, ckpt->path_));
  auto weight_map = ParseSafetensorsIndex(text);
  if (!weight_map.ok()) return Annotate(weight_map.status(), ckpt->path_);

  // Shards in order of first mention; each opened once.
  std::map<std::string, const SafetensorsFile*, std::less<>> shards;
  for (const auto& [tensor, shard] : *weight_map) {
    if (shards.count(shard) != 0) continue;
    if (shards.size() >= kSafetensorsMaxShards) {
      return Invalid(
          absl::StrCat(ckpt->path_, ": more than ", kSafetensorsMaxShards, " shard files"));
    }
    auto file = SafetensorsFile::Open((p.parent_path() / shard).string());
    if (!file.ok()) {
      return Annotate(file.status(), absl::StrCat(ckpt->path_, ": shard ", Quote(shard)));
    }
    shards.emplace(shard, file->get());
    ckpt->files_.push_back(std::move(*file));
  }
  for (const auto& file : ckpt->files_) {
    for (const auto& [name, t] : file->header().tensors) {
      const auto [it, inserted] = ckpt->tensors_.emplace(name, Entry{file.get(), &t});
      if (!inserted) {
        return Invalid(absl::StrCat(ckpt->path_, ": tensor ", Quote(name), " is in both ",
                                    it->second.file->path(), " and ", file->path()));
      }
    }
  }
  for (const auto& [tensor, shard] : *weight_map) {
    const SafetensorsFile* file = shards.at(shard);
    if (file->Find(tensor) == nullptr) {
      return Invalid(absl::StrCat(ckpt->path_, ": weight_map maps tensor ", Quote(tensor), " to ",
                                  Quote(shard), ", which has no such tensor"));
    }
  }
  return ckpt;
}

}  // namespace slidedp::model
