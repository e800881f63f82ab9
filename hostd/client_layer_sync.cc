#include "hostd/client_layer_sync.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace slidedp::hostd {

std::string LayerList(const std::vector<uint32_t>& layers) {
  return layers.empty() ? std::string("[] (none)")
                        : absl::StrCat("[", absl::StrJoin(layers, ", "), "]");
}

void ClientLayerSync::Reset(std::vector<uint64_t> layer_numel,
                            std::optional<uint64_t> copy_version) {
  numel_ = std::move(layer_numel);
  layers_.clear();
  updated_.assign(numel_.size(), false);
  copy_version_ = copy_version;
  sync_step_ = 0;
  upload_step_.reset();
  received_.clear();
  piece_copying_ = false;
}

absl::StatusOr<std::vector<uint32_t>> ClientLayerSync::NormalizeSet(
    std::vector<uint32_t> layers) const {
  std::sort(layers.begin(), layers.end());
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] >= numel_.size()) {
      return absl::OutOfRangeError(absl::StrCat("client_updated_layers: layer ", layers[i],
                                                " does not exist; expected 0..",
                                                numel_.size() - 1));
    }
    if (i > 0 && layers[i] == layers[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("client_updated_layers: layer ", layers[i], " is listed twice"));
    }
  }
  return layers;
}

absl::Status ClientLayerSync::CheckChange(const std::vector<uint32_t>& layers, uint32_t rank,
                                          bool any_attached, uint64_t running_step,
                                          uint64_t last_completed) const {
  if (layers == layers_) return absl::OkStatus();
  if (any_attached) {
    return absl::FailedPreconditionError(
        absl::StrCat("client_updated_layers: rank ", rank, " sent ", LayerList(layers),
                     " but the attached ranks update ", LayerList(layers_),
                     " themselves; every rank of the job must send the same set"));
  }
  if (running_step != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("client_updated_layers: step ", running_step,
                     " is running; the set can change only between steps"));
  }
  if (!CopyCurrent(running_step, last_completed)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "client_updated_layers: the job's ranks updated layers ", LayerList(layers_),
        " themselves in earlier steps and hostd's copy of them is ", DescribeCopy(),
        ", not the job's step ", last_completed,
        "; attach with the same set (and the ranks' state of those layers), restart hostd "
        "from a checkpoint (--resume), or start a new job"));
  }
  return absl::OkStatus();
}

void ClientLayerSync::SetLayers(std::vector<uint32_t> layers, uint64_t last_completed) {
  layers_ = std::move(layers);
  if (copy_version_) copy_version_ = last_completed;
  updated_.assign(numel_.size(), false);
  for (uint32_t l : layers_) updated_[l] = true;
}

bool ClientLayerSync::CopyCurrent(uint64_t running_step, uint64_t last_completed) const {
  if (layers_.empty()) return true;
  return running_step == 0 && copy_version_ && *copy_version_ == last_completed;
}

std::string ClientLayerSync::DescribeCopy() const {
  return copy_version_ ? absl::StrCat("at version ", *copy_version_)
                       : std::string("of an unknown version");
}

absl::Status ClientLayerSync::CheckCheckpointable(uint64_t version) const {
  if (layers_.empty() || copy_version_ == version) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the ranks update layers ", LayerList(layers_),
                   " themselves (client_updated_layers) and hostd's copy of them is ",
                   DescribeCopy(), ", not ", version,
                   "; rank 0 uploads them when a checkpoint asks and when it closes "
                   "(python_client: opt.close())"));
}

std::vector<uint32_t> ClientLayerSync::AwaitedBy(uint64_t version) const {
  if (layers_.empty() || copy_version_ == version) return {};
  return layers_;
}

