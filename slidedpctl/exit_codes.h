// slidedpctl's exit codes (their meaning: ctl.h) and the defaults every command shares, apart
// from RunCtl so that the command modules (cleanup, watch) need not include the CLI.
#pragma once

namespace slidedp::ctl {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInternal = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitUnreachable = 3;
inline constexpr int kExitRejected = 4;
inline constexpr int kExitNoFit = 5;
inline constexpr int kExitTimedOut = 6;

inline constexpr char kDefaultSocket[] = "/run/slidedp/hostd.sock";
inline constexpr char kSocketEnv[] = "SLIDEDP_SOCKET";
inline constexpr int kDefaultTimeoutMs = 5000;

}  // namespace slidedp::ctl
