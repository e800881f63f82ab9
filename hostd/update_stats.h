// The update worker's results and counters as plain values: what UpdateWorker reports per layer
// and in total (hostd/optimizer.h), and what Engine's reporting renders (hostd/engine_report.h)
// without depending on the worker.
#pragma once

#include <cstdint>

namespace slidedp::hostd {

struct LayerUpdateResult {
  uint32_t layer = 0;
  uint64_t step = 0;
  bool applied = false;  // false: skipped (non-finite) or aborted
  bool aborted = false;
  bool torn = false;      // aborted after part of a streamed layer was written (see above)
  bool streamed = false;  // updated range by range (BeginStreamedLayer)
  // Whole layers: the count of NaN/Inf elements. Streamed layers: 1 when a rank flagged its part
  // non-finite (the ranks send a flag, not a count), else 0.
  uint64_t nonfinite = 0;
  double grad_norm = 0;  // of the scaled (averaged) gradient; NaN when non-finite
  double clip_coef = 1;
  double seconds = 0;  // stats + update
  // When the worker began and finished this layer (steady_clock = CLOCK_MONOTONIC seconds, the
  // clock the ranks' time.monotonic()/perf_counter() read), and how long it sat with nothing to
  // do before this layer's pieces (its first range, or the whole layer): the pipeline's bubbles.
  double start_s = 0;
  double end_s = 0;
  double idle_before_seconds = 0;
};

struct UpdateStats {
  uint64_t layer_updates = 0;
  uint64_t layer_updates_skipped = 0;
  // Which path ran, applied and skipped layers alike: whole layers (Submit, UpdateLayerNow) or
  // range by range (BeginStreamedLayer); plus the ranges applied and the layers left torn.
  uint64_t layer_updates_buffered = 0;
  uint64_t layer_updates_streamed = 0;
  uint64_t ranges_streamed = 0;
  uint64_t layers_torn = 0;
  uint64_t params_updated = 0;
  double update_seconds_total = 0;
  double last_layer_seconds = 0;
};

}  // namespace slidedp::hostd