absl::Status ClientLayerSync::CheckPart(uint32_t layer, uint32_t part) const {
  if (layer >= numel_.size()) {
    return absl::OutOfRangeError(
        absl::StrCat("layer: ", layer, " does not exist; expected 0..", numel_.size() - 1));
  }
  if (!is_client(layer)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer: ", layer, " is not updated by the ranks; the client-updated layers are ",
        LayerList(layers_)));
  }
  if (part >= kParts) {
    return absl::InvalidArgumentError(
        absl::StrCat("part: expected 0 (master), 1 (m) or 2 (v), got ", part));
  }
  return absl::OkStatus();
}

absl::Status ClientLayerSync::CheckRange(uint32_t layer, uint64_t offset, uint64_t count) const {
  const uint64_t numel = numel_[layer];
  if (offset > numel || count > numel - offset) {
    return absl::OutOfRangeError(absl::StrCat("offset: ", offset, " + ", count,
                                              " elements pass the end of layer ", layer, " (",
                                              numel, " elements)"));
  }
  return absl::OkStatus();
}

absl::Status ClientLayerSync::CheckUploadVersion(uint64_t step, uint64_t running_step,
                                                 uint64_t next_step, bool export_active) const {
  if (sync_step_ != 0) {
    if (step != sync_step_) {
      return absl::FailedPreconditionError(
          absl::StrCat("step: a checkpoint asks for version ", sync_step_, ", got ", step));
    }
    return absl::OkStatus();
  }
  if (running_step != 0 || step + 1 != next_step || export_active) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: hostd accepts an unasked upload only between steps, of the last completed step (",
        next_step - 1, "), with no export running; got version ", step,
        running_step != 0 ? absl::StrCat(" while step ", running_step, " runs") : ""));
  }
  if (copy_version_ == step && upload_step_ != step) {
    return absl::AlreadyExistsError(
        absl::StrCat("hostd's copy of the client-updated layers is at version ", step, " already"));
  }
  return absl::OkStatus();
}

bool ClientLayerSync::LayerComplete(uint32_t layer) const {
  const auto& rec = received_[layer];
  return rec[0] == numel_[layer] && rec[1] == numel_[layer] && rec[2] == numel_[layer];
}

absl::Status ClientLayerSync::BeginPiece(uint32_t layer, uint32_t part, uint64_t offset,
                                         uint64_t step) {
  if (piece_copying_) {
    return absl::FailedPreconditionError(
        "UploadClientLayer: another piece is being written; rank 0 sends one piece at a time");
  }
  if (upload_step_ != step) {
    upload_step_ = step;
    received_.assign(numel_.size(), {0, 0, 0});
  }
  if (LayerComplete(layer)) {
    return absl::AlreadyExistsError(
        absl::StrCat("layer ", layer, " of version ", step, " is uploaded already"));
  }
  if (offset != 0 && offset != received_[layer][part]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offset: expected ", received_[layer][part],
        " (or 0 to restart the part): the pieces of a part come in order; got ", offset));
  }
  piece_copying_ = true;
  return absl::OkStatus();
}

ClientLayerSync::PieceDone ClientLayerSync::EndPiece(uint32_t layer, uint32_t part, uint64_t offset,
                                                     uint64_t count) {
  piece_copying_ = false;
  received_[layer][part] = offset + count;
  PieceDone done;
  if (!LayerComplete(layer)) return done;
  done.layer_complete = true;
  done.all_complete =
      std::all_of(layers_.begin(), layers_.end(), [this](uint32_t l) { return LayerComplete(l); });
  if (done.all_complete) copy_version_ = upload_step_;
  return done;
}

absl::Status ClientLayerSync::CheckReadable(uint32_t layer, uint64_t running_step,
                                            uint64_t last_completed) const {
  if (CopyCurrent(running_step, last_completed)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "hostd's copy of layer ", layer, " is ", DescribeCopy(), " but the job is at step ",
      last_completed, running_step != 0 ? absl::StrCat(" (step ", running_step, " running)") : "",
      ": the ranks' state of it is newer; restart hostd from a checkpoint (--resume) to "
      "continue"));
}

}  // namespace slidedp::hostd
