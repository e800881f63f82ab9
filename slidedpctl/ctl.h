// slidedpctl: the operator CLI for hostd. It only talks to the daemon over slidedp.v1 gRPC
// (unix socket, or loopback TCP); it never maps shared memory or reads hostd's files.
//
// RunCtl is the whole program minus process setup, so tests drive it directly against an
// in-process fake Control service. Every command first handshakes (presenting slidedpctl's
// BuildInfo), then issues its query and prints either aligned tables or, with --json, one JSON
// document on `out`. Errors go to `err`, one line each, prefixed "slidedpctl: ".
//
// Exit codes:
//   0  success
//   1  internal error in slidedpctl (a bug)
//   2  usage error: unknown subcommand or flag, bad value (CLI11 parse error), bad --tcp
//   3  hostd unreachable: socket missing, connection refused, daemon went away (UNAVAILABLE)
//      or no answer within the call's deadline (--timeout-ms; the message names the deadline)
//   4  hostd rejected the request: any other non-OK status (hostd's own DEADLINE_EXCEEDED
//      included), including FAILED_PRECONDITION at handshake on version skew
//   5  `estimate`: a figure does not fit this machine (a TOO LARGE line); `doctor`: a check FAILed
//   6  `export` or a waiting `checkpoint` did not finish within its deadline (--export-timeout-s,
//      --wait-s) after hostd accepted it: the operation goes on in hostd
// `estimate` and `doctor` never contact hostd; a model they cannot load (missing file, bad
// config.json, unsupported model_type) is a usage error (2).
//
// Thread safety: RunCtl reads the environment (SLIDEDP_SOCKET) and shares no other state, so
// concurrent calls are safe as long as nobody mutates the environment meanwhile.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "slidedpctl/exit_codes.h"

namespace slidedp::ctl {

// Runs one invocation. `args` are the command-line arguments without the program name, e.g.
// {"--socket", "/tmp/h.sock", "layers", "--json"}. Returns the exit code above.
int RunCtl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace slidedp::ctl
