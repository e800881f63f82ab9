#include "slidedpctl/cleanup.h"

#include "absl/strings/str_cat.h"
#include "common/instance_files.h"
#include "nlohmann/json.hpp"
#include "slidedpctl/ctl.h"

namespace slidedp::ctl {

int RunCleanup(const std::string& instance, bool dry_run, bool json, std::ostream& out,
               std::ostream& err) {
  absl::StatusOr<std::vector<InstanceFiles>> listed = ListInstanceFiles(instance);
  if (!listed.ok()) {
    err << "slidedpctl: cleanup: " << listed.status().message() << '\n';
    return absl::IsInvalidArgument(listed.status()) ? kExitUsage : kExitInternal;
  }
  nlohmann::ordered_json doc;
  doc["dry_run"] = dry_run;
  doc["instances"] = nlohmann::ordered_json::array();
  uint64_t removed_bytes = 0, removed_files = 0, kept_bytes = 0;
  int removed_instances = 0, live_instances = 0, exit_code = kExitOk;
  for (const InstanceFiles& f : *listed) {
    std::string action;
    std::string error;
    InstanceFiles done = f;
    if (f.live_pid != 0) {
      action = "kept (live)";
      ++live_instances;
      kept_bytes += f.bytes;
      if (!instance.empty()) exit_code = kExitRejected;
    } else if (dry_run) {
      action = "would remove";
    } else {
      absl::StatusOr<InstanceFiles> r = RemoveStaleInstance(f.instance);
      if (r.ok()) {
        action = "removed";
        done = *r;
      } else {
        // A hostd may have taken the instance since it was listed.
        action = absl::IsFailedPrecondition(r.status()) ? "kept (live)" : "failed";
        error = std::string(r.status().message());
        if (action == "failed") exit_code = kExitInternal;
      }
    }
    if (action == "removed" || action == "would remove") {
      ++removed_instances;
      removed_bytes += done.bytes;
      removed_files += done.files.size();
    }
    if (json) {
      nlohmann::ordered_json j;
      j["instance"] = f.instance;
      j["live_pid"] = f.live_pid;
      j["action"] = action;
      j["bytes"] = done.bytes;
      j["files"] = nlohmann::ordered_json::array();
      for (const InstanceFile& file : done.files) {
        j["files"].push_back({{"name", file.name}, {"bytes", file.bytes}});
      }
      if (!error.empty()) j["error"] = error;
      doc["instances"].push_back(j);
    } else {
      out << "instance " << f.instance << ": "
          << (f.live_pid != 0 ? absl::StrCat("live hostd pid ", f.live_pid) : "no live hostd")
          << ", " << done.files.size() << " file(s), " << done.bytes << " bytes: " << action
          << (error.empty() ? "" : " (" + error + ")") << '\n';
      for (const InstanceFile& file : done.files) {
        out << "  /dev/shm/" << file.name << "  " << file.bytes << " bytes\n";
      }
    }
  }
  if (json) {
    doc["removed_instances"] = removed_instances;
    doc["removed_files"] = removed_files;
    doc["removed_bytes"] = removed_bytes;
    doc["live_instances"] = live_instances;
    doc["live_bytes"] = kept_bytes;
    out << doc.dump(2) << '\n';
  } else {
    out << (dry_run ? "would remove " : "removed ") << removed_instances << " instance(s), "
        << removed_files << " file(s), " << removed_bytes << " bytes; kept " << live_instances
        << " live instance(s), " << kept_bytes << " bytes\n";
  }
  if (!instance.empty() && listed->empty() && !json) {
    out << "(no files of instance " << instance << " in /dev/shm)\n";
  }
  return exit_code;
}

}  // namespace slidedp::ctl
