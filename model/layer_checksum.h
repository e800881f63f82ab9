// The checksum of one layer's training state, as hostd reports it (ListLayers --checksums,
// TrainingState::LayerChecksum) and as reference trainers compute it to compare with hostd
// bit for bit.
#pragma once

#include <cstdint>

namespace slidedp::model {

// xxh64 (seed = layer index) over a layer's master, m, v (FP32) and params (BF16), in that
// order, each `n` elements. Pure; thread-safe.
uint64_t LayerStateChecksum(uint32_t layer, const float* master, const float* m, const float* v,
                            const uint16_t* params, uint64_t n);

}  // namespace slidedp::model
