#include "hostd/engine_report.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/lr_schedule.h"

namespace slidedp::hostd {

std::string RenderCreationLine(const slidedp::v1::JobCreation& creation, double elapsed_s) {
  std::string progress;
  if (creation.total() > 0) {
    progress =
        creation.unit() == "bytes"
            ? absl::StrFormat(" %.1f/%.1f GiB", creation.done() / 1073741824.0,
                              creation.total() / 1073741824.0)
            : absl::StrCat(" ", creation.done(), "/", creation.total(), " ", creation.unit());
  }
  return absl::StrFormat("creating job '%s': %s%s (%.0f s)", creation.job_id(), creation.phase(),
                         progress, elapsed_s);
}

std::string RenderStatusLine(const StatusLineSnapshot& s) {
  if (!s.has_job) {
    return s.creating ? RenderCreationLine(*s.creating, s.creation_elapsed_s)
                      : std::string("serving, no job");
  }
  return absl::StrCat("job ", s.job_id, " (", s.model_name, "): ", s.steps_completed, " steps, ",
                      shm::ToString(s.step_state), ", ", s.ranks_attached, "/", s.world_size,
                      " ranks attached");
}

slidedp::v1::LayerStatus RenderLayer(const LayerSnapshot& s) {
  slidedp::v1::LayerStatus out;
  out.set_layer(s.index);
  out.set_name(s.name);
  out.set_kind(static_cast<slidedp::v1::LayerKind>(s.kind));
  out.set_numel(s.numel);
  out.set_version(s.version);
  out.set_state_bytes(3 * s.state_stride);
  out.set_param_bytes(shm::AlignUp(s.param_bytes, shm::kPayloadAlign));
  out.set_numa_node(s.numa_node);
  out.set_skipped_steps(s.skipped_steps);
  out.set_last_grad_norm(s.last_grad_norm);
  return out;
}

slidedp::v1::JobStatus RenderJob(const JobSnapshot& s) {
  slidedp::v1::JobStatus js;
  js.set_job_id(s.spec.job_id());
  js.set_model_name(s.model_name);
  js.set_family(s.family);
  js.set_world_size(s.spec.world_size());
  js.set_step(s.steps_completed);
  js.set_step_state(shm::ToString(s.step_state));
  js.set_total_params(s.total_params);
  js.set_manifest_hash(s.manifest_hash);
  *js.mutable_routes() = s.spec.routes();
  if (s.grad_route != slidedp::v1::GRAD_ROUTE_UNSPECIFIED) {
    js.mutable_routes()->set_grad_route(s.grad_route);
  }
  js.set_grad_route_choice(s.grad_route_choice);
  *js.mutable_optimizer() = s.optimizer;
  js.set_current_lr(model::LearningRate(s.optimizer, s.next_step));
  js.set_weights_source(s.weights_source);
  for (uint32_t l : s.client_updated_layers) js.add_client_updated_layers(l);
  if (!s.resumed_from.empty()) {
    js.set_resumed_from(s.resumed_from);
    js.set_weights_source("checkpoint " + s.resumed_from);
  }
  js.set_checkpoint_dir(s.checkpoint_dir);
  if (!s.last_checkpoint.path.empty()) {
    js.set_last_checkpoint_step(s.last_checkpoint.step);
    js.set_last_checkpoint_path(s.last_checkpoint.path);
    js.set_last_checkpoint_age_s(static_cast<double>(s.now_unix_ms - s.last_checkpoint_unix_ms) /
                                 1000.0);
  }
  js.set_checkpoint_in_flight_step(s.checkpoint_in_flight_step);
  return js;
}

slidedp::v1::GetStatsResponse RenderStats(const StatsSnapshot& s) {
  const UpdateStats& ws = s.worker;
  slidedp::v1::GetStatsResponse resp;
  resp.set_steps_completed(s.steps_completed);
  resp.set_steps_aborted(s.steps_aborted);
  resp.set_layer_updates(ws.layer_updates);
  resp.set_layer_updates_skipped(ws.layer_updates_skipped);
  resp.set_update_seconds_total(ws.update_seconds_total);
  resp.set_last_step_update_seconds(s.last_step_update_seconds);
  resp.set_update_params_total(ws.params_updated);
  if (s.last_step_update_seconds > 0) {
    const double gps = static_cast<double>(s.total_params) / s.last_step_update_seconds / 1e9;
    resp.set_update_gparams_per_second(gps);
    // Per parameter: read master, m, v and the gradient, write master, m, v and the BF16 copy.
    resp.set_update_gbytes_per_second(gps * (s.fp32_grads ? 32.0 : 28.0));
  }
  resp.set_isa(s.isa);
  resp.set_update_threads(s.update_threads);
  resp.set_layer_updates_streamed(ws.layer_updates_streamed);
  resp.set_layer_updates_buffered(ws.layer_updates_buffered);
  resp.set_layers_torn(ws.layers_torn);
  double first = 0, last = 0, idle = 0;
  for (const LayerUpdateResult& l : s.last_step_layers) {
    slidedp::v1::LayerUpdateSpan* span = resp.add_last_step_layers();
    span->set_layer(l.layer);
    span->set_start_s(l.start_s);
    span->set_end_s(l.end_s);
    span->set_busy_seconds(l.seconds);
    span->set_idle_before_seconds(l.idle_before_seconds);
    if (first == 0 || l.start_s < first) first = l.start_s;
    last = std::max(last, l.end_s);
    idle += l.idle_before_seconds;
  }
  resp.set_last_step_span_seconds(last - first);
  resp.set_last_step_idle_seconds(idle);
  resp.set_last_step(s.last_step);
  resp.set_last_step_seconds(s.last_step_seconds);
  resp.set_step_seconds_sum(s.step_seconds_sum);
  for (double b : s.step_seconds_bounds) resp.add_step_seconds_bounds(b);
  for (uint64_t n : s.step_seconds_buckets) resp.add_step_seconds_buckets(n);
  resp.set_grad_bytes_received(s.grad_bytes_received);
  resp.set_param_bytes_published(s.param_bytes_published);
  // The checkpointer's last commit (step 0 and age -1 before the first).
  const bool committed = s.last_checkpoint_unix_ms > 0;
  resp.set_checkpoint_last_step(committed ? s.last_checkpoint_step : 0);
  resp.set_checkpoint_age_seconds(
      committed ? static_cast<double>(s.now_unix_ms - s.last_checkpoint_unix_ms) / 1000.0 : -1.0);
  resp.set_exports_completed(s.exports_completed);
  resp.set_step_running(s.step_running);
  const CheckpointStats& cs = s.checkpoint;
  resp.set_checkpoint_stall_seconds(cs.stall_seconds);
  resp.set_checkpoint_snapshot_seconds(cs.snapshot_seconds);
  resp.set_checkpoint_bytes_written(cs.bytes_written);
  resp.set_checkpoints_committed(cs.checkpoints_committed);
  resp.set_checkpoints_failed(cs.checkpoints_failed);
  resp.set_last_checkpoint_seconds(cs.last_seconds);
  resp.set_last_checkpoint_mb_per_s(cs.last_mb_per_s);
  resp.set_checkpoint_layers_snapshotted(cs.layers_snapshotted);
  resp.set_checkpoint_layers_written_live(cs.layers_written_live);
  resp.set_checkpoint_pool_high_water_bytes(cs.pool_high_water_bytes);
  resp.set_checkpoint_layers_copied_by_writer(cs.layers_copied_by_writer);
  resp.set_checkpoint_pool_kept_bytes(cs.pool_kept_bytes);
  resp.set_checkpoint_pool_prepared_bytes(cs.pool_prepared_bytes);
  resp.set_checkpoint_pool_prepare_seconds(cs.pool_prepare_seconds);
  resp.set_checkpoint_snapshot_alloc_failures(cs.snapshot_alloc_failures);
  resp.set_checkpoint_snapshot_buffers_allocated(cs.snapshot_buffers_allocated);
  resp.set_checkpoint_bytes_written_direct(cs.bytes_written_direct);
  resp.set_checkpoint_paced_seconds(cs.paced_seconds);
  return resp;
}

}  // namespace slidedp::hostd
