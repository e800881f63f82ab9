#include "model/layout.h"

#include <cmath>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace slidedp::model {
namespace {

// Debian's abseil has its own string_view; the API speaks std::string_view.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr char kKinds[] = "F, Seg, SAC, N";  // policy.py's ACTIVATION_KINDS, joined

// Python's repr() of a str, as policy.py's messages print the text and the group.
std::string Repr(absl::string_view s) {
  const bool dquote =
      s.find('\'') != absl::string_view::npos && s.find('"') == absl::string_view::npos;
  const char q = dquote ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == '\\' || c == q) {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += c;
    }
  }
  out += q;
  return out;
}

absl::Status Bad(std::string message) {
  return absl::InvalidArgumentError(absl::StrCat("policy: ", message));
}

struct Group {
  absl::string_view count;
  bool resident = false;
  std::optional<ActivationKind> kind;
  std::optional<absl::string_view> ratio;
};

// policy.py's _GROUP, ^(\d+)(R)?(F|Seg|SAC|N)?(?:-r(.*))?$, by hand.
std::optional<Group> MatchGroup(absl::string_view g) {
  Group out;
  size_t i = 0;
  while (i < g.size() && absl::ascii_isdigit(static_cast<unsigned char>(g[i]))) ++i;
  if (i == 0) return std::nullopt;
  out.count = g.substr(0, i);
  absl::string_view rest = g.substr(i);
  if (!rest.empty() && rest.front() == 'R') {
    out.resident = true;
    rest.remove_prefix(1);
  }
  // Longest names first: "SAC" before "Seg" is irrelevant, but "Seg" must not read as "S".
  for (const auto& [name, kind] :
       {std::pair<absl::string_view, ActivationKind>{"Seg", ActivationKind::kSeg},
        {"SAC", ActivationKind::kSac},
        {"F", ActivationKind::kF},
        {"N", ActivationKind::kN}}) {
    if (rest.substr(0, name.size()) == name) {
      out.kind = kind;
      rest.remove_prefix(name.size());
      break;
    }
  }
  if (rest.empty()) return out;
  if (rest.substr(0, 2) != "-r") return std::nullopt;
  out.ratio = rest.substr(2);
  return out;
}

std::string Token(const LayerPolicy& p) {
  std::string kind =
      p.resident
          ? absl::StrCat("R", p.kind == ActivationKind::kN ? "" : Av(ActivationKindName(p.kind)))
          : std::string(ActivationKindName(p.kind));
  const bool shown = p.ratio != 0.0 || (p.kind != ActivationKind::kN && !p.resident);
  if (shown) absl::StrAppend(&kind, absl::StrFormat("-r%g", p.ratio));
  return kind;
}

}  // namespace

std::string_view ActivationKindName(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::kF:
      return "F";
    case ActivationKind::kSeg:
      return "Seg";
    case ActivationKind::kSac:
      return "SAC";
    case ActivationKind::kN:
      return "N";
  }
  return "?";
}

absl::StatusOr<std::vector<LayerPolicy>> ParseLayout(std::string_view std_text, uint32_t layers) {
  const absl::string_view text = Av(std_text);
  if (absl::StripAsciiWhitespace(text).empty()) {
    return Bad(absl::StrCat(Repr(text), ", expected a layout such as '", layers,
                            "F-r0' (groups <count><kind>[-r<ratio>], kinds R, ", kKinds, ")"));
  }
  std::vector<LayerPolicy> out;
  uint64_t total = 0;  // may exceed `layers`; out stops growing there
  for (absl::string_view group :
       absl::StrSplit(text, absl::ByAnyChar(" \t\n\r\f\v"), absl::SkipEmpty())) {
    const std::optional<Group> m = MatchGroup(group);
    if (!m) {
      return Bad(absl::StrCat("group ", Repr(group),
                              ": expected <count><kind>[-r<ratio>] with kind one of R, ", kKinds,
                              " (e.g. '24F-r0', '6N', '4R')"));
    }
    if (!m->resident && !m->kind) {
      return Bad(absl::StrCat("group ", Repr(group), ": no kind; expected one of R, ", kKinds));
    }
    // Digits only, so a failed parse is an overflow: far more layers than any model has.
    uint64_t count = 0;
    if (!absl::SimpleAtoi(m->count, &count)) count = UINT64_MAX;
    if (count < 1) {
      return Bad(absl::StrCat("group ", Repr(group), ": count ", m->count, ", expected >= 1"));
    }
    double ratio = 0.0;
    if (m->ratio) {
      if (!absl::SimpleAtod(*m->ratio, &ratio) || std::isnan(ratio)) ratio = -1.0;
      if (!(ratio >= 0.0 && ratio <= 1.0)) {
        return Bad(absl::StrCat("group ", Repr(group), ": ratio ", Repr(*m->ratio),
                                ", expected a number in [0, 1] (the fraction of saved bytes "
                                "offloaded)"));
      }
    }
    if (m->resident && !out.empty() && !out.back().resident) {
      return Bad(absl::StrCat("group ", Repr(group),
                              ": resident groups (R) come first, before every streamed layer"));
    }
    const LayerPolicy p{m->kind.value_or(ActivationKind::kN), ratio, m->resident};
    total = count > UINT64_MAX - total ? UINT64_MAX : total + count;
    while (out.size() < layers && out.size() < total) out.push_back(p);
  }
  if (total != layers) {
    return Bad(
        absl::StrCat(Repr(text), " lists ", total, " decoder layers, the model has ", layers));
  }
  return out;
}

std::string FormatLayout(const std::vector<LayerPolicy>& policies) {
  std::string out;
  size_t i = 0;
  while (i < policies.size()) {
    size_t j = i;
    while (j < policies.size() && policies[j] == policies[i]) ++j;
    absl::StrAppend(&out, out.empty() ? "" : " ", j - i, Token(policies[i]));
    i = j;
  }
  return out;
}

std::string DefaultLayout(uint32_t layers) { return absl::StrCat(layers, "F-r0"); }

}  // namespace slidedp::model
