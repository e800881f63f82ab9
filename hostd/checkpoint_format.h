// The on-disk format of hostd checkpoints: writing one atomically, reading and verifying one,
// listing a directory of them. No TrainingState here (slidedpctl links it to list checkpoints
// without a daemon); hostd/checkpoint.h captures a live job's state into this format.
//
// A checkpoint of version t is the directory <dir>/step-<t>/ (t zero-padded to 12 digits, so
// names sort by step) holding
//   layer-<LLLLL>.bin  per layer: a 4096-byte header block (a 64-byte LayerFileHeader, then
//                      zeros), then FP32 master, m, v (numel each). The data starts on a block
//                      boundary so that a snapshot buffer (page-aligned master | m | v) goes to
//                      disk with O_DIRECT, past the page cache. Format 1 (still read) had the
//                      data right after the 64-byte header.
//   meta.json          format version, job id, manifest hash, the JobSpec (manifest, optimizer
//                      with the LR schedule, routes, seed, world size at save time), the model's
//                      initializer_range / config.json, step t, and per file its size and xxh64
//   COMMITTED          the commit marker: "slidedp-checkpoint <format> step <t> meta_xxh64 <hex>"
// It is rank-count independent by construction: it is hostd's state, not the ranks'.
//
// Atomicity (CheckpointDirWriter): everything is written into <dir>/step-<t>.tmp/, each file
// fsynced; meta.json written and fsynced; the .tmp directory fsynced; renamed to step-<t>/;
// <dir> fsynced; then COMMITTED is written to COMMITTED.tmp, fsynced, renamed, and step-<t>/
// fsynced -- last. A crash at any point leaves either a .tmp directory or a step directory
// without a valid marker, both of which readers ignore, and the previous checkpoint untouched.
// Checksums are XXH3-64 (xxhash's XXH3_64bits, seed 0) of each whole file.
//
// Thread safety: the free functions are thread-safe; a CheckpointDirWriter is used by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::hostd {

// This hostd writes format 2 and reads formats 1 to 2.
inline constexpr uint32_t kCheckpointFormatVersion = 2;
inline constexpr uint32_t kOldestCheckpointFormatRead = 1;
inline constexpr char kCheckpointMagic[] = "slidedp-checkpoint";
inline constexpr char kCheckpointMarker[] = "COMMITTED";
inline constexpr char kCheckpointMeta[] = "meta.json";

// The first 64 bytes of every layer file.
struct LayerFileHeader {
  char magic[8];    // "SLDPCKL1"
  uint32_t format;  // kCheckpointFormatVersion
  uint32_t layer;   // layer index
  uint64_t numel;   // elements of each of master, m, v
  uint64_t step;    // the version t the data is at
  uint64_t reserved[4];
};
static_assert(sizeof(LayerFileHeader) == 64);
// Where a layer file's data (master) starts: 64 in format 1, the 4096-byte block from format 2.
inline constexpr uint64_t LayerDataOffset(uint32_t format) {
  return format < 2 ? sizeof(LayerFileHeader) : 4096;
}
inline constexpr char kLayerFileMagic[8] = {'S', 'L', 'D', 'P', 'C', 'K', 'L', '1'};

struct CheckpointFile {
  std::string name;  // relative to the checkpoint directory
  uint32_t layer = 0;
  uint64_t numel = 0;
  uint64_t size_bytes = 0;
  uint64_t xxh64 = 0;  // XXH3_64bits of the whole file
};

// What a checkpoint says about itself (meta.json), plus where it lies.
struct CheckpointInfo {
  std::string path;  // the step directory
  uint64_t step = 0;
  uint32_t format = kCheckpointFormatVersion;
  std::string job_id;
  std::string manifest_hash;  // hex, as ModelManifest.manifest_hash
  // manifest, optimizer (the LR schedule's settings; its position is `step`), routes, seed,
  // world_size at save time (resume may use any world size).
  slidedp::v1::JobSpec spec;
  double initializer_range = 0.02;
  std::string config_json;  // the model's HF config.json text, when it had one
  std::string model_source;
  std::string weights_source;  // where the job's initial weights came from
  std::string hostd_version;
  int64_t created_unix_ms = 0;
  double next_lr = 0;                 // the LR of step t + 1 (informative)
  std::vector<CheckpointFile> files;  // one per layer, in layer order
  uint64_t total_bytes = 0;           // of every file, meta.json and marker included
};

// "step-000000000042" for 42.
std::string CheckpointDirName(uint64_t step);

