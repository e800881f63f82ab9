// Rendering of hostd's query responses for slidedpctl: the --json documents (built on
// ProtoToJson) and the human tables (built on Table). Pure functions of the responses, so they
// are tested without a daemon. Thread-safe.
#pragma once

#include <ostream>

#include "google/protobuf/repeated_ptr_field.h"
#include "nlohmann/json.hpp"
#include "slidedp/v1/control.pb.h"
#include "slidedpctl/table.h"

namespace slidedp::ctl {

using LayerList = google::protobuf::RepeatedPtrField<v1::LayerStatus>;
using RankList = google::protobuf::RepeatedPtrField<v1::RankStatus>;

// One layer: the LayerStatus fields in declaration order, plus
// `bytes` = state_bytes + param_bytes inserted after `version`.
nlohmann::ordered_json LayerToJson(const v1::LayerStatus& layer);
nlohmann::ordered_json LayersToJson(const LayerList& layers);

// The `status --json` document: GetStatusResponse's fields (daemon, instance, socket, uptime_ms,
// job, layers, ranks, segments, topology, shm_bytes, locked_bytes) with `job` null when the
// daemon has no job (the message is unset) and each layer shaped by LayerToJson.
nlohmann::ordered_json StatusToJson(const v1::GetStatusResponse& status);

// The `version --json` document: {"client": BuildInfo, "daemon": BuildInfo or null,
// "error": null or the reason the daemon's BuildInfo is missing}.
nlohmann::ordered_json VersionToJson(const v1::BuildInfo& client, const v1::BuildInfo* daemon,
                                     const std::string& error);

// Columns LAYER NAME KIND PARAMS VERSION BYTES NUMA SKIPPED; sizes human-readable, numbers
// right-aligned.
Table LayersTable(const LayerList& layers);
// The ranks that are attached (ListRanks answers one entry per slot of the world size; a slot
// no rank holds is not a rank).
RankList AttachedRanks(const RankList& ranks);
// Columns RANK PID HOST GPU CONNECTED LAST_STEP HEARTBEAT, one row per attached rank.
Table RanksTable(const RankList& ranks);
// `ranks` for humans: RanksTable, or "no rank attached (world size N)" when none is.
void PrintRanks(const RankList& ranks, std::ostream& out);
// Columns KEY VALUE SOURCE.
Table ConfigTable(const v1::GetConfigResponse& config);
// Columns KEY VALUE: every GetStatsResponse field, doubles with 6 significant digits.
Table StatsTable(const v1::GetStatsResponse& stats);
// Columns ROLE COMPONENT VERSION GIT PROTOCOL SHM_ABI FEATURES; `daemon` may be null.
Table VersionTable(const v1::BuildInfo& client, const v1::BuildInfo* daemon);

// `status` for humans: a key/value summary (daemon, instance, socket, uptime, job, optimizer,
// shared memory, topology, ranks), a blank line, then LayersTable (or "no layers").
void PrintStatus(const v1::GetStatusResponse& status, std::ostream& out);

// JSON as slidedpctl prints it: two-space indent, invalid UTF-8 replaced, trailing newline.
void PrintJson(const nlohmann::ordered_json& json, std::ostream& out);

}  // namespace slidedp::ctl
