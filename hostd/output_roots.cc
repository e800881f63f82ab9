#include "hostd/output_roots.h"

#include <limits.h>

#include <filesystem>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "model/job_spec.h"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;

constexpr char kHowToAllow[] =
    "; to allow it, set output_roots in hostd's config: a comma-separated list of absolute "
    "directories (output_roots = \"/var/lib/slidedp\"; \"/\" allows any directory; flag "
    "--output_roots, environment SLIDEDP_OUTPUT_ROOTS)";

// How much of a path a message shows: the message goes back to the client in gRPC's trailers,
// which clients cap at 8 KiB, and it may name two paths and the roots.
constexpr size_t kShownPathBytes = 1024;

std::string Shown(const std::string& path) { return model::ShownText(path, kShownPathBytes); }

// "/a/b/" -> "/a/b" ("/" stays).
fs::path StripTrailingSlashes(std::string text) {
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return fs::path(text);
}

// `p` with ".", ".." and the symlinks of its existing prefix resolved; relative paths against the
// working directory (only configured ones can be: requests are checked to be absolute first).
absl::StatusOr<fs::path> Resolve(absl::string_view what, const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
  if (ec) return ErrnoStatus(absl::StrCat(what, ": resolve ", Shown(p.string())), ec.value());
  return StripTrailingSlashes(r.lexically_normal().string());
}

// Whether `p` is `base` or below it (`strictly`: below it only). Both resolved.
bool IsWithin(const fs::path& base, const fs::path& p, bool strictly) {
  auto q = p.begin();
  for (auto b = base.begin(); b != base.end(); ++b, ++q) {
    if (q == p.end() || *q != *b) return false;
  }
  return !strictly || q != p.end();
}

absl::Status CheckAbsolute(absl::string_view field, const std::string& path) {
  if (path.empty() || path.front() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected an absolute path (hostd has its own working directory), got '",
        Shown(path), "'"));
  }
  if (path.size() >= PATH_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": a path of ", path.size(),
                                                   " bytes; at most ", PATH_MAX - 1, " ('",
                                                   Shown(path), "')"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> UnderARoot(const fs::path& resolved, const std::vector<std::string>& roots,
                                bool strictly) {
  for (const std::string& root : roots) {
    ASSIGN_OR_RETURN(const fs::path r, Resolve("output_roots", root));
    if (IsWithin(r, resolved, strictly)) return true;
  }
  return false;
}

std::string Describe(const std::string& given, const fs::path& resolved) {
  std::string text = absl::StrCat("'", Shown(given), "'");
  if (resolved != StripTrailingSlashes(given)) {
    absl::StrAppend(&text, " (resolved: '", Shown(resolved.string()), "')");
  }
  return text;
}

std::string RootsText(const std::vector<std::string>& roots) {
  return roots.empty() ? "(none set)" : absl::StrCat("(", absl::StrJoin(roots, ", "), ")");
}

}  // namespace

absl::StatusOr<std::string> CheckCheckpointDir(const std::string& dir,
                                               const std::string& checkpoint_dir,
                                               const std::vector<std::string>& roots) {
  RETURN_IF_ERROR(CheckAbsolute("dir", dir));
  ASSIGN_OR_RETURN(const fs::path resolved, Resolve("dir", dir));
  if (!checkpoint_dir.empty()) {
    ASSIGN_OR_RETURN(const fs::path base, Resolve("checkpoint.dir", checkpoint_dir));
    if (IsWithin(base, resolved, /*strictly=*/false)) return resolved.string();
  }
  ASSIGN_OR_RETURN(const bool allowed, UnderARoot(resolved, roots, /*strictly=*/false));
  if (allowed) return resolved.string();
  return absl::PermissionDeniedError(absl::StrCat(
      "dir: ", Describe(dir, resolved), " is neither hostd's checkpoint.dir (",
      checkpoint_dir.empty() ? std::string("none set") : absl::StrCat("'", checkpoint_dir, "'"),
      ") or below it, nor under one of output_roots ", RootsText(roots),
      "; hostd writes a requested checkpoint only there", kHowToAllow));
}

absl::StatusOr<std::string> CheckExportOutDir(const std::string& out_dir,
                                              const std::vector<std::string>& roots) {
  RETURN_IF_ERROR(CheckAbsolute("out_dir", out_dir));
  const fs::path given = StripTrailingSlashes(out_dir);
  ASSIGN_OR_RETURN(const fs::path resolved, Resolve("out_dir", given));
  ASSIGN_OR_RETURN(const bool allowed, UnderARoot(resolved, roots, /*strictly=*/true));
  if (!allowed) {
    return absl::PermissionDeniedError(
        absl::StrCat("out_dir: ", Describe(out_dir, resolved), " is not below one of output_roots ",
                     RootsText(roots), "; hostd writes an export only there", kHowToAllow));
  }
  const fs::path name = given.filename();
  if (name.empty() || name == "." || name == "..") return resolved.string();
  ASSIGN_OR_RETURN(const fs::path parent, Resolve("out_dir", given.parent_path()));
  return (parent / name).string();
}

}  // namespace slidedp::hostd
