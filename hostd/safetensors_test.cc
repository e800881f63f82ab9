#include "model/safetensors.h"

#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hostd/hf_import.h"
#include "hostd/state.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"
#include "nlohmann/json.hpp"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "slidedp-st-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string Write(const std::string& name, const std::string& bytes) const {
    const std::string p = (fs::path(path_) / name).string();
    fs::create_directories(fs::path(p).parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file with the given header text and data section.
std::string RawFile(const std::string& header, const std::string& data = "") {
  return Le64(header.size()) + header + data;
}

struct WTensor {
  std::string name;
  std::string dtype;  // F32, BF16, F16
  std::vector<uint64_t> shape;
  std::string bytes;  // little-endian data
};

// A well-formed file: tensors laid out in order, header padded to 8 bytes with spaces.
std::string BuildFile(const std::vector<WTensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::string data;
  for (const WTensor& t : tensors) {
    h[t.name] = {{"dtype", t.dtype},
                 {"shape", t.shape},
                 {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return RawFile(text, data);
}

std::string F32Bytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

std::string U16Bytes(const std::vector<uint16_t>& v) {
  std::string s(v.size() * 2, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

// Reference binary16 -> double.
double F16Reference(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) return mant == 0 ? sign * INFINITY : NAN;
  return sign * std::ldexp(1024 + mant, exp - 25);
}

std::vector<float> ReadAsFloat(const model::SafetensorsFile& f, const std::string& name) {
  const model::SafetensorsTensor* t = f.Find(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {};
  std::string bytes(t->end - t->begin, '\0');
  EXPECT_TRUE(f.Read(*t, 0, bytes.data(), bytes.size()).ok());
  std::vector<float> out(t->numel);
  model::WidenToFp32(t->dtype, bytes.data(), out.data(), out.size());
  return out;
}

TEST(SafetensorsTest, F16WideningIsExactForEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = model::F16ToFp32(static_cast<uint16_t>(h));
    const double want = F16Reference(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0) << h;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0) << h;
    }
  }
}

TEST(SafetensorsTest, ValidSingleFileAllDtypesExact) {
  TempDir tmp;
  const std::vector<float> f32 = {0.0f, -1.5f, 3.14159274f, 1e-40f, -65504.0f, 1.0f / 3};
  const std::vector<uint16_t> bf16 = {0x0000, 0x8000, 0x3f80, 0xc2f7, 0x0001, 0x7f7f};
  const std::vector<uint16_t> f16 = {0x0000, 0x8000, 0x3c00, 0x0001, 0x03ff, 0x7bff, 0xfbff};
  const std::string path =
      tmp.Write("model.safetensors", BuildFile({{"a.f32", "F32", {2, 3}, F32Bytes(f32)},
                                                {"b.bf16", "BF16", {6}, U16Bytes(bf16)},
                                                {"c.f16", "F16", {7, 1}, U16Bytes(f16)},
                                                {"d.scalar", "F32", {}, F32Bytes({2.5f})},
                                                {"e.empty", "BF16", {0, 4}, ""}},
                                               {{"format", "pt"}}));
  auto file = model::SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const model::SafetensorsHeader& h = (*file)->header();
  EXPECT_EQ(h.tensors.size(), 5u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.tensors.at("a.f32").shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(h.tensors.at("a.f32").dtype, model::SafetensorsDtype::kF32);
  EXPECT_EQ(h.tensors.at("c.f16").numel, 7u);
  EXPECT_EQ(h.tensors.at("d.scalar").numel, 1u);
  EXPECT_EQ(h.tensors.at("e.empty").numel, 0u);
  EXPECT_EQ(h.data_offset % 8, 0u);

  const std::vector<float> got_f32 = ReadAsFloat(**file, "a.f32");
  for (size_t i = 0; i < f32.size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(got_f32[i]), std::bit_cast<uint32_t>(f32[i])) << i;
  }
  const std::vector<float> got_bf16 = ReadAsFloat(**file, "b.bf16");
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(got_bf16[i]), uint32_t{bf16[i]} << 16) << i;
  }
  const std::vector<float> got_f16 = ReadAsFloat(**file, "c.f16");
  for (size_t i = 0; i < f16.size(); ++i) {
    EXPECT_EQ(static_cast<double>(got_f16[i]), F16Reference(f16[i])) << i;
  }
  EXPECT_EQ(ReadAsFloat(**file, "d.scalar"), std::vector<float>{2.5f});

  // Reads stay inside the tensor.
  char buf[8];
  const model::SafetensorsTensor& a = h.tensors.at("a.f32");
  EXPECT_EQ((*file)->Read(a, 20, buf, 8).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*file)->Read(a, 25, buf, 0).code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE((*file)->Read(a, 16, buf, 8).ok());

  // The in-memory parser agrees, and a checkpoint opened on the directory finds the file.
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto parsed = model::ParseSafetensorsFile(bytes);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->tensors.size(), 5u);
  EXPECT_EQ(parsed->data_offset, h.data_offset);
  EXPECT_TRUE(model::SafetensorsCheckpoint::DirectoryHasCheckpoint(tmp.path()));
  auto ckpt = model::SafetensorsCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->path(), path);
  EXPECT_EQ((*ckpt)->num_files(), 1u);
  ASSERT_NE((*ckpt)->Find("c.f16"), nullptr);
  EXPECT_EQ((*ckpt)->Find("nope"), nullptr);
}

