// Status propagation macros for absl::Status / absl::StatusOr (Debian's abseil 20220623 lacks
// them). Every fallible function in SlideDP returns absl::Status or absl::StatusOr<T>.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace slidedp {

// Returns `status` with `context` prepended to its message, keeping the code.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

// Wraps the current errno into a Status naming the failed operation ("what: <strerror>";
// absl::ErrnoToStatus appends the strerror text itself).
inline absl::Status ErrnoStatus(absl::string_view what, int err = errno) {
  return absl::ErrnoToStatus(err, what);
}

}  // namespace slidedp

#define SLIDEDP_CONCAT_INNER_(a, b) a##b
#define SLIDEDP_CONCAT_(a, b) SLIDEDP_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    ::absl::Status _slidedp_status = (expr);           \
    if (!_slidedp_status.ok()) return _slidedp_status; \
  } while (0)

// tmp is a name being declared and lhs a declaration or an lvalue (`auto x`, `T y`, `x_`):
// neither can be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                           \
  if (!tmp.ok()) return tmp.status();           \
  lhs = std::move(*tmp)
// NOLINTEND(bugprone-macro-parentheses)

#define ASSIGN_OR_RETURN(lhs, rexpr) \
  ASSIGN_OR_RETURN_IMPL_(SLIDEDP_CONCAT_(_slidedp_statusor_, __LINE__), lhs, rexpr)
