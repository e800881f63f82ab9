#include "slidedpctl/estimate.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/shm_abi.h"
#include "slidedpctl/format.h"
#include "slidedpctl/table.h"

namespace slidedp::ctl {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// Saturating arithmetic: an absurd batch must report TOO LARGE, not wrap around.
uint64_t Mul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? kMax : r;
}
uint64_t Add(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? kMax : r;
}
uint64_t Page(uint64_t v) { return v > kMax - shm::kPayloadAlign ? kMax : shm::AlignUp(v, 4096); }

std::string Show(uint64_t value, bool is_bytes) {
  if (value == kMax) return "overflow";
  return is_bytes ? FormatBytes(value) : absl::StrCat(value);
}

EstimateFigure Info(std::string key, std::string label, uint64_t value, bool is_bytes = true) {
  return EstimateFigure{
      std::move(key), std::move(label), value, is_bytes, std::nullopt, "", kVerdictInfo, 0};
}

EstimateFigure Checked(std::string key, std::string label, uint64_t value,
                       std::optional<uint64_t> limit, std::string against, bool is_bytes = true) {
  EstimateFigure f{std::move(key),     std::move(label),  value, is_bytes, limit,
                   std::move(against), kVerdictUnchecked, 0};
  if (limit) {
    if (value > *limit) {
      f.verdict = kVerdictTooLarge;
      f.over = value - *limit;
    } else {
      f.verdict = kVerdictOk;
    }
  }
  return f;
}

}  // namespace