TEST(SafetensorsTest, ValidShardedCheckpointWithIndex) {
  TempDir tmp;
  tmp.Write(
      "model-00001-of-00002.safetensors",
      BuildFile({{"x", "F32", {2}, F32Bytes({1, 2})}, {"y", "BF16", {1}, U16Bytes({0x4000})}}));
  tmp.Write("model-00002-of-00002.safetensors",
            BuildFile({{"z", "F16", {3}, U16Bytes({0x3c00, 0x4000, 0x4200})}}));
  const std::string index =
      tmp.Write("model.safetensors.index.json",
                R"({"metadata": {"total_size": 16, "nested": [[[{"deep": [1, 2, {"a": null}]}]]]},
          "weight_map": {"x": "model-00001-of-00002.safetensors",
                         "y": "model-00001-of-00002.safetensors",
                         "z": "model-00002-of-00002.safetensors"}})");
  EXPECT_TRUE(model::SafetensorsCheckpoint::DirectoryHasCheckpoint(tmp.path()));
  for (const std::string& where : {tmp.path(), index}) {
    auto ckpt = model::SafetensorsCheckpoint::Open(where);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    EXPECT_EQ((*ckpt)->path(), index);
    EXPECT_EQ((*ckpt)->num_files(), 2u);
    EXPECT_EQ((*ckpt)->tensors().size(), 3u);
    const auto* z = (*ckpt)->Find("z");
    ASSERT_NE(z, nullptr);
    EXPECT_THAT(z->file->path(), HasSubstr("00002"));
    EXPECT_EQ(ReadAsFloat(*z->file, "z"), (std::vector<float>{1, 2, 3}));
    EXPECT_EQ(ReadAsFloat(*(*ckpt)->Find("y")->file, "y"), std::vector<float>{2});
  }
}

TEST(SafetensorsTest, SingleFileWinsOverIndexInADirectory) {
  TempDir tmp;
  tmp.Write("model.safetensors", BuildFile({{"only", "F32", {1}, F32Bytes({7})}}));
  tmp.Write("model.safetensors.index.json", R"({"weight_map": {"x": "missing.safetensors"}})");
  auto ckpt = model::SafetensorsCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_NE((*ckpt)->Find("only"), nullptr);
}

// A hostile file: its bytes, the status code both readers must return and a substring of the
// message.
struct HostileCase {
  std::string label;
  std::string bytes;
  absl::StatusCode code;
  std::string expect;
};

void PrintTo(const HostileCase& c, std::ostream* os) { *os << c.label; }

std::string Entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return absl::StrCat("\"", name, "\": {\"dtype\": \"", dtype, "\", \"shape\": ", shape,
                      ", \"data_offsets\": ", offsets, "}");
}

// A header object holding the given entries.
std::string Obj(const std::vector<std::string>& entries) {
  return absl::StrCat("{", absl::StrJoin(entries, ", "), "}");
}

