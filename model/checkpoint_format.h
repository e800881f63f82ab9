// The on-disk format of hostd checkpoints: writing one atomically, reading and verifying one,
// listing a directory of them. No TrainingState here (slidedpctl links it to list checkpoints
// without a daemon); hostd/checkpoint.h captures a live job's state into this format.
//
// A checkpoint of version t of job J on hostd instance I is the directory
// <dir>/step-<t>.<I>.<J>/ (t zero-padded to 12 digits, so names sort by step; I and J as they
// are when made of [A-Za-z0-9_-], at most 64, else "~" and the hex XXH3-64 of the name) holding
//   layer-<LLLLL>.bin  per layer: a 4096-byte header block (a 64-byte LayerFileHeader, then
//                      zeros), then FP32 master, m, v (numel each). The data starts on a block
//                      boundary so that a snapshot buffer (page-aligned master | m | v) goes to
//                      disk with O_DIRECT, past the page cache. Format 1 (still read) had the
//                      data right after the 64-byte header.
//   meta.json          format version, instance, job id, manifest hash, the JobSpec (manifest,
//                      optimizer with the LR schedule, routes, seed, world size at save time),
//                      the model's initializer_range / config.json, step t, and per file its
//                      size and xxh64
//   COMMITTED          the commit marker: "slidedp-checkpoint <format> step <t> meta_xxh64 <hex>"
// It is rank-count independent by construction: it is hostd's state, not the ranks'.
//
// Scope (format 3). Several instances and jobs may share a directory: each checkpoint says in
// meta.json (which the marker's checksum covers) and in its directory name whose it is, and
// what hostd finds, prunes and restores on its own (FindLatestCheckpointInfo with a scope,
// PruneCheckpoints) is only its own instance's and job's. Checkpoints of formats 1 and 2
// (<dir>/step-<t>/, no instance) are unscoped: still read, listed and restored when named
// (FindLatestCheckpointInfo without a scope), but never picked or pruned by scope, so no
// instance takes another's for its own. Naming a directory explicitly is unambiguous only
// when it holds one job's checkpoints.
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

namespace slidedp::model {

// This hostd writes format 3 and reads formats 1 to 3.
inline constexpr uint32_t kCheckpointFormatVersion = 3;
// The first format whose checkpoints name their instance.
inline constexpr uint32_t kFirstScopedCheckpointFormat = 3;
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
// (Format 3 changed meta.json and the directory name, not the layer files.)
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

// Whose checkpoints: the hostd instance (config key `instance`) and the job.
struct CheckpointScope {
  std::string instance;
  std::string job_id;
  bool operator==(const CheckpointScope&) const = default;
};

// What a checkpoint says about itself (meta.json), plus where it lies.
struct CheckpointInfo {
  std::string path;  // the step directory
  uint64_t step = 0;
  uint32_t format = kCheckpointFormatVersion;
  // The instance that wrote it (format 3); empty for formats 1 and 2: unscoped.
  std::string instance;
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

// "<instance>.<job>", as the name of a checkpoint of `scope` carries them.
std::string CheckpointScopeName(const CheckpointScope& scope);
// "step-000000000042.<instance>.<job>" for 42: the name of a checkpoint of `scope`.
std::string CheckpointDirName(uint64_t step, const CheckpointScope& scope);
// "step-000000000042": the name formats 1 and 2 used (no scope).
std::string CheckpointDirName(uint64_t step);

// Reads a step directory's marker and meta.json and checks, without reading the layer data:
// the marker exists and names meta.json's xxh64, the magic and format version, the step (and
// from format 3 the instance and job) match the directory name, every layer file exists with
// the size meta.json gives. Errors (each naming the directory and the file): NOT_FOUND (no
// directory, no marker: an uncommitted checkpoint), DATA_LOSS (marker/meta mismatch, name/meta
// mismatch, truncated or missing file), INVALID_ARGUMENT (unparsable meta.json, unknown format
// version).
absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& step_dir);

// Reads every layer file and compares its XXH3-64 and header with meta.json; DATA_LOSS naming
// the first file that differs.
absl::Status VerifyCheckpointData(const CheckpointInfo& info);

struct CheckpointListing {
  std::string path;
  std::string name;
  uint64_t step = 0;  // from the directory name
  // "<instance>.<job>" of the name (as CheckpointDirName writes them); empty: an unscoped name.
  std::string scope_name;
  // Valid ones: whose checkpoint it is (meta.json); instance empty for formats 1 and 2.
  std::string instance;
  std::string job_id;
  bool valid = false;
  std::string reason;  // why not valid ("no COMMITTED marker (incomplete write)", ...)
  uint64_t size_bytes = 0;
  int64_t created_unix_ms = 0;
  bool temporary = false;  // a step-<t>.tmp directory (a write in progress or interrupted)
};

// Every step directory of `dir` (step-<t>[.<instance>.<job>], and the same with .tmp), of every
// scope, newest step first; `verify_data` also checks each valid one's checksums (reads every
// byte). NOT_FOUND when `dir` does not exist.
absl::StatusOr<std::vector<CheckpointListing>> ListCheckpoints(const std::string& dir,
                                                               bool verify_data);

// A path the user named (--resume, CreateJob's resume_path), whoever's checkpoints it holds:
// `path` is a step directory (has a COMMITTED marker or a meta.json): its info; else a checkpoint
// directory: the newest committed step directory in it (marker and sizes checked, data not),
// when its committed checkpoints are of one job (one instance and job id; unscoped ones count
// by job id). INVALID_ARGUMENT listing each job with its newest step directory when they are of
// several; NOT_FOUND naming the directory and, per skipped candidate, why, when there is none.
absl::StatusOr<CheckpointInfo> FindLatestCheckpointInfo(const std::string& path);

// hostd's own pick (recovery): the newest committed checkpoint of `scope` in the checkpoint
// directory `dir`; others' and unscoped ones are never taken. NOT_FOUND saying how many
// committed ones of other scopes it passed over.
absl::StatusOr<CheckpointInfo> FindLatestCheckpointInfo(const std::string& dir,
                                                        const CheckpointScope& scope);

// Deletes the committed checkpoints of `scope` in `dir` beyond its newest `keep_last` (never the
// one at `protect_step`), and its .tmp and unmarked directories of steps older than its newest
// committed one. Nothing of another scope and no unscoped checkpoint is touched. keep_last 0
// keeps everything. Returns the paths removed.
absl::StatusOr<std::vector<std::string>> PruneCheckpoints(const std::string& dir,
                                                          uint32_t keep_last, uint64_t protect_step,
                                                          const CheckpointScope& scope);

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

  // Creates <dir> if needed and the .tmp directory of the checkpoint of `step` of `scope`
  // (removing a stale one of the same step and scope). ALREADY_EXISTS when that checkpoint is
  // already committed.
  static absl::StatusOr<std::unique_ptr<CheckpointDirWriter>> Begin(const std::string& dir,
                                                                    uint64_t step,
                                                                    const CheckpointScope& scope,
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

  // Writes meta.json from `info` (step, files, total_bytes, instance and job id are filled
  // here, the last two from the writer's scope), then renames and commits. Every layer
  // 0..num_layers-1 of info.spec.manifest must have been written. Returns the committed info
  // (path = the step directory).
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
  CheckpointScope scope_;
  uint64_t bytes_written_ = 0;
  uint64_t bytes_direct_ = 0;
  bool committed_ = false;
  std::vector<CheckpointFile> files_;
};

}  // namespace slidedp::model
