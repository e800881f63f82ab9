#include "slidedpctl/render.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "slidedpctl/format.h"
#include "slidedpctl/json_convert.h"

namespace slidedp::ctl {
namespace {

using nlohmann::ordered_json;
using Align = Table::Align;

// "1 segment", "2 segments".
std::string Counted(int n, absl::string_view noun) {
  return absl::StrCat(n, " ", noun, n == 1 ? "" : "s");
}

std::string DescribeBuild(const v1::BuildInfo& info, absl::string_view fallback_component) {
  return absl::StrFormat("%s %s (git %s, protocol %d, shm abi %d)",
                         info.component().empty() ? fallback_component : info.component(),
                         info.version().empty() ? "?" : info.version(),
                         info.git_revision().empty() ? "?" : info.git_revision(),
                         info.protocol_version(), info.shm_abi_version());
}

std::string DescribeJob(const v1::JobStatus& job) {
  return absl::StrFormat("%s: %s (%s), world size %d, step %d (%s), %s params", job.job_id(),
                         job.model_name(), job.family(), job.world_size(), job.step(),
                         job.step_state(), FormatCount(job.total_params()));
}

std::string DescribeOptimizer(const v1::JobStatus& job) {
  const v1::OptimizerConfig& opt = job.optimizer();
  std::string text = absl::StrFormat(
      "lr %g (now %g), %s schedule, warmup %d, betas %g/%g, eps %g, weight decay %g", opt.lr(),
      job.current_lr(), ShortEnumName(v1::LrScheduleKind_descriptor(), opt.schedule()),
      opt.warmup_steps(), opt.beta1(), opt.beta2(), opt.eps(), opt.weight_decay());
  absl::StrAppend(&text, ", clip ", ShortEnumName(v1::ClipPolicy_descriptor(), opt.clip()));
  if (opt.clip() == v1::CLIP_POLICY_PER_LAYER || opt.clip() == v1::CLIP_POLICY_GLOBAL) {
    absl::StrAppend(&text, absl::StrFormat(" at %g", opt.max_grad_norm()));
  }
  return text;
}

std::string DescribeRoutes(const v1::Routes& routes) {
  return absl::StrCat("params ", ShortEnumName(v1::ParamRoute_descriptor(), routes.param_route()),
                      ", grads ", ShortEnumName(v1::GradRoute_descriptor(), routes.grad_route()),
                      ", chunk ",
                      routes.chunk_bytes() == 0 ? "default" : FormatBytes(routes.chunk_bytes()));
}

std::string DescribeTopology(const v1::TopologyInfo& topo) {
  return absl::StrCat(Counted(topo.numa_nodes(), "NUMA node"), ", ", Counted(topo.cores(), "core"),
                      ", state on node ", FormatIndexOrDash(topo.state_numa_node()), ", ",
                      Counted(topo.worker_cpus_size(), "worker CPU"), ", ",
                      Counted(topo.gpus_size(), "GPU"));
}

}  // namespace

ordered_json LayerToJson(const v1::LayerStatus& layer) {
  ordered_json fields = ProtoToJson(layer);
  ordered_json shaped = ordered_json::object();
  for (auto& [key, value] : fields.items()) {
    shaped[key] = std::move(value);
    if (key == "version") shaped["bytes"] = layer.state_bytes() + layer.param_bytes();
  }
  return shaped;
}

ordered_json LayersToJson(const LayerList& layers) {
  ordered_json array = ordered_json::array();
  for (const v1::LayerStatus& layer : layers) array.push_back(LayerToJson(layer));
  return array;
}

ordered_json StatusToJson(const v1::GetStatusResponse& status) {
  ordered_json json = ProtoToJson(status);  // no job: the message is unset, so `job` is null
  json["layers"] = LayersToJson(status.layers());
  return json;
}

ordered_json VersionToJson(const v1::BuildInfo& client, const v1::BuildInfo* daemon,
                           const std::string& error) {
  ordered_json json = ordered_json::object();
  json["client"] = ProtoToJson(client);
  json["daemon"] = daemon == nullptr ? ordered_json(nullptr) : ProtoToJson(*daemon);
  json["error"] = error.empty() ? ordered_json(nullptr) : ordered_json(error);
  return json;
}

Table LayersTable(const LayerList& layers) {
  std::vector<Table::Column> columns = {{"LAYER", Align::kRight},   {"NAME", Align::kLeft},
                                        {"KIND", Align::kLeft},     {"PARAMS", Align::kRight},
                                        {"VERSION", Align::kRight}, {"BYTES", Align::kRight},
                                        {"NUMA", Align::kRight},    {"SKIPPED", Align::kRight}};
  const bool checksums = !layers.empty() && !layers.begin()->checksum().empty();
  if (checksums) columns.push_back({"CHECKSUM", Align::kLeft});
  Table table(std::move(columns));
  for (const v1::LayerStatus& layer : layers) {
    std::vector<std::string> row = {absl::StrCat(layer.layer()),
                                    layer.name(),
                                    ShortEnumName(v1::LayerKind_descriptor(), layer.kind()),
                                    absl::StrCat(layer.numel()),
                                    absl::StrCat(layer.version()),
                                    FormatBytes(layer.state_bytes() + layer.param_bytes()),
                                    FormatIndexOrDash(layer.numa_node()),
                                    absl::StrCat(layer.skipped_steps())};
    if (checksums) row.push_back(layer.checksum());
    table.AddRow(row);
  }
  return table;
}

RankList AttachedRanks(const RankList& ranks) {
  RankList attached;
  for (const v1::RankStatus& rank : ranks) {
    if (rank.attached()) *attached.Add() = rank;
  }
  return attached;
}

Table RanksTable(const RankList& ranks) {
  Table table({{"RANK", Align::kRight},
               {"PID", Align::kRight},
               {"HOST", Align::kLeft},
               {"GPU", Align::kRight},
               {"CONNECTED", Align::kLeft},
               {"LAST_STEP", Align::kRight},
               {"HEARTBEAT", Align::kRight}});
  for (const v1::RankStatus& rank : ranks) {
    if (!rank.attached()) continue;
    table.AddRow({absl::StrCat(rank.rank()), absl::StrCat(rank.pid()), rank.hostname(),
                  rank.gpu() < 0 ? "cpu" : absl::StrCat(rank.gpu()),
                  rank.connected() ? "yes" : "no", absl::StrCat(rank.last_step()),
                  absl::StrCat(FormatDurationMs(rank.ms_since_heartbeat()), " ago")});
  }
  return table;
}

void PrintRanks(const RankList& ranks, std::ostream& out) {
  if (AttachedRanks(ranks).empty()) {
    out << "no rank attached (world size " << ranks.size() << ")\n";
    return;
  }
  RanksTable(ranks).Print(out);
}

Table ConfigTable(const v1::GetConfigResponse& config) {
  Table table({{"KEY", Align::kLeft}, {"VALUE", Align::kLeft}, {"SOURCE", Align::kLeft}});
  for (const v1::ConfigEntry& entry : config.entries()) {
    table.AddRow({entry.key(), entry.value(), entry.source()});
  }
  return table;
}

Table StatsTable(const v1::GetStatsResponse& stats) {
  Table table({{"KEY", Align::kLeft}, {"VALUE", Align::kRight}});
  const ordered_json fields = ProtoToJson(stats);
  for (const auto& [key, value] : fields.items()) {
    std::string text;
    if (value.is_array()) {  // per-layer spans: too long for a table
      text = absl::StrCat(value.size(), " entries (--json lists them)");
    } else if (value.is_string()) {
      text = value.get<std::string>();
    } else if (value.is_number_float()) {
      text = absl::StrFormat("%.6g", value.get<double>());
    } else {
      text = value.dump();
    }
    table.AddRow({key, std::move(text)});
  }
  return table;
}

Table VersionTable(const v1::BuildInfo& client, const v1::BuildInfo* daemon) {
  Table table({{"ROLE", Align::kLeft},
               {"COMPONENT", Align::kLeft},
               {"VERSION", Align::kLeft},
               {"GIT", Align::kLeft},
               {"PROTOCOL", Align::kRight},
               {"SHM_ABI", Align::kRight},
               {"FEATURES", Align::kLeft}});
  auto add = [&table](std::string role, const v1::BuildInfo& info) {
    table.AddRow({std::move(role), info.component(), info.version(), info.git_revision(),
                  absl::StrCat(info.protocol_version()), absl::StrCat(info.shm_abi_version()),
                  info.features().empty() ? "-" : absl::StrJoin(info.features(), ",")});
  };
  add("client", client);
  if (daemon != nullptr) add("daemon", *daemon);
  return table;
}

void PrintStatus(const v1::GetStatusResponse& status, std::ostream& out) {
  Table summary = Table::KeyValue();
  summary.AddRow({"daemon", DescribeBuild(status.daemon(), "hostd")});
  summary.AddRow({"instance", status.instance()});
  summary.AddRow({"socket", status.socket()});
  summary.AddRow({"uptime", FormatDurationMs(status.uptime_ms())});
  if (status.has_job()) {
    summary.AddRow({"job", DescribeJob(status.job())});
    if (!status.job().weights_source().empty()) {
      summary.AddRow({"weights", status.job().weights_source()});
    }
    summary.AddRow({"optimizer", DescribeOptimizer(status.job())});
    std::string routes = DescribeRoutes(status.job().routes());
    if (!status.job().grad_route_choice().empty() && status.job().grad_route_choice() != "set") {
      absl::StrAppend(&routes, " (grads ", status.job().grad_route_choice(), ")");
    }
    summary.AddRow({"routes", routes});
  } else if (status.has_creating()) {
    const v1::JobCreation& c = status.creating();
    std::string progress;
    if (c.total() > 0) {
      progress = c.unit() == "bytes"
                     ? absl::StrCat(" ", FormatBytes(c.done()), " of ", FormatBytes(c.total()))
                     : absl::StrCat(" ", c.done(), " of ", c.total(), " ", c.unit());
    }
    summary.AddRow({"job", absl::StrFormat("%s: being created, %s%s (%.0f s)", c.job_id(),
                                           c.phase(), progress, c.elapsed_s())});
  } else {
    summary.AddRow({"job", "none"});
  }
  summary.AddRow({"shm", absl::StrCat(FormatBytes(status.shm_bytes()), " in ",
                                      Counted(status.segments_size(), "segment"), ", ",
                                      FormatBytes(status.locked_bytes()), " locked")});
  summary.AddRow({"topology", DescribeTopology(status.topology())});
  int connected = 0, attached = 0;
  for (const v1::RankStatus& rank : status.ranks()) {
    connected += rank.connected() ? 1 : 0;
    attached += rank.attached() ? 1 : 0;
  }
  summary.AddRow({"ranks", absl::StrFormat("%d of %d attached, %d connected", attached,
                                           status.ranks_size(), connected)});
  summary.Print(out);
  out << '\n';
  if (status.layers().empty()) {
    out << "no layers\n";
  } else {
    LayersTable(status.layers()).Print(out);
  }
}

void PrintJson(const ordered_json& json, std::ostream& out) {
  out << json.dump(2, ' ', false, ordered_json::error_handler_t::replace) << '\n';
}

}  // namespace slidedp::ctl