std::vector<HostileCase> HostileCases() {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const std::string data16(16, '\0');
  std::string over_cap = Le64(model::kSafetensorsMaxHeaderBytes + 1) + "{}";
  std::string beyond = Le64(100) + "{}";
  std::string huge_len = Le64(UINT64_MAX) + "{}";
  std::string dims17 = "[";
  for (int i = 0; i < 17; ++i) dims17 += i == 0 ? "1" : ",1";
  dims17 += "]";
  return {
      {"empty_file", "", kInvalid, "8-byte header length"},
      {"short_prefix", std::string(7, '\0'), kInvalid, "8-byte header length"},
      {"header_length_beyond_file", beyond, kInvalid, "exceeds the file"},
      {"header_length_over_cap", over_cap, kInvalid, "exceeds the limit"},
      {"header_length_max_u64", huge_len, kInvalid, "exceeds the limit"},
      {"not_json", RawFile("hello, world"), kInvalid, "malformed JSON"},
      {"trailing_garbage", RawFile("{} x"), kInvalid, "malformed JSON"},
      {"truncated_json", RawFile("{\"a\": {\"dtype\": \"F32\""), kInvalid, "malformed JSON"},
      {"invalid_utf8_key", RawFile("{\"\xff\xfe\": {}}"), kInvalid, "malformed JSON"},
      {"top_level_array", RawFile("[]"), kInvalid, "expected a JSON object"},
      {"tensor_not_object", RawFile("{\"w\": \"F32\"}"), kInvalid,
       "tensor 'w': expected an object"},
      {"offsets_out_of_range", RawFile(Obj({Entry("w", "F32", "[8]", "[0, 32]")}), data16),
       kInvalid, "tensor 'w': data_offsets [0, 32] end beyond the data section (16 bytes)"},
      {"offsets_begin_after_end", RawFile(Obj({Entry("w", "F32", "[0]", "[8, 4]")}), data16),
       kInvalid, "begin > end"},
      {"overlapping",
       RawFile(Obj({Entry("a", "F32", "[2]", "[0, 8]"), Entry("b", "F32", "[2]", "[4, 12]")}),
               data16),
       kInvalid, "tensors 'a' [0, 8) and 'b' [4, 12) overlap"},
      {"overlapping_contained",
       RawFile(Obj({Entry("a", "F32", "[4]", "[0, 16]"), Entry("b", "F16", "[2]", "[8, 12]")}),
               data16),
       kInvalid, "overlap"},
      {"size_mismatch", RawFile(Obj({Entry("w", "F32", "[3]", "[0, 8]")}), data16), kInvalid,
       "hold 8 bytes but F32 [3] needs 12"},
      {"bad_dtype", RawFile(Obj({Entry("w.int", "I64", "[1]", "[0, 8]")}), data16), kInvalid,
       "tensor 'w.int': dtype 'I64' is not supported; expected F32, BF16 or F16"},
      {"dtype_not_string",
       RawFile(R"({"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}})", data16), kInvalid,
       "tensor 'w': dtype: expected a string, got a number"},
      {"negative_shape", RawFile(Obj({Entry("w", "F32", "[-1]", "[0, 4]")}), data16), kInvalid,
       "tensor 'w': shape: -1 is negative"},
      {"fractional_shape", RawFile(Obj({Entry("w", "F32", "[1.5]", "[0, 4]")}), data16), kInvalid,
       "'1.5' is not an integer"},
      {"shape_beyond_u64",
       RawFile(Obj({Entry("w", "F32", "[18446744073709551616]", "[0, 4]")}), data16), kInvalid,
       "is not an integer in 0..2^64-1"},
      {"shape_product_overflow",
       RawFile(Obj({Entry("w", "BF16", "[4294967296, 4294967296, 2]", "[0, 4]")}), data16),
       kInvalid, "overflows 64-bit byte counts"},
      {"byte_count_overflow",
       RawFile(Obj({Entry("w", "F32", "[4611686018427387904]", "[0, 4]")}), data16), kInvalid,
       "overflows 64-bit byte counts"},
      {"too_many_dims", RawFile(Obj({Entry("w", "F32", dims17, "[0, 4]")}), data16), kInvalid,
       "more than 16 dimensions"},
      {"nested_array_in_shape", RawFile(Obj({Entry("w", "F32", "[[1]]", "[0, 4]")}), data16),
       kInvalid, "shape: expected integers >= 0, got an array"},
      {"three_offsets", RawFile(Obj({Entry("w", "F32", "[1]", "[0, 4, 8]")}), data16), kInvalid,
       "more than 2 values"},
      {"one_offset", RawFile(Obj({Entry("w", "F32", "[1]", "[0]")}), data16), kInvalid,
       "1 values; expected [begin, end]"},
      {"negative_offset", RawFile(Obj({Entry("w", "F32", "[1]", "[-4, 0]")}), data16), kInvalid,
       "data_offsets: -4 is negative"},
      {"missing_offsets", RawFile(R"({"w": {"dtype": "F32", "shape": [1]}})", data16), kInvalid,
       "tensor 'w': no data_offsets"},
      {"unknown_field",
       RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}})", data16),
       kInvalid, "unknown field 'x'"},
      {"duplicate_field",
       RawFile(R"({"w": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}})",
               data16),
       kInvalid, "duplicate field dtype"},
      {"duplicate_tensor",
       RawFile(Obj({Entry("w", "F32", "[1]", "[0, 4]"), Entry("w", "F32", "[1]", "[4, 8]")}),
               data16),
       kInvalid, "duplicate key 'w'"},
      {"metadata_not_string", RawFile(R"({"__metadata__": {"format": 1}})"), kInvalid,
       "__metadata__: value of 'format': expected a string"},
      {"metadata_not_object", RawFile(R"({"__metadata__": [1]})"), kInvalid,
       "__metadata__: expected an object of strings"},
      {"control_chars_in_name_escaped",
       RawFile(Obj({Entry("bad\\u0001name", "I8", "[1]", "[0, 1]")}), data16), kInvalid,
       "tensor 'bad\\x01name': dtype 'I8'"},
  };
}