absl::StatusOr<Estimate> ComputeEstimate(const model::LoadedModel& model,
                                         const EstimateInputs& inputs, const MachineInfo& machine) {
  const v1::ModelManifest& m = model.manifest;
  Estimate e;
  e.model_source = model.source;
  e.family = m.family();
  e.name = m.name();
  e.inputs = inputs;
  e.layers = static_cast<uint32_t>(m.layers_size());

  uint32_t nondec = 0;
  uint64_t state = shm::kHeaderBytes;
  uint64_t params = shm::kHeaderBytes;
  bool have_embed = false;
  for (const v1::LayerSpec& layer : m.layers()) {
    const uint64_t n = model::LayerNumel(layer);
    e.parameters = Add(e.parameters, n);
    // Exactly hostd's layout (hostd/state.cc): FP32 master, m, v each page-aligned, BF16 params
    // page-aligned, a 4 KiB header per segment.
    state = Add(state, Mul(3, Page(Mul(n, 4))));
    params = Add(params, Page(Mul(n, 2)));
    if (layer.kind() == v1::LAYER_KIND_DECODER) {
      ++e.decoder_layers;
    } else {
      ++nondec;
    }
    if (n > e.largest_layer_params) {
      e.largest_layer_params = n;
      e.largest_layer = layer.name();
    }
    const bool resident = inputs.nondecoder == NonDecoderPlacement::kResident &&
                          layer.kind() != v1::LAYER_KIND_DECODER;
    if (resident) {
      e.resident_params = Add(e.resident_params, n);
    } else if (n > e.largest_streamed_layer_params) {
      e.largest_streamed_layer_params = n;
      e.largest_streamed_layer = layer.name();
    }
    for (const v1::TensorSpec& t : layer.tensors()) {
      if (t.name() == "model.embed_tokens.weight" && t.shape_size() == 2) {
        e.vocab = static_cast<uint64_t>(t.shape(0));
        e.hidden = static_cast<uint64_t>(t.shape(1));
        have_embed = true;
      } else if (e.intermediate == 0 && absl::EndsWith(t.name(), "mlp.gate_proj.weight") &&
                 t.shape_size() == 2) {
        e.intermediate = static_cast<uint64_t>(t.shape(0));
      }
    }
  }
  if (!have_embed) {
    return absl::InvalidArgumentError(absl::StrCat(
        model.source, ": the manifest has no model.embed_tokens.weight [vocab, hidden]"));
  }
  if (e.intermediate == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        model.source, ": the manifest has no mlp.gate_proj.weight [intermediate, hidden]"));
  }
  state = Page(state);
  params = Page(params);
  const uint64_t control =
      Page(shm::ControlSegmentBytes(e.layers, inputs.gpus, kEstimateGradRingSlots));
  const uint64_t rings = Page(
      Add(shm::kHeaderBytes, Mul(Mul(inputs.gpus, kEstimateGradRingSlots), inputs.chunk_bytes)));
  const uint64_t shm_total = Add(Add(control, state), Add(params, rings));
  const uint64_t reduce_buffers = Mul(2, Mul(e.largest_layer_params, 4));
  const uint64_t host = Add(shm_total, reduce_buffers);

  const uint32_t streamed_nondec = inputs.nondecoder == NonDecoderPlacement::kStreamed ? nondec : 0;
  e.window_slots_default = inputs.window_slots == 0;
  e.window_slots =
      e.window_slots_default ? streamed_nondec + 2 * kEstimatePrefetch + 2 : inputs.window_slots;
  const uint64_t window = Mul(e.window_slots, Mul(e.largest_streamed_layer_params, 2));
  const uint64_t resident_gpu = Mul(e.resident_params, kEstimateResidentBytesPerParam);
  const uint64_t bs = Mul(inputs.batch, inputs.seq);
  const uint64_t checkpoints = Mul(Mul(e.decoder_layers, bs), Mul(e.hidden, 2));
  const uint64_t logits = Mul(bs, Mul(e.vocab, 10));
  const uint64_t recompute = Mul(bs, Mul(Add(Mul(4, e.hidden), Mul(3, e.intermediate)), 4));
  const uint64_t activations = Add(Add(checkpoints, logits), recompute);
  const uint64_t gpu_total = Add(Add(window, resident_gpu), activations);

  auto& f = e.figures;
  f.push_back(Info("parameters", "parameters", e.parameters, /*is_bytes=*/false));
  f.push_back(Info("state_bytes", "hostd state: FP32 master + Adam m, v (12 B/param)", state));
  f.push_back(Info("params_bytes", "hostd params: BF16 copy (2 B/param)", params));
  f.push_back(Info("control_bytes", "hostd control segment", control));
  f.push_back(
      Info("grad_ring_bytes",
           absl::StrCat("gradient rings: ", inputs.gpus, " ranks x ", kEstimateGradRingSlots,
                        " slots x ", FormatBytes(inputs.chunk_bytes)),
           rings));
  f.push_back(Checked(
      "shm_bytes", "hostd shared memory (total)", shm_total,
      machine.have_dev_shm ? std::optional<uint64_t>(machine.dev_shm_free) : std::nullopt,
      machine.have_dev_shm ? absl::StrCat("/dev/shm free ", FormatBytes(machine.dev_shm_free),
                                          " of ", FormatBytes(machine.dev_shm_size))
                           : "/dev/shm not found"));
  {
    std::optional<uint64_t> limit;
    std::string against = "RLIMIT_MEMLOCK unknown";
    if (machine.have_memlock && machine.memlock_unlimited) {
      limit = kMax;
      against = machine.memlock_by_capability
                    ? absl::StrCat("memlock unlimited (CAP_IPC_LOCK; RLIMIT_MEMLOCK ",
                                   FormatBytes(machine.memlock_rlimit), " does not apply)")
                    : "memlock limit unlimited";
    } else if (machine.have_memlock) {
      limit = machine.memlock_limit;
      against = absl::StrCat("memlock limit ", FormatBytes(machine.memlock_limit));
    }
    f.push_back(Checked("pinned_bytes", "pinned (mlocked) by hostd", shm_total, limit, against));
  }
  f.push_back(Checked(
      "host_bytes", "host memory: shared memory + 2 FP32 reduce buffers", host,
      machine.have_meminfo ? std::optional<uint64_t>(machine.mem_available) : std::nullopt,
      machine.have_meminfo ? absl::StrCat("MemAvailable ", FormatBytes(machine.mem_available))
                           : "/proc/meminfo unreadable"));
  // Not in host_bytes: the auto pool is sized at each checkpoint's start from MemAvailable
  // (the state's size when it fits with an eighth of MemAvailable left), so it never makes the
  // start fail, but with checkpoint.keep_snapshot_pool it stays allocated between checkpoints
  // (and with checkpoint.prepare_snapshot_pool it is allocated after the job's first step).
  f.push_back(Info("checkpoint_pool_bytes",
                   "checkpoint snapshot pool, at most (from the first step, with checkpoint.dir)",
                   state));
  f.push_back(
      Checked("gpus", "GPUs (ranks)", inputs.gpus,
              machine.nvidia_driver ? std::optional<uint64_t>(machine.gpus.size()) : std::nullopt,
              machine.nvidia_driver ? absl::StrCat(machine.gpus.size(), " NVIDIA GPUs here")
                                    : "no NVIDIA driver here",
              /*is_bytes=*/false));
  const std::string gpu_against = inputs.gpu_memory
                                      ? absl::StrCat("GPU memory ", FormatBytes(*inputs.gpu_memory),
                                                     " (", inputs.gpu_memory_source, ")")
                                      : "GPU memory unknown (pass --gpu-memory)";
  f.push_back(Checked("window_bytes",
                      absl::StrCat("GPU window per rank: ", e.window_slots, " slots x ",
                                   e.largest_streamed_layer, " x 2 B"),
                      window, inputs.gpu_memory, gpu_against));
  if (inputs.nondecoder == NonDecoderPlacement::kResident) {
    f.push_back(Checked("resident_bytes",
                        absl::StrCat("resident non-decoder layers per rank (", nondec, " layers x ",
                                     kEstimateResidentBytesPerParam, " B/param)"),
                        resident_gpu, inputs.gpu_memory, gpu_against));
  }
  f.push_back(Checked("activation_bytes", "activations per rank (rough estimate, full recompute)",
                      activations, inputs.gpu_memory, gpu_against));
  f.push_back(Checked("gpu_total_bytes",
                      inputs.nondecoder == NonDecoderPlacement::kResident
                          ? "per-GPU total: window + resident layers + activations"
                          : "per-GPU total: window + activations",
                      gpu_total, inputs.gpu_memory, gpu_against));
  e.fits = std::none_of(f.begin(), f.end(),
                        [](const EstimateFigure& x) { return x.verdict == kVerdictTooLarge; });
  return e;
}

