// Where hostd writes on a client's request. A Checkpoint's `dir` and an ExportHF's `out_dir` name
// directories that hostd (often root, under systemd) creates, and an export may replace: they
// must be absolute and lie under one of the configured output roots (config key output_roots: a
// comma-separated list of absolute directories, default empty; "/" allows any directory), or,
// for a checkpoint, be the configured checkpoint.dir or lie below it.
//
// "Under" a root: a checkpoint dir may be the root itself or below it (a checkpoint writes inside
// its dir); an export's out_dir must be strictly below it (the export creates, and with
// overwrite replaces, out_dir itself, and stages next to it in "<out_dir>.tmp").
//
// Paths are compared after resolving ".", ".." and the symlinks of their existing prefix
// (std::filesystem::weakly_canonical), on both sides (a root that is a symlink is its target), so
// "/root/ok/../../etc" and a symlink inside a root that points out of it are refused.
//
// Errors: INVALID_ARGUMENT naming the field for an empty or relative path, or one of PATH_MAX
// bytes or more; PERMISSION_DENIED naming the field, the path (and what it resolves to), the
// allowed directories and the key to set; errno-based codes naming the path when it cannot be
// resolved. Messages show at most 1 KiB of a path (they travel back in gRPC's trailers). Reads
// the file system only (lstat/readlink); thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp::hostd {

// CheckpointRequest.dir (field "dir"): allowed when it is `checkpoint_dir` (may be empty: none)
// or below it, or a root or below one. Returns the resolved path to write to.
absl::StatusOr<std::string> CheckCheckpointDir(const std::string& dir,
                                               const std::string& checkpoint_dir,
                                               const std::vector<std::string>& roots);

// ExportHFRequest.out_dir (field "out_dir"): allowed when strictly below a root. Returns the path
// to write to: its parent resolved, its last component as given (so that ExportHf still sees,
// and refuses, an out_dir that is itself a symlink).
absl::StatusOr<std::string> CheckExportOutDir(const std::string& out_dir,
                                              const std::vector<std::string>& roots);

}  // namespace slidedp::hostd