class HostileFileTest : public ::testing::TestWithParam<HostileCase> {};

TEST_P(HostileFileTest, RejectedWithSpecificStatus) {
  const HostileCase& c = GetParam();
  const auto parsed = model::ParseSafetensorsFile(c.bytes);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), c.code) << parsed.status();
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(c.expect));

  TempDir tmp;
  const std::string path = tmp.Write("model.safetensors", c.bytes);
  const auto opened = model::SafetensorsFile::Open(path);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), c.code) << opened.status();
  EXPECT_THAT(std::string(opened.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(opened.status().message()), HasSubstr(c.expect));
  const auto ckpt = model::SafetensorsCheckpoint::Open(tmp.path());
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), c.code) << ckpt.status();
}

INSTANTIATE_TEST_SUITE_P(Cases, HostileFileTest, ::testing::ValuesIn(HostileCases()),
                         [](const auto& info) { return info.param.label; });

TEST(SafetensorsTest, EdgeCasesThatAreValid) {
  EXPECT_TRUE(model::ParseSafetensorsFile(RawFile("{}")).ok());
  EXPECT_TRUE(model::ParseSafetensorsFile(RawFile("{}       ")).ok());
  // Empty tensors may share an offset, also inside another tensor's range; gaps are allowed.
  auto h = model::ParseSafetensorsFile(
      RawFile(Obj({Entry("a", "F32", "[2]", "[0, 8]"), Entry("e", "F32", "[0]", "[4, 4]"),
                   Entry("f", "BF16", "[0, 3]", "[4, 4]"), Entry("b", "F16", "[2]", "[12, 16]")}),
              std::string(16, '\0')));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 4u);
}

