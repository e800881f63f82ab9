#include "model/layer_checksum.h"

#include <xxhash.h>

namespace slidedp::model {

uint64_t LayerStateChecksum(uint32_t layer, const float* master, const float* m, const float* v,
                            const uint16_t* params, uint64_t n) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, layer);
  XXH64_update(st, master, n * sizeof(float));
  XXH64_update(st, m, n * sizeof(float));
  XXH64_update(st, v, n * sizeof(float));
  XXH64_update(st, params, n * sizeof(uint16_t));
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

}  // namespace slidedp::model
