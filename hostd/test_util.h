// Helpers shared by hostd's tests: unique instance names and small models.
#pragma once

#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "model/manifest.h"

namespace slidedp::hostd::testing {

// An instance name unique to this process and call, so tests never collide in /dev/shm.
inline std::string UniqueInstance(const std::string& tag) {
  static std::atomic<int> counter{0};
  return absl::StrCat("t", getpid(), "-", tag, "-", counter.fetch_add(1));
}

// A group this process may give its files other than its own when it can: as root any (nobody's,
// 65534), else a supplementary group; else its own group (the gid checks are trivial then).
inline gid_t OtherGroup() {
  if (geteuid() == 0) return 65534;
  gid_t groups[256];
  const int n = getgroups(256, groups);
  for (int i = 0; i < n; ++i) {
    if (groups[i] != getegid()) return groups[i];
  }
  return getegid();
}

// A two-layer model: layer 0 holds a norm weight (no decay) and a 2-D weight; layer 1 one
// weight. Sizes hit kernel tails and span several stats blocks.
inline model::LoadedModel SmallModel() {
  model::LoadedModel m;
  auto* man = &m.manifest;
  man->set_family("test");
  man->set_name("small");
  auto* l0 = man->add_layers();
  l0->set_name("block0");
  l0->set_kind(slidedp::v1::LAYER_KIND_DECODER);
  auto* t0 = l0->add_tensors();
  t0->set_name("block0.norm.weight");
  t0->add_shape(37);
  t0->set_dtype(slidedp::v1::DTYPE_BF16);
  t0->set_no_decay(true);
  auto* t1 = l0->add_tensors();
  t1->set_name("block0.proj.weight");
  t1->add_shape(129);
  t1->add_shape(77);
  t1->set_dtype(slidedp::v1::DTYPE_BF16);
  auto* l1 = man->add_layers();
  l1->set_name("block1");
  l1->set_kind(slidedp::v1::LAYER_KIND_DECODER);
  auto* t2 = l1->add_tensors();
  t2->set_name("block1.proj.weight");
  t2->add_shape(5000);
  t2->add_shape(3);
  t2->set_dtype(slidedp::v1::DTYPE_BF16);
  m.initializer_range = 0.02;
  m.source = "test";
  return m;
}

}  // namespace slidedp::hostd::testing