TEST(SafetensorsTest, NotARegularFileOrMissing) {
  TempDir tmp;
  EXPECT_EQ(model::SafetensorsFile::Open(tmp.path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model::SafetensorsFile::Open(tmp.path() + "/nope.safetensors").status().code(),
            absl::StatusCode::kNotFound);
  const std::string fifo = absl::StrCat(tmp.path(), "/fifo.safetensors");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(model::SafetensorsFile::Open(fifo).status().code(), absl::StatusCode::kInvalidArgument);
  const auto empty_dir = model::SafetensorsCheckpoint::Open(tmp.path());
  EXPECT_EQ(empty_dir.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(empty_dir.status().message()), HasSubstr("neither model.safetensors"));
  EXPECT_EQ(model::SafetensorsCheckpoint::Open(tmp.path() + "/none").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(model::SafetensorsCheckpoint::DirectoryHasCheckpoint(tmp.path()));
}

TEST(SafetensorsTest, TruncatedAfterOpenIsDataLoss) {
  TempDir tmp;
  const std::vector<float> v(1000, 1.0f);
  const std::string path =
      tmp.Write("w.safetensors", BuildFile({{"w", "F32", {1000}, F32Bytes(v)}}));
  auto file = model::SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  fs::resize_file(path, (*file)->header().data_offset + 100);
  std::vector<float> out(1000);
  const absl::Status s = (*file)->Read(*(*file)->Find("w"), 0, out.data(), 4000);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(path));
}

// A bad index or shard set: index text, shard files, expected code and message substring.
struct IndexCase {
  std::string label;
  std::string index;
  std::map<std::string, std::string> shards;
  absl::StatusCode code;
  std::string expect;
};

void PrintTo(const IndexCase& c, std::ostream* os) { *os << c.label; }

std::vector<IndexCase> IndexCases() {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const std::string one = BuildFile({{"x", "F32", {1}, F32Bytes({1})}});
  const std::string other = BuildFile({{"y", "F32", {1}, F32Bytes({2})}});
  return {
      {"shard_with_slash",
       R"({"weight_map": {"x": "sub/a.safetensors"}})",
       {},
       kInvalid,
       "maps to 'sub/a.safetensors', which is not a plain file name"},
      {"shard_escapes_dir",
       R"({"weight_map": {"x": "../a.safetensors"}})",
       {},
       kInvalid,
       "not a plain file name"},
      {"shard_dotdot", R"({"weight_map": {"x": ".."}})", {}, kInvalid, "not a plain file name"},
      {"shard_absolute",
       R"({"weight_map": {"x": "/etc/passwd"}})",
       {},
       kInvalid,
       "not a plain file name"},
      {"shard_empty", R"({"weight_map": {"x": ""}})", {}, kInvalid, "not a plain file name"},
      {"no_weight_map", R"({"metadata": {}})", {}, kInvalid, "no \"weight_map\""},
      {"weight_map_not_object",
       R"({"weight_map": ["a"]})",
       {},
       kInvalid,
       "weight_map: expected an object"},
      {"shard_not_string",
       R"({"weight_map": {"x": 3}})",
       {},
       kInvalid,
       "value of 'x': expected a shard file name"},
      {"duplicate_tensor",
       R"({"weight_map": {"x": "a.safetensors", "x": "b.safetensors"}})",
       {},
       kInvalid,
       "duplicate tensor 'x'"},
      {"not_json", "weight_map", {}, kInvalid, "malformed JSON"},
      {"missing_shard",
       R"({"weight_map": {"x": "a.safetensors"}})",
       {},
       absl::StatusCode::kNotFound,
       "shard 'a.safetensors'"},
      {"tensor_not_in_its_shard",
       R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}})",
       {{"a.safetensors", one}},
       kInvalid,
       "maps tensor 'y' to 'a.safetensors', which has no such tensor"},
      {"tensor_in_two_shards",
       R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})",
       {{"a.safetensors", one},
        {"b.safetensors",
         BuildFile({{"x", "F32", {1}, F32Bytes({1})}, {"y", "F32", {1}, F32Bytes({2})}})}},
       kInvalid,
       "tensor 'x' is in both"},
      {"bad_shard_file",
       R"({"weight_map": {"x": "a.safetensors"}})",
       {{"a.safetensors", RawFile(Obj({Entry("x", "F64", "[1]", "[0, 8]")}), "12345678")}},
       kInvalid,
       "dtype 'F64' is not supported"},
  };
}

class BadIndexTest : public ::testing::TestWithParam<IndexCase> {};

TEST_P(BadIndexTest, Rejected) {
  const IndexCase& c = GetParam();
  TempDir tmp;
  const std::string index = tmp.Write("model.safetensors.index.json", c.index);
  for (const auto& [name, bytes] : c.shards) tmp.Write(name, bytes);
  const auto ckpt = model::SafetensorsCheckpoint::Open(tmp.path());
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), c.code) << ckpt.status();
  EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr(c.expect));
  EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr(index));
}

INSTANTIATE_TEST_SUITE_P(Cases, BadIndexTest, ::testing::ValuesIn(IndexCases()),
                         [](const auto& info) { return info.param.label; });

// ---------------------------------------------------------------------------------------------
// Import into the training state.

using testing::SmallModel;
using testing::UniqueInstance;

