// slidedpctl watch: a live per-step view of hostd, one line per poll that sees new completed
// steps (not a full-screen UI, so it can be piped and logged).
//
// Each line: the last completed step, how many steps completed since the previous line, the
// step's wall time (armed to last layer published), its AdamW seconds and throughput, the
// gradient bytes received and parameter bytes published since the previous line, aborted steps
// so far, attached ranks / world size, and the state ("idle", "running N", "torn", ...). hostd
// does not know tokens per step, so there is no tokens column. --json prints one JSON object per
// line (JSON lines) with the same fields.
//
// RunWatch polls GetStats and GetStatus every `interval_s` and returns when `steps` new steps
// have completed (0: never), when `stop` returns true (Ctrl-C), or when hostd stops answering.
// Thread safety: uses `client` from the calling thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>

#include "slidedpctl/client.h"

namespace slidedp::ctl {

struct WatchOptions {
  double interval_s = 1.0;
  uint64_t steps = 0;  // stop after this many new completed steps; 0: until stopped
  bool json = false;
};

// Returns 0, or kExitUnreachable / kExitRejected (ctl.h) with one line on `err` when a poll
// fails.
int RunWatch(ControlClient& client, const WatchOptions& options, std::ostream& out,
             std::ostream& err, const std::function<bool()>& stop);

}  // namespace slidedp::ctl
