// Setting a key from text and the checks across keys.

#include <algorithm>
#include <charconv>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/tcp_auth.h"
#include "hostd/config_internal.h"
#include "model/hyper_params.h"
#include "model/job_spec.h"

namespace slidedp::hostd::config_internal {
using ::slidedp::v1::OptimizerConfig;
using ::slidedp::v1::Routes;

absl::Status KeyError(std::string_view key, std::string_view detail, std::string_view msg) {
  if (detail.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(Av(key), ": ", Av(msg)));
  }
  return absl::InvalidArgumentError(absl::StrCat(Av(key), " (", Av(detail), "): ", Av(msg)));
}

namespace {

// Well-formed UTF-8 (RFC 3629: no overlongs, surrogates or code points above U+10FFFF).
bool IsUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (b < 0x80) {
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      n = 1, cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 2, cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 3, cp = b & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

}  // namespace

absl::Status SetFrom(const KeyDescriptor& d, HostdConfig& c, std::string_view text,
                     std::string_view detail) {
  // The effective config is shown and saved as TOML, which is UTF-8.
  if (!IsUtf8(text)) return KeyError(d.name, detail, "is not valid UTF-8 text");
  absl::Status s = d.set(c, text);
  if (!s.ok()) return KeyError(d.name, detail, std::string(s.message()));
  return absl::OkStatus();
}

absl::Status Validate(const HostdConfig& c, const WhereFn& where) {
  auto fail = [&where](std::string_view key, std::string_view msg) {
    return KeyError(key, where(key), msg);
  };
  auto in_choices = [](std::string_view key, const std::string& v) {
    const std::vector<std::string>& ch = FindKey(key)->choices;
    return std::find(ch.begin(), ch.end(), v) != ch.end();
  };
  auto not_one_of = [](std::string_view key, const std::string& v) {
    return absl::StrCat("'", v, "' is not one of ", absl::StrJoin(FindKey(key)->choices, ", "));
  };

  if (c.instance.empty() || c.instance.size() > kMaxInstanceChars ||
      !std::all_of(c.instance.begin(), c.instance.end(), [](char ch) {
        return absl::ascii_isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-';
      })) {
    return fail("instance", absl::StrCat("'", c.instance,
                                         "' is not a valid instance name; expected 1 to 32 "
                                         "characters of [A-Za-z0-9_-]"));
  }
  if (c.socket.empty() || c.socket.size() > kMaxSocketPathBytes ||
      c.socket.find('\0') != std::string::npos) {
    return fail("socket", absl::StrCat("'", c.socket, "' must be a non-empty path of at most ",
                                       kMaxSocketPathBytes, " bytes"));
  }
  if (!c.listen_tcp.empty() && !IsLoopbackHostPort(c.listen_tcp, /*allow_port_zero=*/true)) {
    return fail("listen_tcp",
                absl::StrCat("'", c.listen_tcp,
                             "' is not a loopback address; expected 127.0.0.1:PORT, [::1]:PORT or "
                             "localhost:PORT with PORT 0..65535, or empty (hostd serves only "
                             "local clients)"));
  }
  if (!c.listen_tcp.empty() && c.auth_token_file.empty()) {
    return fail("listen_tcp",
                absl::StrCat("'", c.listen_tcp,
                             "' needs auth_token_file: every local user can reach a TCP port, so "
                             "calls over it must carry the token of a file only hostd's user and "
                             "group can read (e.g. `openssl rand -hex 32 > FILE; chmod 0640 "
                             "FILE`)"));
  }
  if (!c.auth_token_file.empty() && c.auth_token_file.front() != '/') {
    return fail("auth_token_file",
                absl::StrCat("'", c.auth_token_file, "' must be an absolute path"));
  }
  if (!c.metrics_listen.empty() && c.metrics_listen != "off") {
    const size_t colon = c.metrics_listen.rfind(':');
    uint32_t port = 0;
    const std::string_view port_text = colon == std::string::npos
                                           ? std::string_view()
                                           : std::string_view(c.metrics_listen).substr(colon + 1);
    auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (colon == std::string::npos || colon == 0 || port_text.empty() || ec != std::errc() ||
        end != port_text.data() + port_text.size() || port > 65535) {
      return fail("metrics.listen",
                  absl::StrCat("'", c.metrics_listen,
                               "' is not HOST:PORT with PORT 0..65535; expected e.g. "
                               "127.0.0.1:9464, or empty/off to disable"));
    }
    if (!c.metrics_allow_remote &&
        !IsLoopbackHostPort(c.metrics_listen, /*allow_port_zero=*/true)) {
      return fail("metrics.listen",
                  absl::StrCat("'", c.metrics_listen,
                               "' is not a loopback address (127.0.0.1, [::1], localhost) and the "
                               "endpoint has no authentication; set metrics.allow_remote = true "
                               "to serve it anyway"));
    }
  }
  if (!in_choices("log_level", c.log_level)) {
    return fail("log_level", not_one_of("log_level", c.log_level));
  }
  if (c.model.empty()) {
    return fail("model",
                "must not be empty; expected tiny, tiny-tied, a directory containing "
                "config.json, or a path to a config.json");
  }
  if (std::optional<model::SettingError> e = model::CheckWorldSize(c.world_size)) {
    return fail(e->field, e->message);
  }
  if (c.init != "auto" && c.init != "random" && c.init != "zeros" &&
      (c.init.find('/') == std::string::npos && !c.init.ends_with(".safetensors"))) {
    return fail("init", absl::StrCat("'", c.init,
                                     "' is not one of auto, random, zeros, or a path (a path "
                                     "contains '/' or ends in .safetensors, e.g. ./",
                                     c.init, ")"));
  }
  if (c.init.find('\0') != std::string::npos) return fail("init", "must not contain NUL");

  if (std::optional<model::SettingError> e = model::CheckOptimizer(c.optimizer)) {
    return fail(e->field, e->message);
  }
  if (std::optional<model::SettingError> e = model::CheckRoutes(c.routes))
    return fail(e->field, e->message);

  if (c.numa_node < -1) {
    return fail("numa_node", absl::StrCat("must be >= -1 (-1: auto), got ", c.numa_node));
  }
  if (c.update_threads < 0) {
    return fail("update_threads",
                absl::StrCat("must be >= 0 (0: all cores of the node), got ", c.update_threads));
  }
  if (!in_choices("isa", c.isa)) return fail("isa", not_one_of("isa", c.isa));
  if (!in_choices("update_granularity", c.update_granularity)) {
    return fail("update_granularity", not_one_of("update_granularity", c.update_granularity));
  }
  for (const std::string& root : c.output_roots) {
    if (root.empty() || root.front() != '/') {
      return fail("output_roots",
                  absl::StrCat("'", root,
                               "' is not an absolute directory; expected a comma-separated list "
                               "of absolute directories (\"/\" allows any)"));
    }
  }
  if (c.checkpoint.every_steps > 0 && c.checkpoint.dir.empty()) {
    return fail(
        "checkpoint.every_steps",
        absl::StrCat("is ", c.checkpoint.every_steps,
                     " but checkpoint.dir is empty; set checkpoint.dir (or every_steps 0)"));
  }
  if (!in_choices("mlock", c.mlock)) return fail("mlock", not_one_of("mlock", c.mlock));
  if (!in_choices("recovery_on_inconsistent", c.recovery_on_inconsistent)) {
    return fail("recovery_on_inconsistent",
                not_one_of("recovery_on_inconsistent", c.recovery_on_inconsistent));
  }
  if (!in_choices("shm_mode", c.shm_mode)) {
    return fail("shm_mode", not_one_of("shm_mode", c.shm_mode));
  }
  if (!c.shm_group.empty() && c.shm_mode != "0660") {
    return fail("shm_group", absl::StrCat("'", c.shm_group, "' is set but shm_mode is ", c.shm_mode,
                                          "; a group needs shm_mode 0660"));
  }
  if (c.heartbeat_interval_ms < 1) {
    return fail("heartbeat_interval_ms", "must be >= 1");
  }
  if (c.heartbeat_deadline_ms <= c.heartbeat_interval_ms) {
    return fail(
        "heartbeat_deadline_ms",
        absl::StrCat(c.heartbeat_deadline_ms, " must be greater than heartbeat_interval_ms (",
                     c.heartbeat_interval_ms, ")"));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::hostd::config_internal
