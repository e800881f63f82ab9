#include "slidedpctl/json_convert.h"

#include <cmath>
#include <string>

#include "absl/strings/escaping.h"
#include "google/protobuf/descriptor.h"

namespace slidedp::ctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using nlohmann::ordered_json;

// Reflection is walked directly instead of round-tripping through MessageToJsonString: it gives
// exact 64-bit numbers without re-parsing strings and lets unset messages become null.

ordered_json FloatingToJson(double value) {
  // Same spelling as proto3 JSON; nlohmann would silently print null.
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return value;
}

ordered_json EnumToJson(const google::protobuf::EnumDescriptor* descriptor, int value) {
  const google::protobuf::EnumValueDescriptor* v = descriptor->FindValueByNumber(value);
  if (v == nullptr) return value;  // open proto3 enum: a value this build does not know
  return v->name();
}

ordered_json SingularToJson(const Message& message, const FieldDescriptor* field) {
  const Reflection* r = message.GetReflection();
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return r->GetInt32(message, field);
    case FieldDescriptor::CPPTYPE_INT64:
      return r->GetInt64(message, field);
    case FieldDescriptor::CPPTYPE_UINT32:
      return r->GetUInt32(message, field);
    case FieldDescriptor::CPPTYPE_UINT64:
      return r->GetUInt64(message, field);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return FloatingToJson(r->GetDouble(message, field));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return FloatingToJson(r->GetFloat(message, field));
    case FieldDescriptor::CPPTYPE_BOOL:
      return r->GetBool(message, field);
    case FieldDescriptor::CPPTYPE_ENUM:
      return EnumToJson(field->enum_type(), r->GetEnumValue(message, field));
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string value = r->GetString(message, field);
      if (field->type() == FieldDescriptor::TYPE_BYTES) return absl::Base64Escape(value);
      return value;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(r->GetMessage(message, field));
  }
  return nullptr;
}

ordered_json ElementToJson(const Message& message, const FieldDescriptor* field, int index) {
  const Reflection* r = message.GetReflection();
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return r->GetRepeatedInt32(message, field, index);
    case FieldDescriptor::CPPTYPE_INT64:
      return r->GetRepeatedInt64(message, field, index);
    case FieldDescriptor::CPPTYPE_UINT32:
      return r->GetRepeatedUInt32(message, field, index);
    case FieldDescriptor::CPPTYPE_UINT64:
      return r->GetRepeatedUInt64(message, field, index);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return FloatingToJson(r->GetRepeatedDouble(message, field, index));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return FloatingToJson(r->GetRepeatedFloat(message, field, index));
    case FieldDescriptor::CPPTYPE_BOOL:
      return r->GetRepeatedBool(message, field, index);
    case FieldDescriptor::CPPTYPE_ENUM:
      return EnumToJson(field->enum_type(), r->GetRepeatedEnumValue(message, field, index));
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string value = r->GetRepeatedString(message, field, index);
      if (field->type() == FieldDescriptor::TYPE_BYTES) return absl::Base64Escape(value);
      return value;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(r->GetRepeatedMessage(message, field, index));
  }
  return nullptr;
}

// A map field is a repeated entry message {key = 1, value = 2}; JSON keys are strings.
ordered_json MapToJson(const Message& message, const FieldDescriptor* field) {
  const Reflection* r = message.GetReflection();
  ordered_json object = ordered_json::object();
  for (int i = 0; i < r->FieldSize(message, field); ++i) {
    const Message& entry = r->GetRepeatedMessage(message, field, i);
    const FieldDescriptor* key_field = entry.GetDescriptor()->map_key();
    const FieldDescriptor* value_field = entry.GetDescriptor()->map_value();
    const ordered_json key = SingularToJson(entry, key_field);
    object[key.is_string() ? key.get<std::string>() : key.dump()] =
        SingularToJson(entry, value_field);
  }
  return object;
}

}  // namespace

ordered_json ProtoToJson(const Message& message) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const Reflection* r = message.GetReflection();
  ordered_json object = ordered_json::object();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    const std::string& key = field->name();
    if (field->is_map()) {
      object[key] = MapToJson(message, field);
    } else if (field->is_repeated()) {
      ordered_json array = ordered_json::array();
      for (int k = 0; k < r->FieldSize(message, field); ++k) {
        array.push_back(ElementToJson(message, field, k));
      }
      object[key] = std::move(array);
    } else if (field->real_containing_oneof() != nullptr) {
      if (r->HasField(message, field)) object[key] = SingularToJson(message, field);
    } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
               !r->HasField(message, field)) {
      object[key] = nullptr;
    } else {
      object[key] = SingularToJson(message, field);
    }
  }
  return object;
}

}  // namespace slidedp::ctl