// Reads a step directory's marker and meta.json and checks, without reading the layer data:
// the marker exists and names meta.json's xxh64, the magic and format version, the step matches
// the directory name, every layer file exists with the size meta.json gives. Errors (each naming
// the directory and the file): NOT_FOUND (no directory, no marker: an uncommitted checkpoint),
// DATA_LOSS (marker/meta mismatch, truncated or missing file), INVALID_ARGUMENT (unparsable
// meta.json, unknown format version).
absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& step_dir);

// Reads every layer file and compares its XXH3-64 and header with meta.json; DATA_LOSS naming
// the first file that differs.
absl::Status VerifyCheckpointData(const CheckpointInfo& info);

struct CheckpointListing {
  std::string path;
  std::string name;
  uint64_t step = 0;  // from the directory name
  bool valid = false;
  std::string reason;  // why not valid ("no COMMITTED marker (incomplete write)", ...)
  uint64_t size_bytes = 0;
  int64_t created_unix_ms = 0;
  bool temporary = false;  // a step-<t>.tmp directory (a write in progress or interrupted)
};

// Every step-<t> and step-<t>.tmp directory of `dir`, newest step first; `verify_data` also
// checks each valid one's checksums (reads every byte). NOT_FOUND when `dir` does not exist.
absl::StatusOr<std::vector<CheckpointListing>> ListCheckpoints(const std::string& dir,
                                                               bool verify_data);

// `path` is a step directory (has a COMMITTED marker or a meta.json): its info; else a checkpoint
// directory: the newest committed step directory in it (marker and sizes checked, data not).
// NOT_FOUND naming the directory and, per skipped candidate, why, when there is none.
absl::StatusOr<CheckpointInfo> FindLatestCheckpointInfo(const std::string& path);

// Deletes committed checkpoints of `dir` beyond the newest `keep_last` (never the one at
// `protect_step`), and .tmp directories of steps older than the newest committed one. keep_last
// 0 keeps everything. Returns the paths removed.
absl::StatusOr<std::vector<std::string>> PruneCheckpoints(const std::string& dir,
                                                          uint32_t keep_last,
                                                          uint64_t protect_step);

// How CheckpointDirWriter::WriteLayer writes a layer's data.
struct LayerWrite {
  // Called after each piece of data is written, with its bytes; may sleep (the checkpointer
  // paces its writes with it: checkpoint.max_write_mb_per_s). Null: no pacing.
  std::function<void(uint64_t bytes)> after_piece;
  bool direct = true;  // false: never O_DIRECT
};

// Writes one checkpoint directory (see the overview for the order of operations).
class CheckpointDirWriter {
 public:
  struct Options {
    // Observes each durable operation, in order: ("mkdir"|"write"|"fsync"|"fsync_dir"|"rename",
    // path). Tests use it to check the ordering (R5).
    std::function<void(std::string_view op, const std::string& path)> trace;
  };

  // Creates <dir> if needed and <dir>/step-<t>.tmp/ (removing a stale one of the same step).
  // ALREADY_EXISTS when step-<t>/ is already committed.
  static absl::StatusOr<std::unique_ptr<CheckpointDirWriter>> Begin(const std::string& dir,
                                                                    uint64_t step,
                                                                    Options options = {});
  ~CheckpointDirWriter();  // removes the .tmp directory unless committed
  CheckpointDirWriter(const CheckpointDirWriter&) = delete;
  CheckpointDirWriter& operator=(const CheckpointDirWriter&) = delete;

  // Writes layer-<layer>.bin from the three arrays and fsyncs it; returns its size in bytes.
  // When m and v follow master in one page-aligned block (a snapshot buffer), the block goes to
  // disk with O_DIRECT (no page-cache copy, no dirty pages to write back or reclaim) where the
  // file system takes it, else through the page cache.
  absl::StatusOr<uint64_t> WriteLayer(uint32_t layer, uint64_t numel, const float* master,
                                      const float* m, const float* v, const LayerWrite& how = {});

  // Writes meta.json from `info` (step, files and total_bytes are filled here), then renames and
  // commits. Every layer 0..num_layers-1 of info.spec.manifest must have been written. Returns
  // the committed info (path = the step directory).
  absl::StatusOr<CheckpointInfo> Commit(CheckpointInfo info);

  uint64_t step() const { return step_; }
  uint64_t bytes_written() const { return bytes_written_; }
  uint64_t bytes_written_direct() const { return bytes_direct_; }  // of those, with O_DIRECT
  const std::string& tmp_path() const { return tmp_; }

 private:
  CheckpointDirWriter() = default;
  void Trace(std::string_view op, const std::string& path) const;

  Options options_;
  std::string dir_;
  std::string tmp_;
  std::string final_;
  uint64_t step_ = 0;
  uint64_t bytes_written_ = 0;
  uint64_t bytes_direct_ = 0;
  bool committed_ = false;
  std::vector<CheckpointFile> files_;
};

}  // namespace slidedp::hostd
