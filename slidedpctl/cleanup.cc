#include "slidedpctl/cleanup.h"

#include <sys/stat.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/instance_files.h"
#include "common/shm_segment.h"
#include "nlohmann/json.hpp"
#include "slidedpctl/exit_codes.h"

namespace slidedp::ctl {
namespace {

std::string OctalMode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

std::string Describe(const InstanceFile& file) {
  std::string d = absl::StrCat(DescribeUid(file.uid), ", mode ", OctalMode(file.mode));
  if (S_ISLNK(file.mode)) {
    absl::StrAppend(&d, ", a symbolic link");
  } else if (!S_ISREG(file.mode)) {
    absl::StrAppend(&d, ", not a regular file");
  }
  return d;
}

// What RemoveStaleInstance would refuse, from the listed lstat: refused before anything is
// taken (the removal itself checks each opened file again).
absl::Status CheckListed(const InstanceFiles& f, const OwnerCheck& check) {
  for (const InstanceFile& file : f.files) {
    struct stat st = {};
    st.st_uid = file.uid;
    st.st_gid = file.gid;
    st.st_mode = file.mode;
    if (absl::Status s = CheckOwner(st, absl::StrCat(kShmDir, "/", file.name), "file", check);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

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
  int removed_instances = 0, live_instances = 0, refused_instances = 0, exit_code = kExitOk;
  const OwnerCheck check = CleanupOwnerCheck();
  for (const InstanceFiles& f : *listed) {
    std::string action;
    std::string error;
    InstanceFiles done = f;
    if (f.live_pid != 0) {
      action = "kept (live)";
      ++live_instances;
      kept_bytes += f.bytes;
      if (!instance.empty()) exit_code = kExitRejected;
    } else if (absl::Status listed_ok = CheckListed(f, check); !listed_ok.ok()) {
      // Another user's file, a link or worse: the admin must look at it.
      action = dry_run ? "would refuse" : "refused";
      error = std::string(listed_ok.message());
      ++refused_instances;
      exit_code = kExitRejected;
    } else if (dry_run) {
      action = "would remove";
    } else {
      absl::StatusOr<InstanceFiles> r = RemoveStaleInstance(f.instance, check);
      if (r.ok()) {
        action = "removed";
        done = *r;
      } else if (absl::IsFailedPrecondition(r.status())) {
        // Since it was listed, a hostd took the instance, or a file was replaced by one that
        // RemoveStaleInstance's own check (on the opened file) refuses.
        const bool live = InstanceLockHolder(f.instance) != 0;
        action = live ? "kept (live)" : "refused";
        if (!live) ++refused_instances;
        if (!live || !instance.empty()) exit_code = kExitRejected;
        error = std::string(r.status().message());
      } else {
        action = "failed";
        error = std::string(r.status().message());
        exit_code = kExitInternal;
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
        j["files"].push_back({{"name", file.name},
                              {"bytes", file.bytes},
                              {"uid", file.uid},
                              {"gid", file.gid},
                              {"mode", OctalMode(file.mode)},
                              {"regular", S_ISREG(file.mode)}});
      }
      if (!error.empty()) j["error"] = error;
      doc["instances"].push_back(j);
    } else {
      out << "instance " << f.instance << ": "
          << (f.live_pid != 0 ? absl::StrCat("live hostd pid ", f.live_pid) : "no live hostd")
          << ", " << done.files.size() << " file(s), " << done.bytes << " bytes: " << action
          << (error.empty() ? "" : " (" + error + ")") << '\n';
      for (const InstanceFile& file : done.files) {
        out << "  /dev/shm/" << file.name << "  " << file.bytes << " bytes  " << Describe(file)
            << '\n';
      }
    }
  }
  if (json) {
    doc["removed_instances"] = removed_instances;
    doc["removed_files"] = removed_files;
    doc["removed_bytes"] = removed_bytes;
    doc["live_instances"] = live_instances;
    doc["live_bytes"] = kept_bytes;
    doc["refused_instances"] = refused_instances;
    out << doc.dump(2) << '\n';
  } else {
    out << (dry_run ? "would remove " : "removed ") << removed_instances << " instance(s), "
        << removed_files << " file(s), " << removed_bytes << " bytes; kept " << live_instances
        << " live instance(s), " << kept_bytes << " bytes"
        << (refused_instances > 0
                ? absl::StrCat("; ", dry_run ? "would refuse " : "refused ", refused_instances,
                               " instance(s) with files it may not remove")
                : std::string())
        << '\n';
  }
  if (!instance.empty() && listed->empty() && !json) {
    out << "(no files of instance " << instance << " in /dev/shm)\n";
  }
  return exit_code;
}

}  // namespace slidedp::ctl
