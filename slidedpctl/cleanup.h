// `slidedpctl cleanup [--instance X] [--dry-run]`: removes the /dev/shm segments and lock files of
// hostd instances that no live hostd owns (common/instance_files.h decides liveness: the
// instance's flock, or for a hostd without lock file the pid in its control segment). A live
// instance's files are listed and kept, never removed. Nor are files it may not remove
// (CleanupOwnerCheck: run by a user, only that user's own; as root, anyone's; never a symbolic
// link or anything but a regular file): such an instance is refused whole. Needs no daemon.
#pragma once

#include <ostream>
#include <string>

namespace slidedp::ctl {

// Exit codes: 0 done (also when nothing was found); 4 `instance` is owned by a live hostd (kept),
// or an instance was refused (with --dry-run: would be); 2 a bad instance name; 1 a removal
// failed.
int RunCleanup(const std::string& instance, bool dry_run, bool json, std::ostream& out,
               std::ostream& err);

}  // namespace slidedp::ctl
