// The one path from a protobuf message to the JSON slidedpctl prints with --json.
//
// It follows the proto3 JSON mapping (proto field names as keys, enums by name, bytes as base64,
// NaN/Infinity as strings) with three deliberate differences, so that scripts can use the output
// without knowing proto3's quirks:
//   - 64-bit integers are JSON numbers, not strings (jq and Python can do arithmetic on them);
//   - every field is present: primitives at their default, repeated fields as [], and unset
//     singular message fields as null (unset oneof members are left out);
//   - keys appear in field-declaration order.
// Well-known types (Timestamp, Any, ...) get no special mapping; slidedp.v1 does not use them.
//
// Command-specific reshaping (e.g. a layer's `bytes`) happens on the result in render.h.
// Pure and thread-safe.
#pragma once

#include "google/protobuf/message.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "nlohmann/json.hpp"

namespace slidedp::ctl {

nlohmann::ordered_json ProtoToJson(const google::protobuf::Message& message);

// A JSON array of ProtoToJson(element) for each element, in order.
template <typename T>
nlohmann::ordered_json ProtoToJsonArray(const google::protobuf::RepeatedPtrField<T>& messages) {
  nlohmann::ordered_json array = nlohmann::ordered_json::array();
  for (const T& message : messages) array.push_back(ProtoToJson(message));
  return array;
}

}  // namespace slidedp::ctl