nlohmann::ordered_json EstimateToJson(const Estimate& e, const MachineInfo& machine) {
  using J = nlohmann::ordered_json;
  J j;
  j["model"] = J{{"source", e.model_source},
                 {"family", e.family},
                 {"name", e.name},
                 {"parameters", e.parameters},
                 {"layers", e.layers},
                 {"decoder_layers", e.decoder_layers},
                 {"hidden", e.hidden},
                 {"intermediate", e.intermediate},
                 {"vocab", e.vocab},
                 {"largest_layer", e.largest_layer},
                 {"largest_layer_params", e.largest_layer_params},
                 {"largest_streamed_layer", e.largest_streamed_layer},
                 {"largest_streamed_layer_params", e.largest_streamed_layer_params},
                 {"resident_params", e.resident_params}};
  j["inputs"] = J{{"gpus", e.inputs.gpus},
                  {"batch", e.inputs.batch},
                  {"seq", e.inputs.seq},
                  {"nondecoder",
                   e.inputs.nondecoder == NonDecoderPlacement::kResident ? "resident" : "streamed"},
                  {"window_slots", e.window_slots},
                  {"window_slots_default", e.window_slots_default},
                  {"chunk_bytes", e.inputs.chunk_bytes},
                  {"grad_ring_slots", kEstimateGradRingSlots},
                  {"gpu_memory_bytes", e.inputs.gpu_memory ? J(*e.inputs.gpu_memory) : J(nullptr)},
                  {"gpu_memory_source", e.inputs.gpu_memory_source}};
  auto opt = [](bool have, uint64_t v) { return have ? J(v) : J(nullptr); };
  j["machine"] = J{{"mem_total_bytes", opt(machine.have_meminfo, machine.mem_total)},
                   {"mem_available_bytes", opt(machine.have_meminfo, machine.mem_available)},
                   {"memlock_unlimited", machine.have_memlock && machine.memlock_unlimited},
                   {"memlock_limit_bytes",
                    opt(machine.have_memlock && !machine.memlock_unlimited, machine.memlock_limit)},
                   {"memlock_by_capability", machine.memlock_by_capability},
                   {"dev_shm_size_bytes", opt(machine.have_dev_shm, machine.dev_shm_size)},
                   {"dev_shm_free_bytes", opt(machine.have_dev_shm, machine.dev_shm_free)},
                   {"nvidia_gpus", machine.nvidia_driver ? J(machine.gpus.size()) : J(nullptr)}};
  J figures = J::object();
  for (const EstimateFigure& f : e.figures) {
    figures[f.key] = J{{"label", f.label},
                       {"value", f.value},
                       {"unit", f.is_bytes ? "bytes" : "count"},
                       {"limit", f.limit && *f.limit != kMax ? J(*f.limit) : J(nullptr)},
                       {"against", f.against},
                       {"verdict", f.verdict},
                       {"over", f.over}};
  }
  j["figures"] = std::move(figures);
  j["verdict"] = e.fits ? kVerdictOk : kVerdictTooLarge;
  return j;
}

void PrintEstimate(const Estimate& e, std::ostream& out) {
  Table summary = Table::KeyValue();
  summary.AddRow({"model", absl::StrCat(e.name, " (", e.family, ", ", e.model_source, ")")});
  summary.AddRow({"shape", absl::StrCat(e.decoder_layers, " decoder layers, hidden ", e.hidden,
                                        ", intermediate ", e.intermediate, ", vocab ", e.vocab)});
  summary.AddRow(
      {"plan", absl::StrCat(e.inputs.gpus, " GPUs, batch ", e.inputs.batch, " per rank, seq ",
                            e.inputs.seq, ", ", e.window_slots, " window slots",
                            e.window_slots_default ? " (default)" : "")});
  summary.Print(out);
  out << '\n';
  Table t({{"FIGURE"}, {"NEED", Table::Align::kRight}, {"AGAINST"}, {"VERDICT"}});
  for (const EstimateFigure& f : e.figures) {
    std::string verdict = f.verdict;
    if (f.verdict == kVerdictTooLarge) {
      absl::StrAppend(&verdict, " by ", Show(f.over, f.is_bytes));
    }
    t.AddRow({f.label, Show(f.value, f.is_bytes), f.against, verdict});
  }
  t.Print(out);
  out << "\nactivations are a rough estimate (full recompute; no CUDA context, allocator slack or "
         "optimizer-side buffers)\n";
  if (e.fits) {
    out << "overall: OK\n";
  } else {
    std::vector<std::string> names;
    for (const EstimateFigure& f : e.figures) {
      if (f.verdict == kVerdictTooLarge) names.push_back(f.key);
    }
    out << "overall: TOO LARGE (" << absl::StrJoin(names, ", ") << ")\n";
  }
}

}  // namespace slidedp::ctl
