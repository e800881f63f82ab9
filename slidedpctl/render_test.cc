#include "slidedpctl/render.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "slidedpctl/fake_control_service.h"

namespace slidedp::ctl {
namespace {

using nlohmann::ordered_json;
using ::testing::HasSubstr;

TEST(LayerToJsonTest, BytesFollowsVersionAndSumsStateAndParams) {
  v1::LayerStatus layer;
  layer.set_version(3);
  layer.set_state_bytes(uint64_t{12} << 32);
  layer.set_param_bytes(uint64_t{2} << 32);
  const ordered_json json = LayerToJson(layer);
  std::vector<std::string> keys;
  for (const auto& [key, value] : json.items()) keys.push_back(key);
  ASSERT_GE(keys.size(), 6u);
  EXPECT_EQ(keys[4], "version");
  EXPECT_EQ(keys[5], "bytes");
  EXPECT_EQ(json["bytes"].get<uint64_t>(), uint64_t{14} << 32);
}

TEST(StatusToJsonTest, KeysInContractOrderAndNullJob) {
  const ordered_json json = StatusToJson(testing::CannedStatus());
  std::vector<std::string> keys;
  for (const auto& [key, value] : json.items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"daemon", "instance", "socket", "uptime_ms", "job",
                                            "layers", "ranks", "segments", "topology", "shm_bytes",
                                            "locked_bytes", "creating"}));
  EXPECT_TRUE(json["layers"][0].contains("bytes"));
  EXPECT_TRUE(json["creating"].is_null());

  v1::GetStatusResponse no_job = testing::CannedStatus();
  no_job.clear_job();
  EXPECT_TRUE(StatusToJson(no_job)["job"].is_null());
}

// A job being created (CreateJob, or hostd's --model at start): its phase and progress.
TEST(StatusToJsonTest, AJobBeingCreatedShowsItsPhaseAndProgress) {
  v1::GetStatusResponse st = testing::CannedStatus();
  st.clear_job();
  st.clear_layers();
  v1::JobCreation* c = st.mutable_creating();
  c->set_job_id("big");
  c->set_phase("initializing weights");
  c->set_done(12);
  c->set_total(36);
  c->set_unit("layers");
  c->set_elapsed_s(41.2);
  const ordered_json json = StatusToJson(st);
  EXPECT_EQ(json["creating"]["phase"], "initializing weights");
  EXPECT_EQ(json["creating"]["done"].get<uint64_t>(), 12u);
  std::ostringstream out;
  PrintStatus(st, out);
  EXPECT_THAT(out.str(),
              HasSubstr("big: being created, initializing weights 12 of 36 layers (41 s)"));
}

TEST(VersionToJsonTest, DaemonAndErrorAreNullWhenAbsent) {
  v1::BuildInfo client;
  client.set_component("slidedpctl");
  const ordered_json without = VersionToJson(client, nullptr, "cannot reach hostd");
  EXPECT_TRUE(without["daemon"].is_null());
  EXPECT_EQ(without["error"], "cannot reach hostd");
  const v1::BuildInfo daemon = testing::CannedStatus().daemon();
  const ordered_json with = VersionToJson(client, &daemon, "");
  EXPECT_EQ(with["daemon"]["component"], "hostd");
  EXPECT_EQ(with["daemon"]["features"], ordered_json::array({"cpu_reduction", "global_clip"}));
  EXPECT_TRUE(with["error"].is_null());
}

TEST(PrintStatusTest, NoJobSaysSo) {
  v1::GetStatusResponse status = testing::CannedStatus();
  status.clear_job();
  status.clear_layers();
  std::ostringstream out;
  PrintStatus(status, out);
  EXPECT_THAT(out.str(), ::testing::ContainsRegex("\njob +none\n"));
  EXPECT_THAT(out.str(), HasSubstr("no layers"));
}

TEST(PrintStatusTest, ShowsOptimizerAndRoutes) {
  std::ostringstream out;
  PrintStatus(testing::CannedStatus(), out);
  EXPECT_THAT(out.str(), HasSubstr("lr 0.0003 (now 0.00025), cosine schedule"));
  EXPECT_THAT(out.str(), HasSubstr("clip global at 1"));
  EXPECT_THAT(out.str(), HasSubstr("params replicated, grads cpu_reduction, chunk 4.0 MiB"));
  EXPECT_THAT(out.str(), HasSubstr("4.3G params"));
}

TEST(RanksTest, SlotsNoRankHoldsAreNotRows) {
  RankList ranks = testing::CannedRanks().ranks();
  v1::RankStatus* empty = ranks.Add();  // a third slot, never attached
  empty->set_rank(2);
  EXPECT_EQ(AttachedRanks(ranks).size(), 2);
  std::ostringstream printed;
  RanksTable(ranks).Print(printed);
  const std::string table = printed.str();
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 3) << table;  // header + 2 ranks
  EXPECT_THAT(table, ::testing::Not(::testing::ContainsRegex("\n +2 ")));

  RankList none;
  none.Add()->set_rank(0);
  std::ostringstream out;
  PrintRanks(none, out);
  EXPECT_EQ(out.str(), "no rank attached (world size 1)\n");
}

}  // namespace
}  // namespace slidedp::ctl
