// EngineReport: what GetStatus, GetStats, ListLayers and hostd's STATUS line say, rendered from
// snapshots Engine takes under its lock. The rendering is pure (no lock, no shared memory, no
// clock: the snapshot carries the times), so what each field means is tested on its own: rates,
// ages, spans, which source the weights came from.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hostd/checkpoint_stats.h"
#include "hostd/update_stats.h"
#include "proto/shm_abi.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::hostd {

// "creating job 'default': importing weights 12/36 layers (41 s)" (bytes as GiB).
std::string RenderCreationLine(const slidedp::v1::JobCreation& creation, double elapsed_s);

struct StatusLineSnapshot {
  std::optional<slidedp::v1::JobCreation> creating;  // a job being created
  double creation_elapsed_s = 0;
  bool has_job = false;
  std::string job_id;
  std::string model_name;
  uint64_t steps_completed = 0;
  shm::StepState step_state = shm::StepState::kIdle;
  uint32_t ranks_attached = 0;
  uint32_t world_size = 0;
};
// "job default (qwen3-4b): 120 steps, running, 1/1 ranks attached", the creation line, or
// "serving, no job".
std::string RenderStatusLine(const StatusLineSnapshot& s);

struct LayerSnapshot {
  uint32_t index = 0;
  std::string name;
  uint32_t kind = 0;  // slidedp::v1::LayerKind
  uint64_t numel = 0;
  uint64_t version = 0;
  uint64_t state_stride = 0;  // bytes of one of master, m, v (aligned)
  uint64_t param_bytes = 0;   // BF16 bytes (unaligned)
  int numa_node = 0;
  uint64_t skipped_steps = 0;
  double last_grad_norm = 0;
};
slidedp::v1::LayerStatus RenderLayer(const LayerSnapshot& s);

struct JobSnapshot {
  slidedp::v1::JobSpec spec;  // the job as created (routes, world size)
  // The gradient route in effect (spec.routes' when set; hostd's choice under grad_route auto)
  // and how it came about (JobStatus.grad_route_choice).
  slidedp::v1::GradRoute grad_route = slidedp::v1::GRAD_ROUTE_UNSPECIFIED;
  std::string grad_route_choice;
  slidedp::v1::OptimizerConfig optimizer;  // the worker's now
  std::string model_name;
  std::string family;
  uint64_t steps_completed = 0;
  uint64_t next_step = 1;
  shm::StepState step_state = shm::StepState::kIdle;
  uint64_t total_params = 0;
  std::string manifest_hash;
  std::string weights_source;  // the state's; a resumed job's is its checkpoint
  std::string resumed_from;
  std::vector<uint32_t> client_updated_layers;
  std::string checkpoint_dir;
  CheckpointResult last_checkpoint;  // path empty: none yet
  int64_t last_checkpoint_unix_ms = 0;
  uint64_t checkpoint_in_flight_step = 0;
  int64_t now_unix_ms = 0;
};
slidedp::v1::JobStatus RenderJob(const JobSnapshot& s);

struct StatsSnapshot {
  UpdateStats worker;
  CheckpointStats checkpoint;
  uint64_t steps_completed = 0;
  uint64_t steps_aborted = 0;
  uint64_t step_running = 0;
  uint64_t last_step = 0;
  double last_step_seconds = 0;
  double step_seconds_sum = 0;
  std::vector<double> step_seconds_bounds;
  std::vector<uint64_t> step_seconds_buckets;
  double last_step_update_seconds = 0;  // the worker's busy time of the last completed step
  std::vector<LayerUpdateResult> last_step_layers;
  uint64_t total_params = 0;
  bool fp32_grads = false;  // grad_dtype fp32: 32 bytes per parameter update, else 28
  std::string isa;
  int32_t update_threads = 0;
  uint64_t grad_bytes_received = 0;
  uint64_t param_bytes_published = 0;
  uint64_t exports_completed = 0;
  uint64_t last_checkpoint_step = 0;
  int64_t last_checkpoint_unix_ms = 0;  // 0: none yet
  int64_t now_unix_ms = 0;
};
slidedp::v1::GetStatsResponse RenderStats(const StatsSnapshot& s);

}  // namespace slidedp::hostd
