// The checkpointer's counters and last result as plain values (hostd/checkpoint.h), so Engine's
// reporting (hostd/engine_report.h) renders them without depending on the checkpointer.
#pragma once

#include <cstdint>
#include <string>

namespace slidedp::hostd {

struct CheckpointStats {
  uint64_t checkpoints_started = 0;
  uint64_t checkpoints_committed = 0;
  uint64_t checkpoints_failed = 0;
  uint64_t bytes_written = 0;            // layer files of every checkpoint
  double write_seconds = 0;              // writer busy time (layer files)
  double stall_seconds = 0;              // updates waiting on the checkpoint
  double snapshot_seconds = 0;           // updates copying layers into the pool
  uint64_t layers_snapshotted = 0;       // copied into the pool by an update (its hook)
  uint64_t layers_copied_by_writer = 0;  // copied into the pool by the writer
  uint64_t layers_written_live = 0;      // written straight from the live state
  uint64_t pool_high_water_bytes = 0;
  uint64_t pool_kept_bytes = 0;             // snapshot buffers kept for the next checkpoint
  uint64_t snapshot_buffers_allocated = 0;  // mmaps of snapshot buffers, since start
  uint64_t pool_prepared_bytes = 0;         // of them, allocated ahead by PreparePool
  uint64_t snapshot_alloc_failures = 0;     // a snapshot buffer got no memory (layer written live)
  uint64_t bytes_written_direct = 0;        // of bytes_written, with O_DIRECT
  double paced_seconds = 0;                 // the writer slept for max_write_bytes_per_s
  double pool_prepare_seconds = 0;
  double last_seconds = 0;   // request to commit, of the last committed checkpoint
  double last_mb_per_s = 0;  // its layer bytes / its duration
  uint64_t last_stall_max_layer_wait_us = 0;
};

struct CheckpointResult {
  uint64_t step = 0;
  std::string path;
  uint64_t bytes = 0;
  double seconds = 0;
};

}  // namespace slidedp::hostd