// The small model's tensors with deterministic values, stored as `dtypes` (one per tensor).
std::vector<WTensor> SmallModelTensors(const std::vector<std::string>& dtypes, uint64_t seed) {
  const model::LoadedModel model = SmallModel();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<WTensor> out;
  size_t k = 0;
  for (const auto& layer : model.manifest.layers()) {
    for (const auto& t : layer.tensors()) {
      WTensor w;
      w.name = t.name();
      w.dtype = dtypes[k++ % dtypes.size()];
      uint64_t n = 1;
      for (int64_t d : t.shape()) {
        w.shape.push_back(static_cast<uint64_t>(d));
        n *= static_cast<uint64_t>(d);
      }
      if (w.dtype == "F32") {
        std::vector<float> v(n);
        // Arbitrary finite bit patterns, including exact bf16 rounding ties.
        for (uint64_t i = 0; i < n; ++i) {
          uint32_t bits = static_cast<uint32_t>(rng());
          if (i % 7 == 0) bits = (bits & 0xffff0000u) | 0x8000u;
          if ((bits & 0x7f800000u) == 0x7f800000u) bits &= 0xbfffffffu;
          v[i] = std::bit_cast<float>(bits);
        }
        w.bytes = F32Bytes(v);
      } else {
        std::vector<uint16_t> v(n);
        const uint16_t exp_mask = w.dtype == "BF16" ? 0x7f80 : 0x7c00;
        for (uint64_t i = 0; i < n; ++i) {
          uint16_t bits = static_cast<uint16_t>(rng());
          if ((bits & exp_mask) == exp_mask) bits &= static_cast<uint16_t>(~0x4000);
          v[i] = bits;
        }
        w.bytes = U16Bytes(v);
      }
      out.push_back(std::move(w));
    }
  }
  return out;
}

float Expected(const WTensor& w, uint64_t i) {
  if (w.dtype == "F32") {
    float f;
    std::memcpy(&f, w.bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, w.bytes.data() + 2 * i, 2);
  return w.dtype == "BF16" ? kernels::Bf16ToFp32(b) : model::F16ToFp32(b);
}

TEST(HfImportTest, StateImportsExactWeightsWithZeroMomentsAndRneParams) {
  auto pool = ThreadPool::Create({.num_threads = 3});
  ASSERT_TRUE(pool.ok());
  for (const std::vector<std::string>& dtypes :
       std::vector<std::vector<std::string>>{{"F32"}, {"BF16"}, {"F16"}, {"F16", "BF16", "F32"}}) {
    SCOPED_TRACE(dtypes.size() == 1 ? dtypes[0] : "mixed");
    TempDir tmp;
    std::vector<WTensor> tensors = SmallModelTensors(dtypes, dtypes.size() * 7 + dtypes[0].size());
    std::vector<WTensor> stored = tensors;
    stored.push_back({"model.rotary_emb.inv_freq", "F32", {2}, F32Bytes({1, 2})});
    tmp.Write("model.safetensors", BuildFile(stored));
    auto ckpt = model::SafetensorsCheckpoint::Open(tmp.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    TrainingState::Options o;
    o.instance = UniqueInstance("import");
    o.model = SmallModel();
    auto plan = PlanImport(o.model.manifest, **ckpt);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->ignored, std::vector<std::string>{"model.rotary_emb.inv_freq"});
    o.import = &*plan;
    auto state = TrainingState::Create(o, pool->get());
    ASSERT_TRUE(state.ok()) << state.status();
    (*state)->set_remove_on_destroy(true);
    EXPECT_EQ((*state)->weights_source(), absl::StrCat("safetensors ", (*ckpt)->path()));
    size_t k = 0;
    for (const LayerInfo& layer : (*state)->layers()) {
      const float* w = (*state)->master(layer.index);
      const float* m = (*state)->exp_avg(layer.index);
      const float* v = (*state)->exp_avg_sq(layer.index);
      const uint16_t* p = (*state)->params(layer.index);
      for (const TensorRange& t : layer.tensors) {
        const WTensor& src = tensors[k++];
        ASSERT_EQ(src.name, t.name);
        for (uint64_t i = 0; i < t.numel; ++i) {
          const float want = Expected(src, i);
          const uint64_t at = t.offset + i;
          ASSERT_EQ(std::bit_cast<uint32_t>(w[at]), std::bit_cast<uint32_t>(want))
              << t.name << "[" << i << "]";
          ASSERT_EQ(p[at], kernels::RoundToBf16(want)) << t.name << "[" << i << "]";
          ASSERT_EQ(m[at], 0.0f);
          ASSERT_EQ(v[at], 0.0f);
        }
      }
    }
  }
}

TEST(HfImportTest, MissingAndMismatchedTensorsAreNamed) {
  TempDir tmp;
  std::vector<WTensor> tensors = SmallModelTensors({"BF16"}, 1);
  const model::LoadedModel model = SmallModel();

  std::vector<WTensor> missing(tensors.begin(), tensors.end() - 1);
  const std::string path = tmp.Write("missing/model.safetensors", BuildFile(missing));
  auto ckpt = model::SafetensorsCheckpoint::Open(tmp.path() + "/missing");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto plan = PlanImport(model.manifest, **ckpt);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("'block1.proj.weight'"));
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr(path));

  std::vector<WTensor> transposed = tensors;
  transposed[1].shape = {77, 129};
  const std::string path2 = tmp.Write("shape/model.safetensors", BuildFile(transposed));
  ckpt = model::SafetensorsCheckpoint::Open(tmp.path() + "/shape");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  plan = PlanImport(model.manifest, **ckpt);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr(absl::StrCat("tensor 'block0.proj.weight' in ", path2,
                                     ": shape [77, 129] does not match the model's [129, 77]")));

  std::vector<WTensor> flat = tensors;
  flat[0].shape = {37, 1};
  tmp.Write("rank/model.safetensors", BuildFile(flat));
  ckpt = model::SafetensorsCheckpoint::Open(tmp.path() + "/rank");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT(std::string(PlanImport(model.manifest, **ckpt).status().message()),
              HasSubstr("shape [37, 1] does not match the model's [37]"));
}

