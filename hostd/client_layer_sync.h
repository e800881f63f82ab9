// ClientLayerSync: the layers the ranks update themselves (AttachRankRequest.
// client_updated_layers) and hostd's copy of them.
//
// Those layers never get a gradient in hostd: their master weights and moments live in the ranks,
// and hostd's copy is the job's state only at one version (copy_version(): the job's start, fresh
// or resumed, or the last complete upload by rank 0; unknown for a re-adopted job). Checkpoints
// and exports need a current copy, so a checkpoint of a newer version asks rank 0 to upload the
// layers (sync_step(), mirrored by Engine in ControlBlock::client_sync_step), and between steps
// rank 0 may upload the last completed version unasked. This class holds the set, the copy's
// version, the request and the upload's progress (elements of master, m and v received per
// layer), and decides what each call is allowed: the messages name the field and what is
// expected. It neither knows gRPC nor shared memory: Engine copies the pieces into the state
// and tells the checkpointer and the ranks.
//
// Thread safety: externally synchronized. Engine guards its one ClientLayerSync with its mutex.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace slidedp::hostd {

// "[1, 4]", or "[] (none)".
std::string LayerList(const std::vector<uint32_t>& layers);

class ClientLayerSync {
 public:
  // The parts of a layer's state an upload carries: master weights, exp_avg, exp_avg_sq.
  static constexpr uint32_t kParts = 3;

  // A job is installed with layers of these element counts; no layer is client-updated yet.
  // hostd's copy of every layer is the job's state at `copy_version` (nullopt: unknown, a
  // re-adopted job whose ranks may have updated some layers themselves).
  void Reset(std::vector<uint64_t> layer_numel, std::optional<uint64_t> copy_version);

  const std::vector<uint32_t>& layers() const { return layers_; }
  bool empty() const { return layers_.empty(); }
  bool is_client(uint32_t layer) const { return layer < updated_.size() && updated_[layer]; }
  // Per layer: updated by the ranks (indexable by every layer of the job).
  const std::vector<bool>& updated() const { return updated_; }
  std::optional<uint64_t> copy_version() const { return copy_version_; }
  // The version rank 0 is asked to upload; 0: none.
  uint64_t sync_step() const { return sync_step_; }

  // --- the set ---
  // The set a rank sends at attach, sorted: OUT_OF_RANGE for a layer that does not exist,
  // INVALID_ARGUMENT for one listed twice.
  absl::StatusOr<std::vector<uint32_t>> NormalizeSet(std::vector<uint32_t> layers) const;
  // FAILED_PRECONDITION unless the set may become `layers` now: no rank attached (`any_attached`
  // false; otherwise every rank must send the current set), no step running, and hostd's copy of
  // the current set is the job's state (`last_completed`, `running_step`: the sequencer's).
  absl::Status CheckChange(const std::vector<uint32_t>& layers, uint32_t rank, bool any_attached,
                           uint64_t running_step, uint64_t last_completed) const;
  // Installs `layers` (after CheckChange). hostd updated the newly listed layers up to now, so
  // its copy of them is the job's state at `last_completed`, unless it was unknown.
  void SetLayers(std::vector<uint32_t> layers, uint64_t last_completed);

  // --- the copy's version ---
  // True when hostd's copy of the set is the job's state now: no set, or the copy is at the last
  // completed step with no step running.
  bool CopyCurrent(uint64_t running_step, uint64_t last_completed) const;
  // "at version 7" or "of an unknown version".
  std::string DescribeCopy() const;
  // FAILED_PRECONDITION when a checkpoint of hostd's state alone at `version` would miss the
  // ranks' layers (a set whose copy is at another version).
  absl::Status CheckCheckpointable(uint64_t version) const;
  // The layers a checkpoint of `version` must wait for (empty: hostd's copy is at `version`).
  std::vector<uint32_t> AwaitedBy(uint64_t version) const;

  // --- the request to rank 0 ---
  void SetSyncStep(uint64_t step) { sync_step_ = step; }
  // True when the request must be withdrawn: its checkpoint is no longer in flight (committed or
  // failed; `in_flight_step` is the checkpointer's, 0 for none).
  bool ShouldWithdraw(uint64_t in_flight_step) const {
    return sync_step_ != 0 && in_flight_step != sync_step_;
  }

  // --- uploads (UploadClientLayer) and reads (ReadClientLayer) ---
  // OUT_OF_RANGE for a layer that does not exist, FAILED_PRECONDITION for one the ranks do not
  // update, INVALID_ARGUMENT for a part other than 0, 1, 2.
  absl::Status CheckPart(uint32_t layer, uint32_t part) const;
  // OUT_OF_RANGE when [offset, offset + count) passes the end of the layer.
  absl::Status CheckRange(uint32_t layer, uint64_t offset, uint64_t count) const;
  // Which version an upload may carry. With a request: that version (FAILED_PRECONDITION
  // otherwise). Without: only between steps, the last completed one, with no export running
  // (FAILED_PRECONDITION), and not one the copy is at already (ALREADY_EXISTS).
  absl::Status CheckUploadVersion(uint64_t step, uint64_t running_step, uint64_t next_step,
                                  bool export_active) const;
  // A piece [offset, offset + count) of `part` of `layer` at `step` may be copied now (after
  // CheckPart, CheckRange and CheckUploadVersion): FAILED_PRECONDITION while another piece is
  // being copied, ALREADY_EXISTS for a layer uploaded already at `step`, INVALID_ARGUMENT for a
  // piece out of order (pieces of a part come in order; offset 0 restarts it). On OK the piece is
  // marked in progress until EndPiece; a new `step` restarts the upload.
  absl::Status BeginPiece(uint32_t layer, uint32_t part, uint64_t offset, uint64_t step);
  struct PieceDone {
    bool layer_complete = false;  // all three parts of the layer are in
    bool all_complete = false;    // every layer of the set is in: the copy is at the step now
  };
  // The piece begun by BeginPiece was copied. The request (sync_step()) stays: the caller
  // withdraws it (SetSyncStep(0)) when all_complete answers it.
  PieceDone EndPiece(uint32_t layer, uint32_t part, uint64_t offset, uint64_t count);
  // FAILED_PRECONDITION unless the copy is current (CopyCurrent), naming `layer`.
  absl::Status CheckReadable(uint32_t layer, uint64_t running_step, uint64_t last_completed) const;

 private:
  bool LayerComplete(uint32_t layer) const;

  std::vector<uint64_t> numel_;
  std::vector<uint32_t> layers_;  // ascending
  std::vector<bool> updated_;     // per layer of the job
  std::optional<uint64_t> copy_version_;
  uint64_t sync_step_ = 0;
  // The upload in progress: its version and, per layer, elements received of each part.
  std::optional<uint64_t> upload_step_;
  std::vector<std::array<uint64_t, kParts>> received_;
  bool piece_copying_ = false;
};

}  // namespace slidedp::hostd
