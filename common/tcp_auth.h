// hostd's TCP listener (listen_tcp) and its clients. A unix socket is protected by its file mode
// (0600, or 0660 with shm_group); a TCP port on loopback is open to every local user, so calls
// that arrive over TCP must carry the service token: a secret kept in a file readable only by
// hostd's user and group (auth_token_file), sent by each call as metadata
// "authorization: Bearer <token>". Clients find the file through SLIDEDP_TOKEN_FILE (or their
// own option, e.g. slidedpctl --token-file).
//
// Pure functions apart from ReadServiceToken's file access; thread-safe.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace slidedp {

inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kTokenFileEnv[] = "SLIDEDP_TOKEN_FILE";
inline constexpr size_t kMinTokenChars = 32;
inline constexpr size_t kMaxTokenChars = 4096;

// "HOST:PORT" with HOST localhost, [::1] or a dotted IPv4 address in 127.0.0.0/8, PORT 1..65535
// (0 too when `allow_port_zero`: a listener that takes any free port). Exact: "127.0.0.1.x:80"
// and "localhost.example:80" are not loopback.
bool IsLoopbackHostPort(std::string_view host_port, bool allow_port_zero);

// The token in `path`: its first line, kMinTokenChars..kMaxTokenChars printable ASCII characters
// (no spaces). The file must be a regular file (a link is not followed). `for_server`: it must
// also belong to this process's effective user and give nothing to others (mode & 0007 == 0);
// FAILED_PRECONDITION naming the file, its owner and mode otherwise. NOT_FOUND / PERMISSION_DENIED
// naming the file when it cannot be read.
absl::StatusOr<std::string> ReadServiceToken(const std::string& path, bool for_server);

// The metadata value a client sends: "Bearer <token>".
std::string BearerValue(std::string_view token);

// Whether `presented` (the metadata value a call carried) is BearerValue(token); its time does
// not depend on where the two differ.
bool BearerMatches(std::string_view presented, std::string_view token);

}  // namespace slidedp
