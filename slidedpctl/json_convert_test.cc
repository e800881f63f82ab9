#include "slidedpctl/json_convert.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::ctl {
namespace {

using nlohmann::ordered_json;

TEST(ProtoToJsonTest, SixtyFourBitIntegersAreExactNumbers) {
  v1::LayerStatus layer;
  layer.set_numel(std::numeric_limits<uint64_t>::max());
  const ordered_json json = ProtoToJson(layer);
  ASSERT_TRUE(json["numel"].is_number_unsigned());
  EXPECT_EQ(json["numel"].get<uint64_t>(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(json.dump().find("\"18446744073709551615\""), std::string::npos);

  v1::TensorLayout tensor;
  tensor.add_shape(-1);
  tensor.add_shape(int64_t{1} << 40);
  const ordered_json shape = ProtoToJson(tensor)["shape"];
  EXPECT_EQ(shape, ordered_json::array({-1, int64_t{1} << 40}));
}

TEST(ProtoToJsonTest, EveryFieldPresentInDeclarationOrder) {
  const ordered_json json = ProtoToJson(v1::LayerStatus());
  std::vector<std::string> keys;
  for (const auto& [key, value] : json.items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"layer", "name", "kind", "numel", "version",
                                            "state_bytes", "param_bytes", "numa_node",
                                            "skipped_steps", "last_grad_norm", "checksum"}));
  EXPECT_EQ(json["layer"], 0);
  EXPECT_EQ(json["name"], "");
  EXPECT_EQ(json["kind"], "LAYER_KIND_UNSPECIFIED");
}

TEST(ProtoToJsonTest, UnsetMessagesAreNullAndRepeatedAreArrays) {
  v1::GetStatusResponse status;
  const ordered_json json = ProtoToJson(status);
  EXPECT_TRUE(json["daemon"].is_null());
  EXPECT_TRUE(json["job"].is_null());
  EXPECT_TRUE(json["topology"].is_null());
  EXPECT_EQ(json["layers"], ordered_json::array());

  status.mutable_topology()->set_cores(8);
  EXPECT_EQ(ProtoToJson(status)["topology"]["cores"], 8);
}

TEST(ProtoToJsonTest, EnumsByNameAndUnknownEnumsByNumber) {
  v1::LayerStatus layer;
  layer.set_kind(v1::LAYER_KIND_DECODER);
  EXPECT_EQ(ProtoToJson(layer)["kind"], "LAYER_KIND_DECODER");
  layer.set_kind(static_cast<v1::LayerKind>(42));
  EXPECT_EQ(ProtoToJson(layer)["kind"], 42);
}

TEST(ProtoToJsonTest, NonFiniteDoublesUseProto3Spelling) {
  v1::LayerStatus layer;
  layer.set_last_grad_norm(std::nan(""));
  EXPECT_EQ(ProtoToJson(layer)["last_grad_norm"], "NaN");
  layer.set_last_grad_norm(-std::numeric_limits<double>::infinity());
  EXPECT_EQ(ProtoToJson(layer)["last_grad_norm"], "-Infinity");
  layer.set_last_grad_norm(0.25);
  EXPECT_EQ(ProtoToJson(layer)["last_grad_norm"], 0.25);
}

TEST(ProtoToJsonTest, BytesAreBase64) {
  v1::FetchCommIdResponse response;
  response.set_unique_id(std::string("\x00\x01\xff", 3));
  EXPECT_EQ(ProtoToJson(response)["unique_id"], "AAH/");
}

TEST(ProtoToJsonTest, OnlyTheSetOneofMemberIsPresent) {
  v1::SessionEvent event;
  event.mutable_step_begun()->set_step(7);
  const ordered_json json = ProtoToJson(event);
  EXPECT_EQ(json.size(), 1u);
  EXPECT_EQ(json["step_begun"]["step"], 7);
}

TEST(ProtoToJsonArrayTest, OneElementPerMessage) {
  v1::GetConfigResponse config;
  config.add_entries()->set_key("a");
  config.add_entries()->set_key("b");
  const ordered_json json = ProtoToJsonArray(config.entries());
  ASSERT_EQ(json.size(), 2u);
  EXPECT_EQ(json[1]["key"], "b");
  EXPECT_EQ(json[1]["source"], "");
}

}  // namespace
}  // namespace slidedp::ctl
