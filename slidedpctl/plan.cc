#include "slidedpctl/plan.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/layout.h"
#include "model/manifest.h"
#include "slidedpctl/exit_codes.h"
#include "slidedpctl/format.h"
#include "slidedpctl/render.h"
#include "slidedpctl/table.h"

namespace slidedp::ctl {
namespace {

using Json = nlohmann::ordered_json;

absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string Sec(double s) { return absl::StrFormat("%.3f s", s); }
std::string Bytes(double b) { return FormatBytes(static_cast<uint64_t>(std::llround(b))); }
std::string Gb(double b) { return absl::StrFormat("%.2f GB", b / 1e9); }
std::string Rate(double tokens_per_s) { return absl::StrFormat("%.0f", tokens_per_s); }
std::string Batch(double b) {
  return b == std::floor(b) ? absl::StrFormat("%.0f", b) : absl::StrFormat("%.2f", b);
}

Json PredictionToJson(const model::StepPrediction& p) {
  Json host = Json::object();
  for (const model::HostResource& h : p.host) {
    host[h.key] = Json{{"label", h.label}, {"bytes", h.bytes}, {"seconds", h.seconds}};
  }
  return Json{
      {"compute",
       {{"forward_flops", p.forward_flops},
        {"backward_flops", p.backward_flops},
        {"replay_flops", p.replay_flops},
        {"attention_flops", p.attention_flops},
        {"lm_head_flops", p.lm_head_flops},
        {"flops_s", p.compute_flops_s},
        {"resident_update_s", p.resident_update_s},
        {"replayed_layers", p.replayed_layers},
        {"c_s", p.compute_s}}},
      {"host",
       {{"resources", std::move(host)},
        {"binding", p.binding},
        {"h_s", p.host_s},
        {"streamed_layers", p.streamed_layers},
        {"refetched_layers", p.refetched_layers}}},
      {"exposure",
       {{"first_fetch_s", p.first_fetch_s},
        {"last_update_s", p.last_update_s},
        {"overhead_s", p.overhead_s},
        {"e_s", p.exposure_s}}},
      {"step_s", p.step_s},
      {"regime", p.regime},
      {"tokens_per_s", p.tokens_per_s},
      {"memory",
       {{"estimate", true},
        {"window_bytes", p.window_bytes},
        {"resident_bytes", p.resident_bytes},
        {"activation_bytes", p.activation_bytes},
        {"replay_bytes", p.replay_bytes},
        {"logits_bytes", p.logits_bytes},
        {"peak_gpu_bytes", p.peak_gpu_bytes}}},
      {"pcie",
       {{"h2d_bytes", p.h2d_bytes},
        {"d2h_bytes", p.d2h_bytes},
        {"offloaded_bytes_per_rank", p.offloaded_bytes},
        {"gb_per_step", p.pcie_bytes / 1e9}}},
  };
}

Json ScalingRowToJson(const model::ScalingRow& row, double batch, uint64_t seq) {
  const auto summary = [&](const model::StepPrediction& p, double batch) {
    return Json{{"batch_per_rank", batch},
                {"global_batch", batch * row.gpus},
                {"tokens", batch * row.gpus * static_cast<double>(seq)},
                {"c_s", p.compute_s},
                {"h_s", p.host_s},
                {"binding", p.binding},
                {"e_s", p.exposure_s},
                {"step_s", p.step_s},
                {"regime", p.regime},
                {"tokens_per_s", p.tokens_per_s}};
  };
  return Json{{"gpus", row.gpus},
              {"weak", summary(row.weak, batch)},
              {"strong", row.strong ? summary(*row.strong, row.strong_batch) : Json(nullptr)}};
}

}  // namespace

Json PlanToJson(const model::StepPlan& plan) {
  const model::ModelShape& s = plan.shape;
  Json j;
  j["model"] = Json{{"name", s.name},
                    {"family", s.family},
                    {"decoder_layers", s.decoder_params.size()},
                    {"hidden", s.hidden},
                    {"intermediate", s.intermediate},
                    {"heads", s.heads},
                    {"kv_heads", s.kv_heads},
                    {"head_dim", s.head_dim},
                    {"q_dim", s.q_dim},
                    {"kv_dim", s.kv_dim},
                    {"vocab", s.vocab},
                    {"tied", s.tied},
                    {"decoder_params", s.decoder_params_total},
                    {"nondecoder_params", s.nondecoder_params}};
  j["inputs"] = Json{{"gpus", plan.inputs.gpus},
                     {"batch", plan.inputs.batch},
                     {"seq", plan.inputs.seq},
                     {"tokens_per_rank", plan.inputs.batch * static_cast<double>(plan.inputs.seq)},
                     {"layout", model::FormatLayout(plan.inputs.layout)},
                     {"window_slots", plan.inputs.window_slots},
                     {"grad_route", model::GradRouteName(plan.inputs.route)}};
  j["profile"] = model::ProfileToJson(plan.profile);
  Json at = PredictionToJson(plan.at);
  for (auto& [key, value] : at.items()) j[key] = std::move(value);
  j["r_cross"] = Json{{"c1_s", plan.c1_s},
                      {"h1_s", plan.h1_s},
                      {"r_cross", plan.r_cross},
                      {"formula", "C(1) / H(1): the global batch on one GPU"}};
  Json rows = Json::array();
  for (const model::ScalingRow& row : plan.scaling) {
    rows.push_back(ScalingRowToJson(row, plan.inputs.batch, plan.inputs.seq));
  }
  j["scaling"] = std::move(rows);
  return j;
}

void PrintPlan(const model::StepPlan& plan, std::ostream& out) {
  const model::ModelShape& s = plan.shape;
  const model::StepPrediction& p = plan.at;
  Table summary = Table::KeyValue();
  summary.AddRow({"model", absl::StrCat(s.name, " (", s.family, ")")});
  summary.AddRow(
      {"shape", absl::StrCat(s.decoder_params.size(), " decoder layers, hidden ", s.hidden,
                             ", intermediate ", s.intermediate, ", q ", s.q_dim, ", kv ", s.kv_dim,
                             ", vocab ", s.vocab, s.tied ? " (tied)" : "")});
  summary.AddRow(
      {"plan", absl::StrCat(plan.inputs.gpus, " GPUs, batch ", Batch(plan.inputs.batch),
                            " per rank, seq ", plan.inputs.seq, ", ", plan.inputs.window_slots,
                            " window slots, ", Av(model::GradRouteName(plan.inputs.route)))});
  summary.AddRow({"layout", model::FormatLayout(plan.inputs.layout)});
  summary.AddRow({"profile", plan.profile.name});
  summary.Print(out);
  out << '\n';
  Table t({{"FIGURE"}, {"VALUE", Table::Align::kRight}, {"NOTE"}});
  t.AddRow(
      {"C  GPU compute", Sec(p.compute_s),
       absl::StrFormat("%.1f TFLOP per rank (replay %.1f) at %.0f TFLOP/s + resident "
                       "AdamW %.3f s",
                       (p.forward_flops + p.backward_flops + p.replay_flops) / 1e12,
                       p.replay_flops / 1e12, plan.profile.gpu_bf16_tflops, p.resident_update_s)});
  for (const model::HostResource& h : p.host) {
    t.AddRow({absl::StrCat("H  ", h.label), Sec(h.seconds),
              absl::StrCat(Gb(h.bytes), h.key == p.binding ? "  (binds)" : "")});
  }
  t.AddRow({"H  host/transfer bottleneck", Sec(p.host_s), p.binding});
  t.AddRow({"E  exposure", Sec(p.exposure_s),
            absl::StrFormat("first fetch %.4f + last update %.4f + %.4f overhead", p.first_fetch_s,
                            p.last_update_s, p.overhead_s)});
  t.AddRow({"T  step = max(C, H) + E", Sec(p.step_s), p.regime});
  t.AddRow({"tokens/s", Rate(p.tokens_per_s), "all ranks"});
  t.AddRow({"peak GPU memory per rank (estimate)", Bytes(p.peak_gpu_bytes),
            absl::StrCat("window ", Bytes(p.window_bytes), " + resident ", Bytes(p.resident_bytes),
                         " + activations ", Bytes(p.activation_bytes), " + replay ",
                         Bytes(p.replay_bytes), " + logits ", Bytes(p.logits_bytes))});
  t.AddRow({"PCIe per step", Gb(p.pcie_bytes),
            absl::StrCat("H2D ", Gb(p.h2d_bytes), " + D2H ", Gb(p.d2h_bytes))});
  t.AddRow({"R_cross = C(1) / H(1)", absl::StrFormat("%.2f", plan.r_cross),
            absl::StrFormat("C(1) %.3f s for the global batch on one GPU, H(1) %.3f s", plan.c1_s,
                            plan.h1_s)});
  t.Print(out);
  out << '\n';
  Table r({{"GPUS", Table::Align::kRight},
           {"WEAK B/RANK", Table::Align::kRight},
           {"WEAK T", Table::Align::kRight},
           {"WEAK REGIME"},
           {"WEAK TOK/S", Table::Align::kRight},
           {"STRONG B/RANK", Table::Align::kRight},
           {"STRONG T", Table::Align::kRight},
           {"STRONG REGIME"},
           {"STRONG TOK/S", Table::Align::kRight}});
  for (const model::ScalingRow& row : plan.scaling) {
    std::vector<std::string> cells = {absl::StrCat(row.gpus), Batch(plan.inputs.batch),
                                      Sec(row.weak.step_s), row.weak.regime,
                                      Rate(row.weak.tokens_per_s)};
    if (row.strong) {
      cells.insert(cells.end(), {Batch(row.strong_batch), Sec(row.strong->step_s),
                                 row.strong->regime, Rate(row.strong->tokens_per_s)});
    } else {
      cells.insert(cells.end(), {Batch(row.strong_batch), "-", "-", "-"});
    }
    r.AddRow(std::move(cells));
  }
  r.Print(out);
  out << "\nT ~ max(C, H) + E (paper section 3.4); memory is an estimate (no CUDA context, "
         "allocator "
         "slack or temporaries)\n";
}

int RunPlan(const PlanOptions& o, bool json, std::ostream& out, std::ostream& err) {
  absl::StatusOr<model::LoadedModel> loaded = model::LoadModel(o.model);
  if (!loaded.ok()) {
    err << "slidedpctl: --model: " << loaded.status().message() << '\n';
    return kExitUsage;
  }
  absl::StatusOr<model::ModelShape> shape = model::ShapeFromModel(*loaded);
  if (!shape.ok()) {
    err << "slidedpctl: --model: " << shape.status().message() << '\n';
    return kExitUsage;
  }
  const uint32_t layers = static_cast<uint32_t>(shape->decoder_params.size());
  absl::StatusOr<std::vector<model::LayerPolicy>> layout =
      model::ParseLayout(o.layout.empty() ? model::DefaultLayout(layers) : o.layout, layers);
  if (!layout.ok()) {
    err << "slidedpctl: --layout: " << layout.status().message() << '\n';
    return kExitUsage;
  }
  model::HardwareProfile profile = model::BuiltinH200Profile();
  if (!o.profile.empty()) {
    std::ifstream in(o.profile);
    std::stringstream text;
    if (in) text << in.rdbuf();
    if (!in || in.bad()) {
      err << "slidedpctl: --profile: " << o.profile
          << ": cannot read it; expected a JSON file of profile keys\n";
      return kExitUsage;
    }
    absl::StatusOr<model::HardwareProfile> p =
        model::ProfileFromJson(text.str(), profile, o.profile);
    if (!p.ok()) {
      err << "slidedpctl: --profile: " << p.status().message() << '\n';
      return kExitUsage;
    }
    profile = *std::move(p);
  }
  model::StepInputs inputs;
  inputs.gpus = o.gpus;
  inputs.batch = static_cast<double>(o.batch);
  inputs.seq = o.seq;
  inputs.layout = *std::move(layout);
  inputs.window_slots = o.window_slots;
  inputs.route = o.grad_route == "cpu_reduction" ? model::GradRoute::kCpuReduction
                                                 : model::GradRoute::kGpuReduction;
  absl::StatusOr<model::StepPlan> plan = model::PlanStep(*shape, inputs, profile);
  if (!plan.ok()) {
    err << "slidedpctl: --" << plan.status().message() << '\n';
    return kExitUsage;
  }
  if (json) {
    PrintJson(PlanToJson(*plan), out);
  } else {
    PrintPlan(*plan, out);
  }
  return kExitOk;
}

}  // namespace slidedp::ctl
