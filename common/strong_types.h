// Small strong types for ids so that one cannot be passed for another (LayerId vs RankId vs
// Version). Trivially copyable; usable inside shared-memory structs through .value().
#pragma once

#include <compare>
#include <cstdint>
#include <functional>

namespace slidedp {

template <typename Tag, typename Rep>
class StrongId {
 public:
  using rep_type = Rep;
  constexpr StrongId() = default;
  constexpr explicit StrongId(Rep v) : value_(v) {}
  constexpr Rep value() const { return value_; }
  constexpr auto operator<=>(const StrongId&) const = default;

 private:
  Rep value_{};
};

using LayerId = StrongId<struct LayerIdTag, uint32_t>;
using RankId = StrongId<struct RankIdTag, uint32_t>;
// A layer's committed parameter version: 0 after init, t after the update of step t.
using Version = StrongId<struct VersionTag, uint64_t>;
using StepId = StrongId<struct StepIdTag, uint64_t>;

}  // namespace slidedp

template <typename Tag, typename Rep>
struct std::hash<slidedp::StrongId<Tag, Rep>> {
  size_t operator()(const slidedp::StrongId<Tag, Rep>& id) const noexcept {
    return std::hash<Rep>()(id.value());
  }
};