TEST(HfImportTest, NonFiniteValueFailsCreateAndLeavesNoSegments) {
  TempDir tmp;
  std::vector<WTensor> tensors = SmallModelTensors({"F32"}, 3);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(tensors[2].bytes.data() + 4 * 4321, &nan, 4);
  tmp.Write("model.safetensors", BuildFile(tensors));
  auto ckpt = model::SafetensorsCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  TrainingState::Options o;
  o.instance = UniqueInstance("nan");
  o.model = SmallModel();
  auto plan = PlanImport(o.model.manifest, **ckpt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  o.import = &*plan;
  auto pool = ThreadPool::Create({.num_threads = 2});
  ASSERT_TRUE(pool.ok());
  auto state = TrainingState::Create(o, pool->get());
  ASSERT_FALSE(state.ok());
  EXPECT_EQ(state.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(state.status().message()),
              HasSubstr(absl::StrCat("tensor 'block1.proj.weight' in ", (*ckpt)->path(),
                                     ": element 4321 is NaN")));
  EXPECT_FALSE(ShmSegment::Exists(SegmentName(o.instance, shm::SegmentKind::kControl)));
  EXPECT_FALSE(ShmSegment::Exists(SegmentName(o.instance, shm::SegmentKind::kState)));
}

TEST(HfImportTest, ResolveWeightsInit) {
  TempDir tmp;
  using Kind = WeightsInit::Kind;
  EXPECT_EQ(ResolveWeightsInit("auto", tmp.path()).kind, Kind::kRandom);
  EXPECT_EQ(ResolveWeightsInit("auto", "").kind, Kind::kRandom);
  tmp.Write("model.safetensors.index.json", "{}");
  const WeightsInit a = ResolveWeightsInit("auto", tmp.path());
  EXPECT_EQ(a.kind, Kind::kSafetensors);
  EXPECT_EQ(a.path, tmp.path());
  EXPECT_EQ(ResolveWeightsInit("random", tmp.path()).kind, Kind::kRandom);
  EXPECT_EQ(ResolveWeightsInit("zeros", tmp.path()).kind, Kind::kZeros);
  const WeightsInit p = ResolveWeightsInit("/x/w.safetensors", "");
  EXPECT_EQ(p.kind, Kind::kSafetensors);
  EXPECT_EQ(p.path, "/x/w.safetensors");
}

}  // namespace
}  // namespace slidedp::hostd
