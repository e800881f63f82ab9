// The bounds of every job setting, whatever its source: hostd's configuration (flags, the
// environment, the TOML file: hostd/config.h), CreateJob, UpdateHyperParams and a checkpoint
// being resumed all go through these checks, so a value one path refuses is refused by all of
// them with the same words ("lr: must be a finite number >= 0, got -1").
//
//   optimizer  lr finite >= 0; beta1, beta2 in [0, 1); eps finite > 0; weight_decay finite >= 0;
//              schedule constant|linear|cosine; warmup_steps <= total_steps when a schedule
//              decays to total_steps; min_lr_ratio in [0, 1]; clip none|per_layer|global;
//              max_grad_norm finite > 0; grad_dtype bf16|fp32
//   routes     param_route replicated|sharded; grad_route cpu_reduction|gpu_reduction|
//              reduce_scatter; chunk_bytes a multiple of 4096 from 4 KiB to 1 GiB
//   job        world_size 1..64; job_id 1..64 characters of [A-Za-z0-9_.-]
//
// The Check* functions take settings as the configuration holds them, where an UNSPECIFIED
// schedule, clip or route means the default the proto names (constant, none, replicated,
// cpu_reduction) and every other field is set; the Normalize* functions take a message from a
// client, where proto3's zero means "not set": they fill hostd's defaults first, then check, and
// name the field by its path in the message ("optimizer.lr", "spec.routes.chunk_bytes").
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/hyper_params.h"  // FormatSetting, the optimizer fields
#include "proto/shm_abi.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::model {

inline constexpr uint64_t kMinChunkBytes = uint64_t{4} << 10;
inline constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 30;
inline constexpr uint32_t kMaxWorldSize = shm::kMaxRanks;
inline constexpr size_t kMaxJobIdChars = 64;

// A setting out of its bounds. `field` is the setting's name, which is both its config key and
// its field name in the messages ("lr", "chunk_bytes", "world_size"); `message` says what is
// expected and what came ("must be in [0, 1), got 1.5").
struct SettingError {
  std::string field;
  std::string message;
};

std::optional<SettingError> CheckOptimizer(const slidedp::v1::OptimizerConfig& o);
std::optional<SettingError> CheckRoutes(const slidedp::v1::Routes& r);
std::optional<SettingError> CheckWorldSize(uint32_t world_size);
std::optional<SettingError> CheckJobId(absl::string_view job_id);

// INVALID_ARGUMENT "<prefix><field>: <message>".
absl::Status SettingStatus(const SettingError& e, absl::string_view prefix);

// Fills the fields a client left unset (betas/eps all zero: torch.optim.AdamW's 0.9, 0.999,
// 1e-8; schedule constant; clip none; grad_dtype bf16; max_grad_norm 1.0 while clip is none),
// then checks it. INVALID_ARGUMENT "optimizer.<field>: ..." otherwise.
absl::StatusOr<slidedp::v1::OptimizerConfig> NormalizeOptimizerConfig(
    const slidedp::v1::OptimizerConfig& in);

// A job spec from CreateJob (or a checkpoint): world_size 0 becomes 1, job_id "" becomes
// "default", unset routes take `default_routes` (hostd's configured ones) field by field, the
// optimizer is normalized; then every field is checked. INVALID_ARGUMENT naming
// "spec.<field path>" otherwise. The manifest is checked apart (ValidateManifest).
absl::StatusOr<slidedp::v1::JobSpec> NormalizeJobSpec(slidedp::v1::JobSpec spec,
                                                      const slidedp::v1::Routes& default_routes);

// UpdateHyperParams: `current` (a job's effective optimizer) with the settings named in `fields`
// taken from `in`. Settable: the updatable rows of HyperParams() (hyper_params.h): lr, beta1,
// beta2, eps, weight_decay, schedule, warmup_steps, total_steps, min_lr_ratio, clip,
// max_grad_norm (grad_dtype and the booleans are fixed by the job).
// A named field is a value, never "unset": beta1 0 is 0, and eps 0 or max_grad_norm 0 is refused
// as the configuration refuses it (schedule and clip 0 are constant and none, as the proto says).
// INVALID_ARGUMENT "fields: ..." for no field or one that cannot be changed,
// "optimizer.<field>: ..." (CheckOptimizer's words) for a result out of bounds.
absl::StatusOr<slidedp::v1::OptimizerConfig> ApplyHyperParams(
    const slidedp::v1::OptimizerConfig& current, const slidedp::v1::OptimizerConfig& in,
    const google::protobuf::RepeatedPtrField<std::string>& fields);

// A string from a client as a status message quotes it: at most `max_bytes` bytes of it (then
// "...", and the length), each byte that is not printable ASCII as '?'. A message carries the
// client's value back in gRPC's trailers, which clients cap (8 KiB by default): a longer one
// reaches the client as RESOURCE_EXHAUSTED "received initial metadata size exceeds limit"
// instead of the answer.
std::string ShownText(absl::string_view text, size_t max_bytes = 80);

}  // namespace slidedp::model
