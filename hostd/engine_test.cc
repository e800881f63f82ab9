// The engine in process, behind its real gRPC service on a temporary unix socket: every RPC's
// bad input gets its specific status and a message naming the field, and leaves the state
// untouched (checksum before and after); a session stream's end aborts a running step.
#include "hostd/engine.h"

#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/instance_files.h"
#include "common/shm_segment.h"
#include "common/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hostd/service.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"
#include "model/checkpoint_format.h"
#include "rankclient/rank_client.h"
#include "slidedp/v1/control.grpc.pb.h"

namespace slidedp::hostd {
namespace {

namespace v1 = slidedp::v1;
using ::testing::HasSubstr;
using testing::UniqueInstance;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / UniqueInstance("sock");
    std::filesystem::create_directories(dir_);
    config_.instance = UniqueInstance("eng");
    config_.socket = (dir_ / "hostd.sock").string();
    config_.model = "tiny";
    config_.update_threads = 2;
    config_.heartbeat_interval_ms = 100;
    config_.heartbeat_deadline_ms = 1000;
    config_.optimizer.set_lr(1e-3);
    config_.routes.set_chunk_bytes(16 << 20);
  }
  void TearDown() override {
    server_.reset();
    if (engine_) engine_->Shutdown(/*remove_state=*/true).IgnoreError();
    engine_.reset();
    // A stop that could not checkpoint the final state keeps the segments for the next hostd
    // (Shutdown's contract); no test leaves them in /dev/shm.
    for (auto kind : {shm::SegmentKind::kControl, shm::SegmentKind::kState,
                      shm::SegmentKind::kParams, shm::SegmentKind::kGrads}) {
      ShmSegment::Remove(SegmentName(config_.instance, kind)).IgnoreError();
    }
    std::filesystem::remove_all(dir_);
  }
  void Start(std::optional<Topology> topology = std::nullopt) {
    auto e = Engine::Create(config_, {}, std::move(topology));
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    auto s = ControlServer::Start(engine_.get(), {config_.socket, "", 0600});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel("unix:" + config_.socket, grpc::InsecureChannelCredentials());
    stub_ = v1::Control::NewStub(channel_);
  }
  uint64_t Checksum() { return engine_->state() ? engine_->state()->Checksum() : 0; }
  std::string Hash() { return engine_->state()->model().manifest.manifest_hash(); }

  v1::AttachRankResponse Attach(uint32_t rank, int32_t gpu = -1) {
    grpc::ClientContext ctx;
    v1::AttachRankRequest req;
    req.set_rank(rank);
    req.set_manifest_hash(Hash());
    req.set_pid(getpid());
    req.set_gpu(gpu);
    v1::AttachRankResponse resp;
    grpc::Status s = stub_->AttachRank(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  grpc::Status Detach(uint32_t rank, const std::string& token) {
    grpc::ClientContext ctx;
    v1::DetachRankRequest d;
    d.set_rank(rank);
    d.set_attach_token(token);
    v1::DetachRankResponse dr;
    return stub_->DetachRank(&ctx, d, &dr);
  }

  std::filesystem::path dir_;
  HostdConfig config_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ControlServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Control::Stub> stub_;
};

TEST_F(EngineTest, StatusListsEveryLayerWithVersionBytesAndNuma) {
  Start();
  grpc::ClientContext ctx;
  v1::GetStatusResponse st;
  ASSERT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
  EXPECT_TRUE(st.has_job());
  EXPECT_EQ(st.job().family(), "qwen3");
  // tiny: embedding, 4 decoder layers, final norm, lm_head.
  ASSERT_EQ(st.layers_size(), 7);
  EXPECT_EQ(st.layers(0).name(), "model.embed_tokens");
  EXPECT_EQ(st.layers(6).name(), "lm_head");
  uint64_t total = 0;
  for (const auto& l : st.layers()) {
    EXPECT_EQ(l.version(), 0u);
    EXPECT_GE(l.state_bytes(), 12 * l.numel());
    EXPECT_GE(l.param_bytes(), 2 * l.numel());
    EXPECT_GE(l.numa_node(), 0);
    total += l.numel();
  }
  EXPECT_EQ(total, st.job().total_params());
  EXPECT_EQ(st.segments_size(), 4);
  EXPECT_GT(st.shm_bytes(), 14 * total);
  EXPECT_EQ(st.daemon().version(), kVersion);
}

TEST_F(EngineTest, HandshakeVersionSkewIsFailedPreconditionNamingBoth) {
  Start();
  grpc::ClientContext ctx;
  v1::HandshakeRequest req;
  req.mutable_client()->set_component("rankclient");
  req.mutable_client()->set_version("9.9.9");
  req.mutable_client()->set_protocol_version(kProtocolVersion + 1);
  v1::HandshakeResponse resp;
  grpc::Status s = stub_->Handshake(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("9.9.9"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find(kVersion), std::string::npos) << s.error_message();
  // The same protocol with another shared-memory ABI: refused, both ABI versions named.
  grpc::ClientContext ctx_abi;
  req.mutable_client()->set_protocol_version(kProtocolVersion);
  req.mutable_client()->set_shm_abi_version(kShmAbiVersion + 1);
  s = stub_->Handshake(&ctx_abi, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find(
                absl::StrCat("uses shm_abi_version ", kShmAbiVersion + 1, " but hostd")),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find(absl::StrCat("uses shm_abi_version ", kShmAbiVersion, ";")),
            std::string::npos)
      << s.error_message();
  grpc::ClientContext ctx2;
  req.mutable_client()->set_shm_abi_version(kShmAbiVersion);
  EXPECT_TRUE(stub_->Handshake(&ctx2, req, &resp).ok());
  EXPECT_EQ(resp.daemon().component(), "hostd");
}

TEST_F(EngineTest, RankRefusesSegmentOfAnotherShmAbiNamingBothVersions) {
  Start();
  const std::string params = SegmentName(config_.instance, shm::SegmentKind::kParams);
  {
    auto seg = ShmSegment::Open(params, /*writable=*/true);
    ASSERT_TRUE(seg.ok()) << seg.status();
    seg->at<shm::SegmentHeader>(0)->abi_version = shm::kAbiVersion + 1;
  }
  rankclient::RankClient::Options o;
  o.socket = config_.socket;
  o.rank = 0;
  o.manifest_hash = Hash();
  auto c = rankclient::RankClient::Attach(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find(absl::StrCat("has shm abi_version ", shm::kAbiVersion + 1,
                                                   " but this rankclient uses shm abi_version ",
                                                   shm::kAbiVersion)),
            std::string::npos)
      << c.status();
  auto seg = ShmSegment::Open(params, /*writable=*/true);
  ASSERT_TRUE(seg.ok());
  seg->at<shm::SegmentHeader>(0)->abi_version = shm::kAbiVersion;
}

TEST_F(EngineTest, BadInputGetsSpecificStatusAndLeavesStateUntouched) {
  Start();
  const uint64_t before = Checksum();
  auto call = [&](auto method, const auto& req, auto* resp) {
    grpc::ClientContext ctx;
    return (stub_.get()->*method)(&ctx, req, resp);
  };
  struct Case {
    std::string what;
    grpc::Status status;
    grpc::StatusCode code;
    std::string needle;
  };
  std::vector<Case> cases;
  {
    v1::AttachRankRequest r;
    r.set_job_id("nope");
    r.set_manifest_hash(Hash());
    v1::AttachRankResponse resp;
    cases.push_back({"unknown job", call(&v1::Control::Stub::AttachRank, r, &resp),
                     grpc::StatusCode::NOT_FOUND, "job_id"});
    r.set_job_id("");
    r.set_rank(1);  // world size 1
    cases.push_back({"rank out of range", call(&v1::Control::Stub::AttachRank, r, &resp),
                     grpc::StatusCode::OUT_OF_RANGE, "rank"});
    r.set_rank(0);
    r.set_manifest_hash("0123456789abcdef");
    cases.push_back({"wrong manifest hash", call(&v1::Control::Stub::AttachRank, r, &resp),
                     grpc::StatusCode::FAILED_PRECONDITION, "manifest_hash"});
  }
  {
    v1::CreateJobRequest r;
    v1::CreateJobResponse resp;
    cases.push_back({"empty manifest", call(&v1::Control::Stub::CreateJob, r, &resp),
                     grpc::StatusCode::INVALID_ARGUMENT, "manifest"});
    *r.mutable_spec()->mutable_manifest() = testing::SmallModel().manifest;
    cases.push_back({"second, different job", call(&v1::Control::Stub::CreateJob, r, &resp),
                     grpc::StatusCode::ALREADY_EXISTS, "already exists"});
  }
  {
    v1::BeginStepRequest r;
    r.set_step(1);
    v1::BeginStepResponse resp;
    cases.push_back({"begin step unattached", call(&v1::Control::Stub::BeginStep, r, &resp),
                     grpc::StatusCode::FAILED_PRECONDITION, "not attached"});
    v1::AbortStepRequest a;
    a.set_step(1);
    v1::AbortStepResponse aresp;
    cases.push_back({"abort idle step", call(&v1::Control::Stub::AbortStep, a, &aresp),
                     grpc::StatusCode::FAILED_PRECONDITION, "step"});
  }
  {
    v1::PublishCommIdRequest r;
    r.set_rank(1);
    r.set_unique_id(std::string(128, 'x'));
    r.set_generation(1);
    v1::PublishCommIdResponse resp;
    cases.push_back({"publish from rank 1 of a job of one rank",
                     call(&v1::Control::Stub::PublishCommId, r, &resp),
                     grpc::StatusCode::OUT_OF_RANGE, "rank: expected 0..0"});
    r.set_rank(0);
    cases.push_back({"publish unattached", call(&v1::Control::Stub::PublishCommId, r, &resp),
                     grpc::StatusCode::FAILED_PRECONDITION, "rank 0 is not attached"});
    const std::string token = Attach(0).attach_token();
    r.set_attach_token("forged");
    cases.push_back({"publish with a forged token",
                     call(&v1::Control::Stub::PublishCommId, r, &resp),
                     grpc::StatusCode::PERMISSION_DENIED, "attach_token"});
    r.set_attach_token(token);
    r.set_unique_id("");
    cases.push_back({"empty comm id", call(&v1::Control::Stub::PublishCommId, r, &resp),
                     grpc::StatusCode::INVALID_ARGUMENT, "unique_id"});
    r.set_unique_id("x");
    r.set_generation(0);
    cases.push_back({"comm id of generation 0", call(&v1::Control::Stub::PublishCommId, r, &resp),
                     grpc::StatusCode::INVALID_ARGUMENT, "generation: expected >= 1"});
    v1::FetchCommIdRequest f;
    f.set_wait_ms(50);
    f.set_generation(1);
    f.set_attach_token(token);
    v1::FetchCommIdResponse fresp;
    cases.push_back({"fetch before publish", call(&v1::Control::Stub::FetchCommId, f, &fresp),
                     grpc::StatusCode::DEADLINE_EXCEEDED, "published"});
    v1::BeginStepRequest b;
    b.set_step(1);
    v1::BeginStepResponse bresp;
    cases.push_back({"begin step without the token", call(&v1::Control::Stub::BeginStep, b, &bresp),
                     grpc::StatusCode::PERMISSION_DENIED, "attach_token"});
    v1::DetachRankRequest d;
    d.set_attach_token(token);
    v1::DetachRankResponse dresp;
    EXPECT_TRUE(call(&v1::Control::Stub::DetachRank, d, &dresp).ok());
  }
  {
    v1::UpdateHyperParamsRequest r;
    r.add_fields("momentum");
    v1::UpdateHyperParamsResponse resp;
    cases.push_back({"unknown hyper-parameter",
                     call(&v1::Control::Stub::UpdateHyperParams, r, &resp),
                     grpc::StatusCode::INVALID_ARGUMENT, "fields"});
    r.clear_fields();
    r.add_fields("lr");
    r.mutable_optimizer()->set_lr(-5);
    cases.push_back({"negative lr", call(&v1::Control::Stub::UpdateHyperParams, r, &resp),
                     grpc::StatusCode::INVALID_ARGUMENT, "optimizer.lr"});
  }
  {
    v1::ListLayersRequest r;
    r.set_job_id("other");
    v1::ListLayersResponse resp;
    cases.push_back({"layers of unknown job", call(&v1::Control::Stub::ListLayers, r, &resp),
                     grpc::StatusCode::NOT_FOUND, "job_id"});
  }
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.error_code(), c.code) << c.what << ": " << c.status.error_message();
    EXPECT_NE(c.status.error_message().find(c.needle), std::string::npos)
        << c.what << ": " << c.status.error_message();
  }
  // In-process data-plane input: unknown layer, wrong size, future step.
  std::vector<uint16_t> g(10);
  EXPECT_EQ(engine_->SubmitGradient(99, 1, {g.data(), kernels::GradType::kBf16, g.size()}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->SubmitGradient(1, 1, {g.data(), kernels::GradType::kBf16, g.size()}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->SubmitGradient(1, 7, {g.data(), kernels::GradType::kBf16, g.size()}).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Checksum(), before);
  for (uint32_t l = 0; l < engine_->state()->num_layers(); ++l) {
    EXPECT_EQ(engine_->state()->committed_version(l), 0u);
  }
}

TEST_F(EngineTest, DuplicateAttachIsAlreadyExists) {
  Start();
  Attach(0);
  grpc::ClientContext ctx;
  v1::AttachRankRequest req;
  req.set_manifest_hash(Hash());
  v1::AttachRankResponse resp;
  grpc::Status s = stub_->AttachRank(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
}

TEST_F(EngineTest, AttachBeforeModelExistsIsFailedPrecondition) {
  config_.model = "none";
  Start();
  grpc::ClientContext ctx;
  v1::AttachRankRequest req;
  v1::AttachRankResponse resp;
  grpc::Status s = stub_->AttachRank(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("before the model exists"), std::string::npos);
  // CreateJob from a manifest, then attach works and returns the layout.
  grpc::ClientContext c2;
  v1::CreateJobRequest cj;
  *cj.mutable_spec()->mutable_manifest() = testing::SmallModel().manifest;
  cj.mutable_spec()->set_world_size(2);
  v1::CreateJobResponse cjr;
  grpc::Status cs = stub_->CreateJob(&c2, cj, &cjr);
  ASSERT_TRUE(cs.ok()) << cs.error_message();
  EXPECT_EQ(cjr.spec().world_size(), 2u);
  EXPECT_EQ(cjr.spec().optimizer().beta2(), 0.999);
  v1::AttachRankResponse a = Attach(1);
  EXPECT_EQ(a.layout().layers_size(), 2);
  EXPECT_EQ(a.layout().segments_size(), 3);  // control, params, grads; never the state segment
  EXPECT_EQ(a.layout().layers(0).tensors(1).name(), "block0.proj.weight");
  EXPECT_EQ(a.layout().layers(0).tensors(1).offset_elements(), 37u);
  // The same manifest again is idempotent.
  grpc::ClientContext c3;
  EXPECT_TRUE(stub_->CreateJob(&c3, cj, &cjr).ok());
}

// CreateJob and UpdateHyperParams refuse what the configuration refuses (model/job_spec.h):
// a chunk_bytes the ring arithmetic wraps on (2^62: the grads segment came out 4096 bytes
// long and a rank's push crashed hostd), unknown enum values (schedule 99 ran as cosine), and
// no job or segment is left behind by a refused CreateJob.
TEST_F(EngineTest, CreateJobAndHyperParamsRefuseWhatTheConfigRefuses) {
  config_.model = "none";
  Start();
  auto create = [&](const std::function<void(v1::JobSpec&)>& mutate) {
    v1::CreateJobRequest req;
    *req.mutable_spec()->mutable_manifest() = testing::SmallModel().manifest;
    req.mutable_spec()->set_world_size(2);
    mutate(*req.mutable_spec());
    grpc::ClientContext ctx;
    v1::CreateJobResponse resp;
    return stub_->CreateJob(&ctx, req, &resp);
  };
  struct Case {
    const char* what;
    std::function<void(v1::JobSpec&)> mutate;
    const char* needle;
  } cases[] = {
      {"chunk_bytes 2^62", [](v1::JobSpec& s) { s.mutable_routes()->set_chunk_bytes(1ull << 62); },
       "spec.routes.chunk_bytes: must be a multiple of 4096 from 4KiB to 1GiB"},
      {"chunk_bytes 1 GiB + 4 KiB",
       [](v1::JobSpec& s) { s.mutable_routes()->set_chunk_bytes((1ull << 30) + 4096); },
       "spec.routes.chunk_bytes"},
      {"param_route 99",
       [](v1::JobSpec& s) { s.mutable_routes()->set_param_route(static_cast<v1::ParamRoute>(99)); },
       "spec.routes.param_route: invalid value 99"},
      {"grad_route 99",
       [](v1::JobSpec& s) { s.mutable_routes()->set_grad_route(static_cast<v1::GradRoute>(99)); },
       "spec.routes.grad_route: invalid value 99"},
      {"schedule 99",
       [](v1::JobSpec& s) {
         s.mutable_optimizer()->set_schedule(static_cast<v1::LrScheduleKind>(99));
       },
       "spec.optimizer.schedule: invalid value 99"},
      {"clip 99",
       [](v1::JobSpec& s) { s.mutable_optimizer()->set_clip(static_cast<v1::ClipPolicy>(99)); },
       "spec.optimizer.clip: invalid value 99"},
      {"world_size 65", [](v1::JobSpec& s) { s.set_world_size(65); }, "spec.world_size"},
      {"job_id with a slash", [](v1::JobSpec& s) { s.set_job_id("../x"); }, "spec.job_id"},
  };
  for (const Case& c : cases) {
    grpc::Status s = create(c.mutate);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.needle), std::string::npos)
        << c.what << ": " << s.error_message();
    EXPECT_EQ(engine_->state(), nullptr) << c.what;
    EXPECT_FALSE(ShmSegment::Exists(SegmentName(config_.instance, shm::SegmentKind::kGrads)))
        << c.what;
  }
  ASSERT_TRUE(create([](v1::JobSpec&) {}).ok());
  const v1::OptimizerConfig before = engine_->worker()->optimizer();
  auto update = [&](const char* field, const std::function<void(v1::OptimizerConfig&)>& set) {
    v1::UpdateHyperParamsRequest req;
    req.add_fields(field);
    set(*req.mutable_optimizer());
    grpc::ClientContext ctx;
    v1::UpdateHyperParamsResponse resp;
    return stub_->UpdateHyperParams(&ctx, req, &resp);
  };
  for (const auto& [field, set] :
       std::vector<std::pair<const char*, std::function<void(v1::OptimizerConfig&)>>>{
           {"schedule", [](auto& o) { o.set_schedule(static_cast<v1::LrScheduleKind>(99)); }},
           {"clip", [](auto& o) { o.set_clip(static_cast<v1::ClipPolicy>(7)); }},
           {"lr", [](auto& o) { o.set_lr(std::numeric_limits<double>::infinity()); }},
           {"min_lr_ratio", [](auto& o) { o.set_min_lr_ratio(std::nan("")); }}}) {
    grpc::Status s = update(field, set);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_NE(s.error_message().find(absl::StrCat("optimizer.", field, ": ")), std::string::npos)
        << s.error_message();
  }
  EXPECT_EQ(engine_->worker()->optimizer().SerializeAsString(), before.SerializeAsString());
}

TEST_F(EngineTest, StepThroughTheWorkerCompletesAndUpdatesStats) {
  Start();
  TrainingState* s = engine_->state();
  std::vector<std::vector<uint16_t>> grads;
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0, 1e-2f);
  for (const LayerInfo& l : s->layers()) {
    grads.emplace_back(l.numel);
    for (auto& x : grads.back()) x = kernels::RoundToBf16(d(rng));
  }
  const uint64_t before = s->Checksum();
  for (uint32_t l = s->num_layers(); l-- > 0;) {  // backward order
    ASSERT_TRUE(
        engine_->SubmitGradient(l, 1, {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
            .ok());
  }
  for (uint32_t l = 0; l < s->num_layers(); ++l) {
    ASSERT_TRUE(engine_->WaitLayerVersion(l, 1, std::chrono::seconds(10)).ok());
  }
  EXPECT_NE(s->Checksum(), before);
  // The last version is published just before the worker reports the layer done and the step
  // closes: poll briefly for the step's bookkeeping.
  v1::GetStatsResponse stats;
  for (int i = 0; i < 500; ++i) {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    if (stats.steps_completed() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(stats.layer_updates(), s->num_layers());
  EXPECT_EQ(stats.update_params_total(), s->total_params());
  EXPECT_EQ(stats.steps_completed(), 1u);
  EXPECT_GT(stats.update_gparams_per_second(), 0);
  EXPECT_FALSE(stats.isa().empty());
  auto timeout = engine_->WaitLayerVersion(0, 2, std::chrono::milliseconds(50));
  EXPECT_EQ(timeout.code(), absl::StatusCode::kDeadlineExceeded);
}

// The TCP listener is open to every local user, so the socket's mode protects nothing there:
// each call over it must carry the service token (it needed none), a listener without a token
// is refused, and "loopback" is an exact address, not a prefix ("127.0.0.1.nip.io" passed).
TEST_F(EngineTest, CallsOverTcpCarryTheServiceToken) {
  auto e = Engine::Create(config_);
  ASSERT_TRUE(e.ok()) << e.status();
  engine_ = std::move(*e);
  const std::string token(48, 'q');
  for (const char* bad : {"127.0.0.1.nip.io:0", "localhost.example:0", "0.0.0.0:0"}) {
    auto refused =
        ControlServer::Start(engine_.get(), {config_.socket, bad, 0600, gid_t(-1), token});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto no_token = ControlServer::Start(engine_.get(), {config_.socket, "127.0.0.1:0", 0600});
  EXPECT_EQ(no_token.status().code(), absl::StatusCode::kInvalidArgument) << no_token.status();
  EXPECT_NE(no_token.status().message().find("service token"), std::string::npos);
  auto s =
      ControlServer::Start(engine_.get(), {config_.socket, "127.0.0.1:0", 0600, gid_t(-1), token});
  ASSERT_TRUE(s.ok()) << s.status();
  server_ = std::move(*s);
  const std::string tcp = absl::StrCat("127.0.0.1:", server_->tcp_port());
  auto over_tcp =
      v1::Control::NewStub(grpc::CreateChannel(tcp, grpc::InsecureChannelCredentials()));
  auto status_with = [&](v1::Control::Stub* stub, const std::string& bearer) {
    grpc::ClientContext ctx;
    if (!bearer.empty()) ctx.AddMetadata("authorization", bearer);
    v1::GetStatusResponse st;
    return stub->GetStatus(&ctx, v1::GetStatusRequest(), &st);
  };
  grpc::Status none = status_with(over_tcp.get(), "");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << none.error_message();
  EXPECT_NE(none.error_message().find("SLIDEDP_TOKEN_FILE"), std::string::npos);
  EXPECT_EQ(status_with(over_tcp.get(), "Bearer " + std::string(48, 'x')).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(status_with(over_tcp.get(), token).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(status_with(over_tcp.get(), "Bearer " + token).ok());
  {
    grpc::ClientContext ctx;  // a rank RPC too, before anything else is checked
    v1::AttachRankRequest req;
    req.set_manifest_hash(Hash());
    v1::AttachRankResponse resp;
    EXPECT_EQ(over_tcp->AttachRank(&ctx, req, &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // The unix socket needs none: its mode is the access control.
  channel_ = grpc::CreateChannel("unix:" + config_.socket, grpc::InsecureChannelCredentials());
  stub_ = v1::Control::NewStub(channel_);
  EXPECT_TRUE(status_with(stub_.get(), "").ok());
  // A rank over TCP reads the token from its file and trains; without one it is told how.
  const std::string file = (dir_ / "token").string();
  { std::ofstream(file) << token << "\n"; }
  ASSERT_EQ(chmod(file.c_str(), 0640), 0);
  rankclient::RankClient::Options o;
  o.tcp = tcp;
  o.manifest_hash = Hash();
  o.timeout_ms = 10000;
  auto untokened = rankclient::RankClient::Attach(o);
  EXPECT_EQ(untokened.status().code(), absl::StatusCode::kFailedPrecondition) << untokened.status();
  o.token_file = file;
  auto rank = rankclient::RankClient::Attach(o);
  ASSERT_TRUE(rank.ok()) << rank.status();
  EXPECT_TRUE((*rank)->BeginStep(1, std::chrono::seconds(10)).ok());
}

// Stalls the thread that touches g_stall_page (PROT_NONE) until the test releases it: the
// reader is held in the middle of its pass with whatever locks it holds, and nothing in hostd
// needs a hook for it.
std::atomic<void*> g_stall_page{nullptr};
std::atomic<bool> g_stall_hit{false};
std::atomic<bool> g_stall_release{false};
void StallOnFault(int, siginfo_t* info, void*) {
  auto* page = static_cast<char*>(g_stall_page.load());
  auto* at = static_cast<char*>(info->si_addr);
  if (page == nullptr || at < page || at >= page + 4096) {
    signal(SIGSEGV, SIG_DFL);  // not ours: the fault repeats and kills the test as it should
    return;
  }
  g_stall_hit.store(true);
  while (!g_stall_release.load()) {
    timespec ts{0, 1000000};
    nanosleep(&ts, nullptr);
  }
}

// ListLayers --checksums reads the whole state (GBs for a real model); held in the middle of
// that pass, it must not hold the engine's lock: GetStatus (the watchdog's probe) answers.
// The pass ran under the lock, so every step's bookkeeping and status query waited for it.
TEST_F(EngineTest, ChecksumPassDoesNotHoldTheEngineLock) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "TSan defers signals: the stall would not hold the reader";
#endif
  Start();
  const uint64_t expected = engine_->state()->LayerChecksum(0);
  void* page = engine_->state()->master(0);  // page aligned (shm::kPayloadAlign)
  struct sigaction sa {
  }, old{};
  sa.sa_sigaction = StallOnFault;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(sigaction(SIGSEGV, &sa, &old), 0);
  g_stall_hit = false;
  g_stall_release = false;
  g_stall_page = page;
  ASSERT_EQ(mprotect(page, 4096, PROT_NONE), 0);
  v1::ListLayersResponse layers;
  std::future<grpc::Status> listed = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::ListLayersRequest req;
    req.set_checksums(true);
    return stub_->ListLayers(&ctx, req, &layers);
  });
  for (int i = 0; i < 30000 && !g_stall_hit.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool hit = g_stall_hit.load();
  grpc::Status status_call = grpc::Status::OK;
  if (hit) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetStatusResponse st;
    status_call = stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st);
  }
  ASSERT_EQ(mprotect(page, 4096, PROT_READ | PROT_WRITE), 0);
  g_stall_release = true;
  ASSERT_EQ(listed.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const grpc::Status ls = listed.get();
  g_stall_page = nullptr;
  sigaction(SIGSEGV, &old, nullptr);
  ASSERT_TRUE(hit) << "the checksum pass never reached the state";
  EXPECT_TRUE(status_call.ok()) << "GetStatus waited for the checksum pass: "
                                << status_call.error_message();
  ASSERT_TRUE(ls.ok()) << ls.error_message();
  EXPECT_EQ(layers.layers(0).checksum(), absl::StrFormat("%016x", expected));
}

// A clean stop whose final checkpoint cannot be written (here checkpoint.dir has become a file;
// a full disk does the same) keeps the shared memory, re-adoptable, and says so: it removed the
// segments, and everything since the last committed checkpoint was gone.
TEST_F(EngineTest, FailedFinalCheckpointKeepsTheStateForTheNextHostd) {
  const std::filesystem::path ck = dir_ / "ck";
  config_.checkpoint.dir = ck.string();
  Start();
  std::vector<std::vector<uint16_t>> grads;
  for (const LayerInfo& l : engine_->state()->layers()) grads.emplace_back(l.numel, 0x3c00);
  for (uint32_t l = engine_->state()->num_layers(); l-- > 0;) {
    ASSERT_TRUE(
        engine_->SubmitGradient(l, 1, {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
            .ok());
  }
  for (uint32_t l = 0; l < engine_->state()->num_layers(); ++l) {
    ASSERT_TRUE(engine_->WaitLayerVersion(l, 1, std::chrono::seconds(10)).ok());
  }
  const uint64_t trained = engine_->state()->Checksum();
  std::filesystem::remove_all(ck);
  { std::ofstream(ck) << "not a directory"; }
  server_.reset();
  const absl::Status stopped = engine_->Shutdown(/*remove_state=*/true);
  EXPECT_EQ(stopped.code(), absl::StatusCode::kDataLoss) << stopped;
  EXPECT_NE(stopped.message().find("final checkpoint of step 1"), std::string::npos) << stopped;
  EXPECT_NE(stopped.message().find("re-adopt"), std::string::npos) << stopped;
  engine_.reset();
  for (auto kind : {shm::SegmentKind::kControl, shm::SegmentKind::kState, shm::SegmentKind::kParams,
                    shm::SegmentKind::kGrads}) {
    EXPECT_TRUE(ShmSegment::Exists(SegmentName(config_.instance, kind)))
        << SegmentName(config_.instance, kind) << " was removed";
  }
  // The next hostd on the same configuration re-adopts step 1; once the directory is usable again
  // its own clean stop checkpoints it and removes the segments.
  std::filesystem::remove(ck);
  Start();
  EXPECT_EQ(engine_->state()->committed_version(0), 1u);
  EXPECT_EQ(engine_->state()->Checksum(), trained);
  server_.reset();
  EXPECT_TRUE(engine_->Shutdown(/*remove_state=*/true).ok());
  engine_.reset();
  EXPECT_FALSE(ShmSegment::Exists(SegmentName(config_.instance, shm::SegmentKind::kState)));
  auto found = FindLatestCheckpoint(ck.string());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->step, 1u);
}

// Global clipping needs every layer's gradient; layers the ranks update themselves never send
// one, so the combination is refused at attach and by a clip change, naming both (the worker
// waited for the missing gradients and no step ever completed).
TEST_F(EngineTest, GlobalClipAndClientUpdatedLayersAreRefusedTogether) {
  config_.optimizer.set_clip(v1::CLIP_POLICY_GLOBAL);
  Start();
  const uint32_t last = engine_->state()->num_layers() - 1;
  grpc::ClientContext ctx;
  v1::AttachRankRequest req;
  req.set_manifest_hash(Hash());
  req.add_client_updated_layers(0);
  req.add_client_updated_layers(last);
  v1::AttachRankResponse resp;
  grpc::Status s = stub_->AttachRank(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("clip = global"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find(absl::StrCat("[0, ", last, "]")), std::string::npos)
      << s.error_message();
  // Without client layers the job trains under global clipping; with per_layer it may attach
  // them, and switching back to global is refused while they are the ranks'.
  auto set_clip = [&](v1::ClipPolicy clip) {
    grpc::ClientContext c;
    v1::UpdateHyperParamsRequest u;
    u.add_fields("clip");
    u.mutable_optimizer()->set_clip(clip);
    v1::UpdateHyperParamsResponse ur;
    return stub_->UpdateHyperParams(&c, u, &ur);
  };
  ASSERT_TRUE(set_clip(v1::CLIP_POLICY_PER_LAYER).ok());
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub_->AttachRank(&ctx2, req, &resp).ok());
  grpc::Status back = set_clip(v1::CLIP_POLICY_GLOBAL);
  EXPECT_EQ(back.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << back.error_message();
  EXPECT_NE(back.error_message().find("client_updated_layers"), std::string::npos);
  EXPECT_EQ(engine_->worker()->optimizer().clip(), v1::CLIP_POLICY_PER_LAYER);
}

// Layers the ranks update themselves: every attached rank must send the same set; the step
// completes without their gradients, they are published at the step's version with hostd's state
// of them untouched, and once a step has run so the set can no longer change.
TEST_F(EngineTest, ClientUpdatedLayersCompleteStepsWithoutTheirGradients) {
  config_.world_size = 2;
  Start();
  TrainingState* s = engine_->state();
  const uint32_t n = s->num_layers();
  const uint32_t last = n - 1;
  auto attach = [&](uint32_t rank, std::vector<uint32_t> layers, v1::AttachRankResponse* resp) {
    grpc::ClientContext ctx;
    v1::AttachRankRequest req;
    req.set_rank(rank);
    req.set_manifest_hash(Hash());
    for (uint32_t l : layers) req.add_client_updated_layers(l);
    return stub_->AttachRank(&ctx, req, resp);
  };
  v1::AttachRankResponse r0, r1, bad;
  EXPECT_EQ(attach(0, {n}, &bad).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(attach(0, {0, 0}, &bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(attach(0, {last, 0}, &r0).ok());
  ASSERT_EQ(r0.layout().client_updated_layers_size(), 2);
  EXPECT_EQ(r0.layout().client_updated_layers(0), 0u);
  EXPECT_EQ(r0.layout().client_updated_layers(1), last);
  grpc::Status mismatch = attach(1, {0}, &bad);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(mismatch.error_message().find("client_updated_layers: rank 1 sent [0]"),
            std::string::npos)
      << mismatch.error_message();
  ASSERT_TRUE(attach(1, {0, last}, &r1).ok());

  std::vector<uint64_t> untouched;
  for (uint32_t l : {0u, last}) untouched.push_back(s->LayerChecksum(l));
  std::vector<std::vector<uint16_t>> grads;
  for (const LayerInfo& l : s->layers()) grads.emplace_back(l.numel, kernels::RoundToBf16(1e-2f));
  for (uint32_t l = last; l-- > 1;) {
    ASSERT_TRUE(
        engine_->SubmitGradient(l, 1, {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
            .ok());
  }
  v1::GetStatsResponse stats;
  for (int i = 0; i < 500; ++i) {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    if (stats.steps_completed() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(stats.steps_completed(), 1u);
  EXPECT_EQ(stats.layer_updates(), n - 2);
  for (uint32_t l = 0; l < n; ++l) EXPECT_EQ(s->committed_version(l), 1u) << "layer " << l;
  EXPECT_EQ(s->LayerChecksum(0), untouched[0]);
  EXPECT_EQ(s->LayerChecksum(last), untouched[1]);
  {
    grpc::ClientContext ctx;
    v1::GetStatusResponse st;
    ASSERT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
    ASSERT_EQ(st.job().client_updated_layers_size(), 2);
  }
  // Both ranks leave; a rank coming back with another set is refused (hostd's copy is stale).
  for (auto* r : {&r0, &r1}) {
    grpc::ClientContext ctx;
    v1::DetachRankRequest d;
    d.set_rank(r == &r0 ? 0 : 1);
    d.set_attach_token(r->attach_token());
    v1::DetachRankResponse dr;
    ASSERT_TRUE(stub_->DetachRank(&ctx, d, &dr).ok());
  }
  grpc::Status stale = attach(0, {}, &bad);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(stale.error_message().find("at version 0, not the job's step 1"), std::string::npos)
      << stale.error_message();
  EXPECT_TRUE(attach(0, {0, last}, &r0).ok());
  EXPECT_FALSE(r0.client_layers_current());
}

TEST_F(EngineTest, CheckpointAwaitsTheClientLayersUploadedByRankZero) {
  config_.checkpoint.dir = (dir_ / "ck").string();
  config_.checkpoint.client_upload_timeout_s = 3;
  Start();
  TrainingState* s = engine_->state();
  const uint32_t n = s->num_layers();
  const uint32_t last = n - 1;
  v1::AttachRankResponse r0;
  {
    grpc::ClientContext ctx;
    v1::AttachRankRequest req;
    req.set_rank(0);
    req.set_manifest_hash(Hash());
    req.add_client_updated_layers(0);
    req.add_client_updated_layers(last);
    ASSERT_TRUE(stub_->AttachRank(&ctx, req, &r0).ok());
  }
  EXPECT_TRUE(r0.client_layers_current());  // a fresh job: hostd's copy is the initial state
  std::vector<std::vector<uint16_t>> grads;
  for (const LayerInfo& l : s->layers()) grads.emplace_back(l.numel, kernels::RoundToBf16(1e-2f));
  auto run_step = [&](uint64_t step) {
    for (uint32_t l = last; l-- > 1;) {
      ASSERT_TRUE(engine_
                      ->SubmitGradient(l, step,
                                       {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
                      .ok());
    }
    for (int i = 0; i < 500 && s->committed_version(1) < step; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(engine_->WaitLayerVersion(last, step, std::chrono::seconds(5)).ok());
  };
  run_step(1);
  // checkpoint.dir is set: after the first step hostd prepares the snapshot pool in the
  // background (checkpoint.prepare_snapshot_pool), the whole state on this small model.
  uint64_t kept = 0, prepared = 0, allocated = 0;
  for (int i = 0; i < 1000 && prepared < 12 * s->total_params(); ++i) {
    grpc::ClientContext ctx;
    v1::GetStatsResponse stats;
    ASSERT_TRUE(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    kept = stats.checkpoint_pool_kept_bytes();
    prepared = stats.checkpoint_pool_prepared_bytes();
    allocated = stats.checkpoint_snapshot_buffers_allocated();
    if (prepared < 12 * s->total_params())
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(prepared, 12 * s->total_params());
  EXPECT_EQ(kept, 12 * s->total_params());
  EXPECT_EQ(allocated, s->num_layers());  // one buffer per layer, none yet by a checkpoint
  auto upload = [&](uint64_t step, uint32_t layer, uint32_t part, uint64_t offset,
                    const std::vector<float>& data, const std::string& token,
                    v1::UploadClientLayerResponse* resp) {
    grpc::ClientContext ctx;
    v1::UploadClientLayerRequest req;
    req.set_rank(0);
    req.set_attach_token(token);
    req.set_step(step);
    req.set_layer(layer);
    req.set_part(part);
    req.set_offset(offset);
    req.set_data(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
    return stub_->UploadClientLayer(&ctx, req, resp);
  };
  // The ranks' state of the client layers at version 1 (a pattern per layer and part).
  auto pattern = [&](uint32_t layer, uint32_t part) {
    std::vector<float> v(s->layers()[layer].numel);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * (i % 97) + layer + 10.0f * part;
    return v;
  };
  v1::CheckpointResponse cr;
  {
    grpc::ClientContext ctx;
    v1::CheckpointRequest req;
    ASSERT_TRUE(stub_->Checkpoint(&ctx, req, &cr).ok());
  }
  EXPECT_EQ(cr.step(), 1u);
  EXPECT_EQ(shm::Atomic(s->control().client_sync_step).load(), 1u);
  const std::string tok = r0.attach_token();
  v1::UploadClientLayerResponse ur;
  std::vector<float> m0 = pattern(0, 0);
  EXPECT_EQ(upload(1, 0, 3, 0, m0, tok, &ur).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(upload(2, 0, 0, 0, m0, tok, &ur).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(upload(1, 1, 0, 0, pattern(1, 0), tok, &ur).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(upload(1, 0, 0, 0, m0, "forged", &ur).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(upload(1, 0, 0, 8, {1.0f}, tok, &ur).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(upload(1, 0, 0, m0.size(), {1.0f}, tok, &ur).error_code(),
            grpc::StatusCode::OUT_OF_RANGE);
  {  // a piece that is not whole FP32 values
    grpc::ClientContext ctx;
    v1::UploadClientLayerRequest req;
    req.set_attach_token(tok);
    req.set_step(1);
    req.set_data("abcdef");
    grpc::Status st = stub_->UploadClientLayer(&ctx, req, &ur);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("data: expected 1.."), std::string::npos)
        << st.error_message();
  }
  int complete = 0;
  for (uint32_t layer : {0u, last}) {
    for (uint32_t part = 0; part < 3; ++part) {
      const std::vector<float> v = pattern(layer, part);
      const size_t half = v.size() / 2;  // two pieces, in order
      ASSERT_TRUE(
          upload(1, layer, part, 0, std::vector<float>(v.begin(), v.begin() + half), tok, &ur)
              .ok());
      EXPECT_FALSE(ur.layer_complete());
      ASSERT_TRUE(
          upload(1, layer, part, half, std::vector<float>(v.begin() + half, v.end()), tok, &ur)
              .ok());
      complete += ur.all_complete() ? 1 : 0;
    }
  }
  EXPECT_EQ(complete, 1);
  EXPECT_TRUE(ur.all_complete());
  EXPECT_EQ(shm::Atomic(s->control().client_sync_step).load(), 0u);
  // Committed and no longer in flight (the marker is written before the checkpointer is done:
  // a new checkpoint in between is refused as "being written").
  uint64_t committed = 0;
  for (int i = 0; i < 3000 && committed == 0; ++i) {
    grpc::ClientContext ctx;
    v1::GetStatsResponse stats;
    ASSERT_TRUE(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    committed = stats.checkpoints_committed();
    if (committed == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(committed, 1u);
  ASSERT_TRUE(std::filesystem::exists(dir_ / "ck" /
                                      model::CheckpointDirName(1, {config_.instance, "default"}) /
                                      model::kCheckpointMarker));
  for (uint32_t layer : {0u, last}) {
    const std::vector<float> m = pattern(layer, 0), v = pattern(layer, 2);
    EXPECT_EQ(std::memcmp(s->master(layer), m.data(), m.size() * 4), 0) << layer;
    EXPECT_EQ(std::memcmp(s->exp_avg_sq(layer), v.data(), v.size() * 4), 0) << layer;
    EXPECT_EQ(s->params(layer)[5], kernels::RoundToBf16(m[5])) << layer;
    // Read back while hostd's copy is the job's state (between steps, at version 1).
    grpc::ClientContext ctx;
    v1::ReadClientLayerRequest req;
    req.set_attach_token(tok);
    req.set_layer(layer);
    req.set_part(2);
    req.set_offset(3);
    req.set_count(4);
    v1::ReadClientLayerResponse rr;
    ASSERT_TRUE(stub_->ReadClientLayer(&ctx, req, &rr).ok());
    EXPECT_EQ(rr.version(), 1u);
    ASSERT_EQ(rr.data().size(), 16u);
    EXPECT_EQ(std::memcmp(rr.data().data(), v.data() + 3, 16), 0) << layer;
  }
  // Step 2: hostd's copy is older than the job now; a checkpoint nobody uploads for fails.
  run_step(2);
  {
    grpc::ClientContext ctx;
    v1::ReadClientLayerRequest req;
    req.set_attach_token(tok);
    req.set_layer(0);
    req.set_count(1);
    v1::ReadClientLayerResponse rr;
    grpc::Status st = stub_->ReadClientLayer(&ctx, req, &rr);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(st.error_message().find("at version 1 but the job is at step 2"), std::string::npos)
        << st.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::CheckpointRequest req;
    req.set_wait(true);
    v1::CheckpointResponse done;
    grpc::Status st = stub_->Checkpoint(&ctx, req, &done);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
    EXPECT_NE(
        st.error_message().find("did not upload its state of layers 0, " + std::to_string(last)),
        std::string::npos)
        << st.error_message();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "ck" /
                                       model::CheckpointDirName(2, {config_.instance, "default"})));
  // The failed checkpoint's request is withdrawn: between steps, rank 0 may upload version 2.
  std::vector<float> v0 = pattern(0, 0);
  EXPECT_TRUE(upload(2, 0, 0, 0, v0, tok, &ur).ok());
  EXPECT_EQ(shm::Atomic(s->control().client_sync_step).load(), 0u);
}

TEST_F(EngineTest, SessionEndAbortsRunningStepAndSealsVersions) {
  Start();
  v1::AttachRankResponse a = Attach(0);
  grpc::ClientContext sctx;
  auto stream = stub_->Session(&sctx);
  v1::SessionClientMessage open;
  open.mutable_open()->set_rank(0);
  open.mutable_open()->set_attach_token(a.attach_token());
  ASSERT_TRUE(stream->Write(open));
  v1::SessionEvent ev;
  ASSERT_TRUE(stream->Read(&ev));
  ASSERT_TRUE(ev.has_opened());
  grpc::ClientContext bctx;
  v1::BeginStepRequest b;
  b.set_step(1);
  b.set_attach_token(a.attach_token());
  v1::BeginStepResponse br;
  ASSERT_TRUE(stub_->BeginStep(&bctx, b, &br).ok());
  ASSERT_TRUE(stream->Read(&ev));
  EXPECT_TRUE(ev.has_step_begun());
  const uint64_t before = engine_->state()->Checksum();
  const auto t0 = std::chrono::steady_clock::now();
  sctx.TryCancel();  // the rank "dies"
  for (uint32_t l = 0; l < engine_->state()->num_layers(); ++l) {
    ASSERT_TRUE(engine_->WaitLayerVersion(l, 1, std::chrono::seconds(2)).ok());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(engine_->state()->Checksum(), before);  // no partial update
  grpc::ClientContext ctx;
  v1::GetStatusResponse st;
  ASSERT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
  EXPECT_EQ(st.job().step_state(), "aborted");
  EXPECT_FALSE(st.ranks(0).connected());
  grpc::ClientContext sctx2;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub_->GetStats(&sctx2, v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.steps_aborted(), 1u);
  // The job continues: step 2 runs on the sealed versions and completes.
  std::vector<std::vector<uint16_t>> grads;
  for (const LayerInfo& l : engine_->state()->layers()) grads.emplace_back(l.numel, 0x3c00);
  for (uint32_t l = engine_->state()->num_layers(); l-- > 0;) {
    ASSERT_TRUE(
        engine_->SubmitGradient(l, 2, {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
            .ok());
  }
  for (uint32_t l = 0; l < engine_->state()->num_layers(); ++l) {
    ASSERT_TRUE(engine_->WaitLayerVersion(l, 2, std::chrono::seconds(5)).ok());
  }
  EXPECT_NE(engine_->state()->Checksum(), before);
}

// A service takes any number of attach / detach cycles on the GPU routes: each training
// process's rank 0 publishes its communicators' ids from generation 1 again (the second
// process was refused: "PublishCommId: generation: expected >= 2, got 1"), and a rank of the
// new process that asks before rank 0 has published waits for the new id instead of getting
// the last process's (its NCCL init would wait for a rank 0 long gone).
TEST_F(EngineTest, CommIdsLiveWithRankZerosAttachmentAcrossAttachCycles) {
  config_.world_size = 2;
  Start();
  auto publish = [&](const std::string& token, uint64_t gen, const std::string& id) {
    grpc::ClientContext ctx;
    v1::PublishCommIdRequest p;
    p.set_unique_id(id);
    p.set_generation(gen);
    p.set_attach_token(token);
    v1::PublishCommIdResponse pr;
    return stub_->PublishCommId(&ctx, p, &pr);
  };
  auto fetch = [&](const std::string& token, uint64_t gen, std::string* id) {
    grpc::ClientContext ctx;
    v1::FetchCommIdRequest f;
    f.set_rank(1);
    f.set_generation(gen);
    f.set_wait_ms(10000);
    f.set_attach_token(token);
    v1::FetchCommIdResponse resp;
    grpc::Status s = stub_->FetchCommId(&ctx, f, &resp);
    *id = resp.unique_id();
    return s;
  };
  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE(cycle);
    const std::string t0 = Attach(0).attach_token();
    const std::string t1 = Attach(1).attach_token();
    const std::string id1(128, static_cast<char>('a' + 2 * cycle));
    const std::string id2(128, static_cast<char>('b' + 2 * cycle));
    std::string got;
    std::thread fetcher([&] {
      grpc::Status s = fetch(t1, 1, &got);
      EXPECT_TRUE(s.ok()) << s.error_message();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    grpc::Status p1 = publish(t0, 1, id1);
    ASSERT_TRUE(p1.ok()) << p1.error_message();
    fetcher.join();
    EXPECT_EQ(got, id1) << "rank 1 got another attachment's id";
    ASSERT_TRUE(publish(t0, 2, id2).ok());
    ASSERT_TRUE(fetch(t1, 2, &got).ok());
    EXPECT_EQ(got, id2);
    grpc::Status again = publish(t0, 1, id2);
    EXPECT_EQ(again.error_code(), grpc::StatusCode::ALREADY_EXISTS) << again.error_message();
    ASSERT_TRUE(Detach(1, t1).ok());
    ASSERT_TRUE(Detach(0, t0).ok());
  }
}

// grad_route auto (the default): the first rank to attach to a job with none attached picks the
// route from its device -- GPU reduction for a GPU rank, CPU reduction for a CPU rank -- and the
// ranks after it join that route (one of another device kind is warned of); an explicit route
// stands whatever attaches.
// This machine's topology with `gpus` GPUs on its first node (the GPUs hostd would see).
Topology WithGpus(int gpus) {
  absl::StatusOr<Topology> t = DiscoverTopology();
  EXPECT_TRUE(t.ok()) << t.status();
  for (int g = 0; g < gpus; ++g) {
    t->gpus.push_back(GpuTopology{absl::StrFormat("0000:%02x:00.0", 0x17 + g), "H200",
                                  t->nodes.front().os_index});
  }
  return *std::move(t);
}

TEST_F(EngineTest, GradRouteAutoFollowsWhatAttaches) {
  config_.world_size = 2;
  Start(WithGpus(2));
  auto status = [&] {
    grpc::ClientContext ctx;
    v1::GetStatusResponse st;
    EXPECT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
    return st.job();
  };
  EXPECT_EQ(status().routes().grad_route(), v1::GRAD_ROUTE_AUTO);
  EXPECT_EQ(status().grad_route_choice(), "auto: chosen when the first rank attaches");
  for (int cycle = 0; cycle < 2; ++cycle) {
    SCOPED_TRACE(cycle);
    v1::AttachRankResponse g0 = Attach(0, /*gpu=*/0);
    EXPECT_EQ(g0.layout().grad_route(), v1::GRAD_ROUTE_GPU_REDUCTION);
    EXPECT_EQ(status().routes().grad_route(), v1::GRAD_ROUTE_GPU_REDUCTION);
    EXPECT_THAT(status().grad_route_choice(), HasSubstr("auto: rank 0 attached first, on GPU 0"));
    v1::AttachRankResponse g1 = Attach(1, /*gpu=*/1);
    EXPECT_EQ(g1.layout().grad_route(), v1::GRAD_ROUTE_GPU_REDUCTION);
    ASSERT_TRUE(Detach(0, g0.attach_token()).ok());
    ASSERT_TRUE(Detach(1, g1.attach_token()).ok());
    // The job is left with no rank: CPU ranks attach next and get CPU reduction.
    v1::AttachRankResponse c1 = Attach(1, /*gpu=*/-1);
    EXPECT_EQ(c1.layout().grad_route(), v1::GRAD_ROUTE_CPU_REDUCTION);
    EXPECT_THAT(status().grad_route_choice(), HasSubstr("rank 1 attached first, on the CPU"));
    v1::AttachRankResponse c0 = Attach(0, /*gpu=*/-1);
    EXPECT_EQ(c0.layout().grad_route(), v1::GRAD_ROUTE_CPU_REDUCTION);
    ASSERT_TRUE(Detach(0, c0.attach_token()).ok());
    ASSERT_TRUE(Detach(1, c1.attach_token()).ok());
  }
}

// Two rank processes on one GPU (how R > 1 runs on the one-H200 machine): NCCL needs a device
// per rank, so auto picks CPU reduction for them.
TEST_F(EngineTest, GradRouteAutoGivesRanksSharingAGpuCpuReduction) {
  config_.world_size = 2;
  Start(WithGpus(1));
  EXPECT_EQ(Attach(0, /*gpu=*/0).layout().grad_route(), v1::GRAD_ROUTE_CPU_REDUCTION);
  EXPECT_EQ(Attach(1, /*gpu=*/0).layout().grad_route(), v1::GRAD_ROUTE_CPU_REDUCTION);
  grpc::ClientContext ctx;
  v1::GetStatusResponse st;
  ASSERT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
  EXPECT_THAT(st.job().grad_route_choice(), HasSubstr("2 ranks share the 1 GPU(s) hostd sees"));
}

TEST_F(EngineTest, AnExplicitGradRouteStandsWhateverAttaches) {
  config_.routes.set_grad_route(v1::GRAD_ROUTE_CPU_REDUCTION);
  Start();
  EXPECT_EQ(Attach(0, /*gpu=*/0).layout().grad_route(), v1::GRAD_ROUTE_CPU_REDUCTION);
  grpc::ClientContext ctx;
  v1::GetStatusResponse st;
  ASSERT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st).ok());
  EXPECT_EQ(st.job().routes().grad_route(), v1::GRAD_ROUTE_CPU_REDUCTION);
  EXPECT_EQ(st.job().grad_route_choice(), "set");
}

// The stream of an attachment that ended (the rank detached and attached again) closing late
// leaves the new attachment alone: sessions were keyed by the rank number only, so the old
// stream's end detached the new rank.
TEST_F(EngineTest, AStaleSessionClosingDoesNotDropTheNewAttachment) {
  config_.heartbeat_deadline_ms = 60000;  // the test's streams send no heartbeats
  Start();
  auto open_session = [&](grpc::ClientContext* ctx, const std::string& token) {
    auto stream = stub_->Session(ctx);
    v1::SessionClientMessage open;
    open.mutable_open()->set_attach_token(token);
    EXPECT_TRUE(stream->Write(open));
    v1::SessionEvent ev;
    EXPECT_TRUE(stream->Read(&ev));
    EXPECT_TRUE(ev.has_opened());
    return stream;
  };
  const std::string old_token = Attach(0).attach_token();
  grpc::ClientContext old_ctx;
  auto old_stream = open_session(&old_ctx, old_token);
  {
    grpc::ClientContext ctx;
    v1::DetachRankRequest d;
    d.set_attach_token(old_token);
    v1::DetachRankResponse dr;
    ASSERT_TRUE(stub_->DetachRank(&ctx, d, &dr).ok());
  }
  const std::string new_token = Attach(0).attach_token();
  grpc::ClientContext new_ctx;
  auto new_stream = open_session(&new_ctx, new_token);
  ASSERT_TRUE(old_stream->WritesDone());  // the old attachment's stream ends now
  // The old stream's handler polls every 100 ms; give it several periods to act.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  grpc::ClientContext lctx;
  v1::ListRanksResponse ranks;
  ASSERT_TRUE(stub_->ListRanks(&lctx, v1::ListRanksRequest(), &ranks).ok());
  ASSERT_EQ(ranks.ranks_size(), 1);
  EXPECT_TRUE(ranks.ranks(0).attached());
  EXPECT_TRUE(ranks.ranks(0).connected());
  grpc::ClientContext bctx;
  v1::BeginStepRequest b;
  b.set_step(1);
  b.set_attach_token(new_token);
  v1::BeginStepResponse br;
  grpc::Status s = stub_->BeginStep(&bctx, b, &br);
  EXPECT_TRUE(s.ok()) << s.error_message();
  // The step's event goes to every open stream: the old one's write fails now, and its end must
  // still leave the new attachment (and its running step) alone.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  grpc::ClientContext lctx2;
  ASSERT_TRUE(stub_->ListRanks(&lctx2, v1::ListRanksRequest(), &ranks).ok());
  EXPECT_TRUE(ranks.ranks(0).attached()) << "the stale stream detached the new rank";
  grpc::ClientContext sctx;
  v1::GetStatusResponse st;
  ASSERT_TRUE(stub_->GetStatus(&sctx, v1::GetStatusRequest(), &st).ok());
  EXPECT_EQ(st.job().step_state(), "running");
  new_ctx.TryCancel();
}

// An export that arrives between rank 0's and rank 1's BeginStep(t) waits for step t, which
// needs rank 1: rank 1's BeginStep joins the running step at once (it blocked, untimed, until
// the export gave up after 10 minutes), and the export lands on the step boundary after it.
TEST_F(EngineTest, ExportBetweenTheRanksBeginStepDoesNotStallTheStep) {
  config_.world_size = 2;
  config_.output_roots = {dir_.string()};
  Start();
  const std::string t0 = Attach(0).attach_token();
  const std::string t1 = Attach(1).attach_token();
  auto begin = [&](uint32_t rank, const std::string& token, uint64_t step) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::BeginStepRequest b;
    b.set_rank(rank);
    b.set_step(step);
    b.set_attach_token(token);
    v1::BeginStepResponse br;
    return stub_->BeginStep(&ctx, b, &br);
  };
  ASSERT_TRUE(begin(0, t0, 1).ok());
  v1::ExportHFResponse exported;
  std::future<grpc::Status> export_done = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::ExportHFRequest req;
    req.set_out_dir((dir_ / "export").string());
    return stub_->ExportHF(&ctx, req, &exported);
  });
  // Time for the export to arrive and start waiting for step 1 (had it not yet, rank 1 would
  // join first, which must work as well).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t_begin = std::chrono::steady_clock::now();
  grpc::Status joined = begin(1, t1, 1);
  ASSERT_TRUE(joined.ok()) << joined.error_message();
  EXPECT_LT(std::chrono::steady_clock::now() - t_begin, std::chrono::seconds(15));
  EXPECT_EQ(export_done.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout)
      << "the export did not wait for the running step";
  std::vector<std::vector<uint16_t>> grads;
  for (const LayerInfo& l : engine_->state()->layers()) grads.emplace_back(l.numel, 0x3c00);
  for (uint32_t l = engine_->state()->num_layers(); l-- > 0;) {
    ASSERT_TRUE(
        engine_->SubmitGradient(l, 1, {grads[l].data(), kernels::GradType::kBf16, grads[l].size()})
            .ok());
  }
  ASSERT_EQ(export_done.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  grpc::Status es = export_done.get();
  ASSERT_TRUE(es.ok()) << es.error_message();
  EXPECT_EQ(exported.version(), 1u);
  EXPECT_TRUE(begin(0, t0, 2).ok());
  EXPECT_TRUE(begin(1, t1, 2).ok());
}

// The same at the engine's API, where the timing is the test's: the stream handler of an
// attachment that ended reports its end after the rank attached again. It ended the new
// attachment (sessions were keyed by the rank number alone).
TEST_F(EngineTest, ALateSessionCloseOfAnEndedAttachmentIsIgnored) {
  Start();
  const std::string old_token = Attach(0).attach_token();
  v1::SessionOpen open;
  open.set_attach_token(old_token);
  ASSERT_TRUE(engine_->OpenSession(open).ok());
  v1::DetachRankRequest d;
  d.set_attach_token(old_token);
  ASSERT_TRUE(engine_->DetachRank(d).ok());
  const std::string new_token = Attach(0).attach_token();
  open.set_attach_token(new_token);
  ASSERT_TRUE(engine_->OpenSession(open).ok());
  engine_->SessionClosed(0, old_token, "the old stream ended late");
  EXPECT_TRUE(engine_->SessionActive(0, new_token));
  auto ranks = engine_->ListRanks(v1::ListRanksRequest());
  ASSERT_TRUE(ranks.ok());
  EXPECT_TRUE(ranks->ranks(0).attached());
  EXPECT_FALSE(engine_->SessionActive(0, old_token));
  engine_->SessionClosed(0, new_token, "test over");
  EXPECT_FALSE(engine_->ListRanks(v1::ListRanksRequest())->ranks(0).attached());
}

// Step t aborted by one rank's loss before another rank began it: that rank's BeginStep(t) is
// ABORTED naming the step and the cause (it was OUT_OF_RANGE "expected t + 1 (next), got t",
// which a client cannot tell from its own mistake: fault_test flaked on it under load).
TEST_F(EngineTest, BeginStepOfAStepAbortedBeforeTheRankBeganItIsAborted) {
  config_.world_size = 2;
  Start();
  const std::string t0 = Attach(0).attach_token();
  const std::string t1 = Attach(1).attach_token();
  auto begin = [&](uint32_t rank, const std::string& token, uint64_t step) {
    grpc::ClientContext ctx;
    v1::BeginStepRequest b;
    b.set_rank(rank);
    b.set_step(step);
    b.set_attach_token(token);
    v1::BeginStepResponse br;
    return stub_->BeginStep(&ctx, b, &br);
  };
  ASSERT_TRUE(begin(1, t1, 1).ok());
  {
    grpc::ClientContext ctx;
    v1::AbortStepRequest a;
    a.set_step(1);
    a.set_reason("rank 1 ran out of memory");
    v1::AbortStepResponse ar;
    ASSERT_TRUE(stub_->AbortStep(&ctx, a, &ar).ok());
  }
  grpc::Status late = begin(0, t0, 1);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::ABORTED) << late.error_message();
  EXPECT_NE(late.error_message().find("step 1 was aborted before rank 0 began it"),
            std::string::npos)
      << late.error_message();
  EXPECT_NE(late.error_message().find("rank 1 ran out of memory"), std::string::npos);
  EXPECT_NE(late.error_message().find("begin step 2"), std::string::npos);
  // Rank 1, which had begun step 1 (and was told of the abort in it), is not told again.
  EXPECT_EQ(begin(1, t1, 1).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_TRUE(begin(0, t0, 2).ok());
  EXPECT_TRUE(begin(1, t1, 2).ok());
}

TEST_F(EngineTest, SecondDaemonOnSameSocketOrInstanceIsRefused) {
  Start();
  auto second = ControlServer::Start(engine_.get(), {config_.socket, "", 0600});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("in use"), std::string::npos);
  auto tcp = ControlServer::Start(engine_.get(), {"", "0.0.0.0:0", 0600});
  ASSERT_FALSE(tcp.ok());
  EXPECT_NE(tcp.status().message().find("loopback"), std::string::npos);
}

constexpr shm::SegmentKind kSegmentKinds[] = {shm::SegmentKind::kControl, shm::SegmentKind::kState,
                                              shm::SegmentKind::kParams, shm::SegmentKind::kGrads};

// Removes whatever a test left under the instance's names, whoever owns it (on any exit).
struct ShmJanitor {
  std::string inst;
  ~ShmJanitor() {
    for (auto kind : kSegmentKinds) unlink(("/dev/shm/" + SegmentName(inst, kind)).c_str());
    unlink(InstanceLockPath(inst).c_str());
  }
};

// Issue #17: segments another user planted under the instance's names (world-writable, which any
// user can make; as root also owned by nobody) look like a crashed hostd's consistent state at
// step 0. hostd refuses to start on them, whatever recovery_on_inconsistent says (checkpoint and
// fresh would remove them, a consistent state would be adopted), and leaves them as they are.
TEST_F(EngineTest, ForeignLeftoverSegmentsRefuseStartForEveryRecoveryPolicy) {
  ShmJanitor janitor{config_.instance};
  {
    auto crashed = Engine::Create(config_);  // destroyed without removing its state
    ASSERT_TRUE(crashed.ok()) << crashed.status();
  }
  for (auto kind : kSegmentKinds) {
    const std::string path = "/dev/shm/" + SegmentName(config_.instance, kind);
    ASSERT_EQ(chmod(path.c_str(), 0666), 0) << path;
    if (geteuid() == 0) {
      ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0) << path;
    }
  }
  const std::string control =
      "/dev/shm/" + SegmentName(config_.instance, shm::SegmentKind::kControl);
  for (const char* policy : {"checkpoint", "fresh", "refuse"}) {
    config_.recovery_on_inconsistent = policy;
    auto e = Engine::Create(config_);
    if (e.ok()) {
      ADD_FAILURE() << "recovery_on_inconsistent " << policy << ": hostd started on them";
      continue;  // destroyed as a crash would be: the segments stay
    }
    EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
    const std::string msg(e.status().message());
    for (const std::string& part : {"segment " + control, std::string("mode 0666"),
                                    std::string("expected a regular file owned by ") +
                                        (geteuid() == 0 ? "uid 0 (root)" : "uid"),
                                    "rm " + control}) {
      EXPECT_NE(msg.find(part), std::string::npos) << policy << ": no '" << part << "' in " << msg;
    }
    if (geteuid() == 0) {
      EXPECT_NE(msg.find("owned by uid 65534 (nobody)"), std::string::npos) << msg;
    }
    for (auto kind : kSegmentKinds) {
      struct stat st;
      const std::string path = "/dev/shm/" + SegmentName(config_.instance, kind);
      EXPECT_EQ(stat(path.c_str(), &st), 0) << policy << ": " << path << " was removed";
      EXPECT_EQ(st.st_mode & 0777, 0666u) << path;
    }
  }
}

// shm_mode 0660 with shm_group: the segments ranks map (control, params, grads), the lock file
// and the control socket get the group and mode 0660; the state segment (master, m, v) stays
// hostd's alone, 0600 in hostd's own group.
TEST_F(EngineTest, ShmGroupReachesRankSegmentsLockAndSocketStateStays0600) {
  ShmJanitor janitor{config_.instance};
  const gid_t group = testing::OtherGroup();
  struct group gr;
  struct group* found = nullptr;
  char buf[4096];
  if (getgrgid_r(group, &gr, buf, sizeof(buf), &found) != 0 || found == nullptr) {
    GTEST_SKIP() << "gid " << group << " has no name on this machine";
  }
  config_.shm_mode = "0660";
  config_.shm_group = found->gr_name;
  auto e = Engine::Create(config_);
  ASSERT_TRUE(e.ok()) << e.status();
  engine_ = std::move(*e);
  ControlServer::Options so;  // as hostd/main.cc fills it
  so.socket_path = config_.socket;
  so.socket_mode = 0660;
  so.socket_group = group;
  auto server = ControlServer::Start(engine_.get(), so);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = std::move(*server);
  auto expect = [&](const std::string& path, mode_t mode, gid_t gid) {
    struct stat st;
    ASSERT_EQ(lstat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_uid, geteuid()) << path;
    EXPECT_EQ(st.st_mode & 07777, mode) << path;
    EXPECT_EQ(st.st_gid, gid) << path;
  };
  for (auto kind : kSegmentKinds) {
    const std::string path = "/dev/shm/" + SegmentName(config_.instance, kind);
    if (kind == shm::SegmentKind::kState) {
      expect(path, 0600, getegid());
    } else {
      expect(path, 0660, group);
    }
  }
  expect(InstanceLockPath(config_.instance), 0660, group);
  expect(config_.socket, 0660, group);
}

// An unknown shm_group fails the start, before any file is made.
TEST_F(EngineTest, UnknownShmGroupIsInvalidArgumentAtStart) {
  ShmJanitor janitor{config_.instance};
  config_.shm_mode = "0660";
  config_.shm_group = "slidedp-no-such-group";
  auto e = Engine::Create(config_);
  ASSERT_FALSE(e.ok()) << "started with shm_group " << config_.shm_group;
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
  EXPECT_NE(e.status().message().find("shm_group: group 'slidedp-no-such-group'"),
            std::string::npos)
      << e.status();
  struct stat st;
  EXPECT_NE(lstat(InstanceLockPath(config_.instance).c_str(), &st), 0);
  EXPECT_FALSE(ShmSegment::Exists(SegmentName(config_.instance, shm::SegmentKind::kControl)));
}

}  // namespace
}  // namespace slidedp::hostd

namespace slidedp::hostd {
namespace {

// The GPU-reduction route's host side: only the designated rank pushes (the aggregated
// gradient); the others' pushes only record the layer. The result equals the CPU route with the
// same total gradient (rank 0: g, rank 1: zeros), bit for bit.
class RouteTest : public ::testing::Test {
 protected:
  struct Run {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<ControlServer> server;
    std::filesystem::path dir;
  };

  Run Start(v1::GradRoute route) {
    Run run;
    run.dir = std::filesystem::temp_directory_path() / testing::UniqueInstance("route");
    std::filesystem::create_directories(run.dir);
    HostdConfig c;
    c.instance = testing::UniqueInstance("route");
    c.socket = (run.dir / "hostd.sock").string();
    c.model = "none";
    c.update_threads = 1;
    c.mlock = "best_effort";
    run.engine = std::move(*Engine::Create(c));
    run.server = std::move(*ControlServer::Start(run.engine.get(), {c.socket, "", 0600}));
    v1::JobSpec spec;
    *spec.mutable_manifest() = testing::SmallModel().manifest;
    spec.set_world_size(2);
    spec.set_seed(9);
    spec.mutable_optimizer()->set_lr(1e-3);
    spec.mutable_optimizer()->set_grad_dtype(v1::DTYPE_FP32);
    spec.mutable_optimizer()->set_scale_by_world_size(true);
    spec.mutable_routes()->set_grad_route(route);
    spec.mutable_routes()->set_chunk_bytes(4096);
    auto created = rankclient::RankClient::CreateJob(c.socket, spec, std::chrono::seconds(10));
    EXPECT_TRUE(created.ok()) << created.status();
    return run;
  }

  void Train(Run& run, bool zeros_from_rank1) {
    std::vector<std::unique_ptr<rankclient::RankClient>> ranks;
    for (uint32_t r = 0; r < 2; ++r) {
      rankclient::RankClient::Options o;
      o.socket = (run.dir / "hostd.sock").string();
      o.rank = r;
      o.manifest_hash = model::ManifestHashHex(model::ManifestHash(testing::SmallModel().manifest));
      auto c = rankclient::RankClient::Attach(o);
      ASSERT_TRUE(c.ok()) << c.status();
      ranks.push_back(std::move(*c));
    }
    // Each rank on its own thread, as separate processes would run: on the CPU route a rank's
    // ring fills until every rank has pushed the same chunk.
    const auto timeout = std::chrono::seconds(10);
    // On the GPU route the collectives keep ranks in lockstep (no rank reduces a layer before
    // every rank is in the step); a barrier after BeginStep stands in for them.
    std::barrier sync(2);
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        rankclient::RankClient& c = *ranks[r];
        for (uint64_t step = 1; step <= 3; ++step) {
          absl::Status begun = c.BeginStep(step, timeout);
          ASSERT_TRUE(begun.ok()) << begun;
          sync.arrive_and_wait();  // no gradient before every rank is in the step
          for (uint32_t l = 2; l-- > 0;) {
            const uint64_t n = c.layer_numel(l);
            std::vector<float> g(n);
            for (uint64_t i = 0; i < n; ++i) {
              g[i] = (r == 1 && zeros_from_rank1) ? 0.0f
                                                  : 1e-3f * static_cast<float>((i * 7 + step) % 13);
            }
            ASSERT_TRUE(c.PushGrad(step, l, g.data(), 1, n * 4, timeout).ok());
          }
          absl::Status waited = c.WaitStep(step, timeout);
          ASSERT_TRUE(waited.ok()) << waited;
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& r : ranks) ASSERT_TRUE(r->Detach().ok());
  }

  void Stop(Run& run) {
    run.server.reset();
    run.engine->Shutdown(/*remove_state=*/true).IgnoreError();
    run.engine.reset();
    std::filesystem::remove_all(run.dir);
  }
};

TEST_F(RouteTest, GpuReductionHostSideEqualsCpuReductionOfTheSameSum) {
  Run gpu = Start(v1::GRAD_ROUTE_GPU_REDUCTION);
  Train(gpu, /*zeros_from_rank1=*/false);  // rank 1's data is ignored on this route
  Run cpu = Start(v1::GRAD_ROUTE_CPU_REDUCTION);
  Train(cpu, /*zeros_from_rank1=*/true);
  for (uint32_t l = 0; l < 2; ++l) {
    EXPECT_EQ(gpu.engine->state()->committed_version(l), 3u);
    EXPECT_EQ(gpu.engine->state()->LayerChecksum(l), cpu.engine->state()->LayerChecksum(l))
        << "layer " << l;
  }
  // Only rank 0's ring carried chunks on the GPU route.
  EXPECT_EQ(gpu.engine->reducer()->stats().bytes_reduced * 2,
            cpu.engine->reducer()->stats().bytes_reduced);
  Stop(gpu);
  Stop(cpu);
}

}  // namespace
}  // namespace slidedp::hostd

namespace slidedp::hostd {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWait = std::chrono::seconds(10);

bool WaitUntil(const std::function<bool()>& pred) {
  const auto deadline = Clock::now() + kWait;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Holds the update worker: passed as the completion callback of an in-process update, it blocks
// the worker thread (so every later update waits) until released, at the latest on destruction.
class WorkerGate {
 public:
  WorkerGate() : future_(promise_.get_future().share()) {}
  ~WorkerGate() { Release(); }
  UpdateWorker::DoneFn Hold() {
    return [f = future_](const LayerUpdateResult&) { f.wait(); };
  }
  void Release() {
    if (!released_.exchange(true)) promise_.set_value();
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_;
  std::atomic<bool> released_{false};
};

// Overlapping steps through the engine and a real rank (RankClient over the gRPC service, world
// size 1, on each gradient route): BeginStep(t + 1) while step t's updates are pending returns at
// once and queues t + 1, which starts when t completes; chunks of t + 1 pushed early wait in the
// ring and count then. An abort of t drops the queued t + 1, whose rank begins it again.
class OverlapTest : public ::testing::TestWithParam<v1::GradRoute> {
 protected:
  struct Run {
    std::filesystem::path dir;
    std::unique_ptr<Engine> engine;
    std::unique_ptr<ControlServer> server;
    std::unique_ptr<rankclient::RankClient> client;
    ~Run() {
      if (client) client->Detach().IgnoreError();
      client.reset();
      server.reset();
      if (engine) engine->Shutdown(/*remove_state=*/true).IgnoreError();
      engine.reset();
      std::filesystem::remove_all(dir);
    }
    v1::JobStatus Job() {
      auto st = engine->GetStatus();
      EXPECT_TRUE(st.ok()) << st.status();
      return st.ok() ? st->job() : v1::JobStatus();
    }
    uint64_t StepsAborted() {
      auto st = engine->GetStats(v1::GetStatsRequest());
      return st.ok() ? st->steps_aborted() : ~0ull;
    }
    // Full ring slots of rank 0 holding a chunk of `step`, counted under the reducer's lock: a
    // slot's step read here may otherwise race with the rank refilling the slot hostd empties.
    int ChunksInRing(uint64_t step) {
      return static_cast<int>(engine->reducer()->FullSlotsOfStep(0, step));
    }
  };

  std::unique_ptr<Run> Start(bool checkpoints = false) {
    auto run = std::make_unique<Run>();
    run->dir = std::filesystem::temp_directory_path() / testing::UniqueInstance("ovl");
    std::filesystem::create_directories(run->dir);
    HostdConfig c;
    c.instance = testing::UniqueInstance("ovl");
    c.socket = (run->dir / "hostd.sock").string();
    if (checkpoints) c.checkpoint.dir = (run->dir / "ck").string();
    c.model = "none";
    c.update_threads = 1;
    c.mlock = "best_effort";
    auto e = Engine::Create(c);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    run->engine = std::move(*e);
    auto srv = ControlServer::Start(run->engine.get(), {c.socket, "", 0600});
    EXPECT_TRUE(srv.ok()) << srv.status();
    if (!srv.ok()) return nullptr;
    run->server = std::move(*srv);
    v1::JobSpec spec;
    *spec.mutable_manifest() = testing::SmallModel().manifest;
    spec.set_world_size(1);
    spec.set_seed(5);
    spec.mutable_optimizer()->set_lr(1e-3);
    spec.mutable_optimizer()->set_grad_dtype(v1::DTYPE_FP32);
    spec.mutable_routes()->set_grad_route(GetParam());
    spec.mutable_routes()->set_chunk_bytes(4096);  // 1024 elements: layer 1 is 15 chunks
    auto created = rankclient::RankClient::CreateJob(c.socket, spec, kWait);
    EXPECT_TRUE(created.ok()) << created.status();
    rankclient::RankClient::Options o;
    o.socket = c.socket;
    o.manifest_hash = model::ManifestHashHex(model::ManifestHash(testing::SmallModel().manifest));
    auto client = rankclient::RankClient::Attach(o);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    run->client = std::move(*client);
    return run;
  }

  static std::vector<float> Grad(uint32_t layer, uint64_t step, uint64_t numel, float scale = 1) {
    std::mt19937 rng(static_cast<uint32_t>(100 * step + layer));
    std::normal_distribution<float> d(0.0f, 1e-2f * scale);
    std::vector<float> g(numel);
    for (float& x : g) x = d(rng);
    return g;
  }
  static absl::Status Push(rankclient::RankClient& c, uint64_t step, uint32_t layer,
                           const std::vector<float>& g) {
    return c.PushGrad(step, layer, g.data(), 1, g.size() * 4, kWait);
  }
  static absl::Status Submit(Engine& e, uint32_t layer, uint64_t step, const std::vector<float>& g,
                             UpdateWorker::DoneFn done = nullptr) {
    return e.SubmitGradient(layer, step, {g.data(), kernels::GradType::kFp32, g.size()},
                            std::move(done));
  }
  static absl::Status Begin(Engine& e, const rankclient::RankClient& c, uint64_t step) {
    v1::BeginStepRequest b;
    b.set_step(step);
    b.set_attach_token(c.attach_token());
    return e.BeginStep(b).status();
  }
  // The state checksum after steps 1 and 2 run strictly in sequence on a fresh job: step 1 with
  // layer 0's gradient g01 (in process), then layer 1's g11 -- or, when `abort_step1`, aborted
  // after layer 0's update -- then step 2 (g12, g02). The reference for the overlapped runs.
  uint64_t SequentialReference(const std::vector<float>& g01, const std::vector<float>& g11,
                               const std::vector<float>& g02, const std::vector<float>& g12,
                               bool abort_step1) {
    auto ref = Start();
    EXPECT_NE(ref, nullptr);
    if (ref == nullptr) return 0;
    rankclient::RankClient& rc = *ref->client;
    EXPECT_TRUE(rc.BeginStep(1, kWait).ok());
    EXPECT_TRUE(Submit(*ref->engine, 0, 1, g01).ok());
    if (abort_step1) {
      EXPECT_TRUE(ref->engine->WaitLayerVersion(0, 1, kWait).ok());
      v1::AbortStepRequest ab;
      ab.set_step(1);
      EXPECT_TRUE(ref->engine->AbortStep(ab).ok());
    } else {
      EXPECT_TRUE(Push(rc, 1, 1, g11).ok());
      EXPECT_TRUE(rc.WaitStep(1, kWait).ok());
    }
    EXPECT_TRUE(rc.BeginStep(2, kWait).ok());
    EXPECT_TRUE(Push(rc, 2, 1, g12).ok());
    EXPECT_TRUE(Push(rc, 2, 0, g02).ok());
    EXPECT_TRUE(rc.WaitStep(2, kWait).ok());
    return ref->engine->state()->Checksum();
  }
};

TEST_P(OverlapTest, NextStepBeginsAtOnceAndRunsWhenThePreviousCompletes) {
  auto run = Start();
  ASSERT_NE(run, nullptr);
  rankclient::RankClient& c = *run->client;
  Engine& e = *run->engine;
  TrainingState* st = e.state();
  const std::vector<float> g01 = Grad(0, 1, c.layer_numel(0)), g11 = Grad(1, 1, c.layer_numel(1));
  const std::vector<float> g02 = Grad(0, 2, c.layer_numel(0)), g12 = Grad(1, 2, c.layer_numel(1));

  // The same two steps strictly in sequence: the reference.
  const uint64_t reference = SequentialReference(g01, g11, g02, g12, /*abort_step1=*/false);
  ASSERT_FALSE(HasFailure());

  WorkerGate gate;
  ASSERT_TRUE(c.BeginStep(1, kWait).ok());
  // Layer 0 of step 1 goes in through the in-process path; its completion callback holds the
  // update worker, so step 1's last update (layer 1) stays pending.
  ASSERT_TRUE(Submit(e, 0, 1, g01, gate.Hold()).ok());
  ASSERT_TRUE(e.WaitLayerVersion(0, 1, kWait).ok());
  // Layer 1's push begins in step 1 and is sent after BeginStep(2), as the GPU plane's copier
  // goes on with step 1 while the forward of step 2 runs.
  ASSERT_TRUE(c.BeginLayerPush(1, 1).ok());
  const rankclient::RankClient::PushTicket ticket1 = c.push_ticket();

  auto begun = std::async(std::launch::async, [&] { return c.BeginStep(2, kWait); });
  ASSERT_EQ(begun.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "BeginStep(2) waited for step 1's updates";
  ASSERT_TRUE(begun.get().ok());
  EXPECT_EQ(c.current_step(), 2u);
  EXPECT_EQ(run->Job().step_state(), "running");
  EXPECT_EQ(run->Job().step(), 0u);  // no step completed yet
  // Two steps ahead is refused, naming both acceptable steps.
  absl::Status ahead = Begin(e, c, 3);
  EXPECT_EQ(ahead.code(), absl::StatusCode::kOutOfRange) << ahead;
  EXPECT_NE(ahead.message().find("expected 1 (running) or 2 (queued"), std::string::npos) << ahead;

  // Step 1's layer 1 under its ticket: its chunks carry step 1 although the rank is in step 2.
  const shm::ShardRange range = c.PushRange(1);
  const uint64_t chunk = c.chunk_bytes() / 4;
  for (uint64_t off = range.begin; off < range.begin + range.numel; off += chunk) {
    const uint64_t n = std::min(chunk, range.begin + range.numel - off);
    auto ref = c.AcquireChunkSlot(ticket1, Clock::now() + kWait);
    ASSERT_TRUE(ref.ok()) << ref.status();
    std::memcpy(ref->data, g11.data() + off, n * 4);
    ASSERT_TRUE(c.PublishChunk(*ref, 1, off, n, 1, nullptr).ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(st->committed_version(1), 0u);  // the worker is held: step 1 is not done

  // Step 2's layer 1 goes into the ring early; hostd leaves it there (the pusher blocks once the
  // ring is full) until step 1 completes.
  auto early = std::async(std::launch::async, [&] { return Push(c, 2, 1, g12); });
  ASSERT_TRUE(WaitUntil([&] { return run->ChunksInRing(2) == 4; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(early.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  EXPECT_EQ(run->ChunksInRing(2), 4);
  EXPECT_EQ(run->StepsAborted(), 0u);
  EXPECT_EQ(run->Job().step_state(), "running");

  gate.Release();  // step 1 completes, step 2 starts and takes the chunks waiting for it
  ASSERT_EQ(early.wait_for(kWait), std::future_status::ready);
  ASSERT_TRUE(early.get().ok());
  ASSERT_TRUE(Push(c, 2, 0, g02).ok());
  ASSERT_TRUE(c.WaitStep(2, kWait).ok());
  EXPECT_EQ(st->committed_version(0), 2u);
  EXPECT_EQ(st->committed_version(1), 2u);
  EXPECT_EQ(st->Checksum(), reference);
  ASSERT_TRUE(WaitUntil([&] { return run->Job().step() == 2; }));
  EXPECT_EQ(run->Job().step_state(), "idle");
  EXPECT_EQ(run->StepsAborted(), 0u);
}

// A checkpoint asked for while step 2 is queued behind step 1 is of version 2, the newest begun
// step: each layer is then captured after its update for step 2, a step ahead of its update for
// step 3, instead of every layer of version 1 before step 2's updates (which waited for them).
TEST_P(OverlapTest, CheckpointAskedWithAQueuedStepIsOfTheQueuedStep) {
  auto run = Start(/*checkpoints=*/true);
  ASSERT_NE(run, nullptr);
  rankclient::RankClient& c = *run->client;
  Engine& e = *run->engine;
  TrainingState* st = e.state();
  const std::vector<float> g01 = Grad(0, 1, c.layer_numel(0)), g11 = Grad(1, 1, c.layer_numel(1));
  const std::vector<float> g02 = Grad(0, 2, c.layer_numel(0)), g12 = Grad(1, 2, c.layer_numel(1));
  {
    WorkerGate gate;
    ASSERT_TRUE(c.BeginStep(1, kWait).ok());
    ASSERT_TRUE(Submit(e, 0, 1, g01, gate.Hold()).ok());
    ASSERT_TRUE(e.WaitLayerVersion(0, 1, kWait).ok());
    ASSERT_TRUE(Push(c, 1, 1, g11).ok());  // queued behind the held worker
    ASSERT_TRUE(c.BeginStep(2, kWait).ok());
    EXPECT_EQ(st->committed_version(1), 0u);  // step 1 is still running, step 2 queued
    v1::CheckpointRequest req;
    absl::StatusOr<v1::CheckpointResponse> asked = e.Checkpoint(req);
    ASSERT_TRUE(asked.ok()) << asked.status();
    EXPECT_EQ(asked->step(), 2u);
    gate.Release();
  }
  ASSERT_TRUE(c.WaitStep(1, kWait).ok());
  ASSERT_TRUE(Push(c, 2, 1, g12).ok());
  ASSERT_TRUE(Push(c, 2, 0, g02).ok());
  ASSERT_TRUE(c.WaitStep(2, kWait).ok());
  ASSERT_TRUE(WaitUntil([&] {
    auto stats = e.GetStats(v1::GetStatsRequest());
    return stats.ok() && stats->checkpoints_committed() == 1;
  }));
  absl::StatusOr<model::CheckpointInfo> info = FindLatestCheckpoint((run->dir / "ck").string());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step, 2u);
  EXPECT_EQ(run->StepsAborted(), 0u);
}

// hostd stopping while that queued step has not started: the stop aborts step 1 and drops step
// 2, so no layer reaches version 2. The checkpoint of step 2 is cancelled (the stop used to wait
// hours for it) and the clean stop's final checkpoint is of version 1.
TEST_P(OverlapTest, StopCancelsACheckpointOfAQueuedStepThatNeverRan) {
  auto run = Start(/*checkpoints=*/true);
  ASSERT_NE(run, nullptr);
  rankclient::RankClient& c = *run->client;
  Engine& e = *run->engine;
  const std::vector<float> g01 = Grad(0, 1, c.layer_numel(0));
  ASSERT_TRUE(c.BeginStep(1, kWait).ok());
  ASSERT_TRUE(Submit(e, 0, 1, g01).ok());
  ASSERT_TRUE(e.WaitLayerVersion(0, 1, kWait).ok());
  ASSERT_TRUE(c.BeginStep(2, kWait).ok());  // layer 1 of step 1 never comes: step 2 stays queued
  absl::StatusOr<v1::CheckpointResponse> asked = e.Checkpoint(v1::CheckpointRequest());
  ASSERT_TRUE(asked.ok()) << asked.status();
  ASSERT_EQ(asked->step(), 2u);
  auto stopped =
      std::async(std::launch::async, [&] { e.Shutdown(/*remove_state=*/true).IgnoreError(); });
  ASSERT_EQ(stopped.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "the stop waits for a checkpoint of a step that never ran";
  absl::StatusOr<model::CheckpointInfo> info = FindLatestCheckpoint((run->dir / "ck").string());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step, 1u);  // the final checkpoint (step 1 aborted: its layers are at 1)
  EXPECT_FALSE(std::filesystem::exists(
      run->dir / "ck" / model::CheckpointDirName(2, {e.config().instance, "default"})));
}

TEST_P(OverlapTest, AbortWithAQueuedStepDropsItAndItsRankBeginsItAgain) {
  auto run = Start();
  ASSERT_NE(run, nullptr);
  rankclient::RankClient& c = *run->client;
  Engine& e = *run->engine;
  TrainingState* st = e.state();
  const std::vector<float> g01 = Grad(0, 1, c.layer_numel(0)), g11 = Grad(1, 1, c.layer_numel(1));
  const std::vector<float> g02 = Grad(0, 2, c.layer_numel(0)), g12 = Grad(1, 2, c.layer_numel(1));
  // What the dropped attempt of step 2 pushes: it must never count.
  const std::vector<float> bad12 = Grad(1, 2, c.layer_numel(1), 50);

  // Reference: step 1 aborted after layer 0's update (layer 1 untouched), then step 2.
  const uint64_t reference = SequentialReference(g01, g11, g02, g12, /*abort_step1=*/true);
  ASSERT_FALSE(HasFailure());

  WorkerGate gate;
  ASSERT_TRUE(c.BeginStep(1, kWait).ok());
  ASSERT_TRUE(Submit(e, 0, 1, g01, gate.Hold()).ok());
  ASSERT_TRUE(e.WaitLayerVersion(0, 1, kWait).ok());
  ASSERT_TRUE(Push(c, 1, 1, g11).ok());  // queued behind the held worker
  ASSERT_TRUE(c.BeginStep(2, kWait).ok());
  auto early = std::async(std::launch::async, [&] { return Push(c, 2, 1, bad12); });
  ASSERT_TRUE(WaitUntil([&] { return run->ChunksInRing(2) == 4; }));

  // The queued step cannot be aborted alone while step 1's gradients are still arriving.
  v1::AbortStepRequest ab2;
  ab2.set_step(2);
  const absl::Status refused = e.AbortStep(ab2);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("queued behind step 1"), std::string::npos) << refused;

  const uint64_t epoch = shm::Atomic(st->control().abort_epoch).load();
  v1::AbortStepRequest ab;
  ab.set_step(1);
  ab.set_reason("test: abort with step 2 queued");
  ASSERT_TRUE(e.AbortStep(ab).ok());
  EXPECT_EQ(shm::Atomic(st->control().abort_epoch).load(), epoch + 1);
  // The rank, in the dropped step 2, gets ABORTED from its next push.
  ASSERT_EQ(early.wait_for(kWait), std::future_status::ready);
  EXPECT_EQ(early.get().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Push(c, 2, 0, g02).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(run->ChunksInRing(2), 0);  // the dropped attempt's chunks are gone
  EXPECT_EQ(run->Job().step_state(), "aborted");
  EXPECT_EQ(run->StepsAborted(), 1u);  // step 1; the dropped step 2 never ran

  gate.Release();  // the aborted step's seal runs behind the held update
  EXPECT_EQ(Begin(e, c, 3).code(), absl::StatusCode::kOutOfRange);  // 2 is the next step
  ASSERT_TRUE(c.BeginStep(2, kWait).ok());
  EXPECT_EQ(run->Job().step_state(), "running");
  ASSERT_TRUE(Push(c, 2, 1, g12).ok());
  ASSERT_TRUE(Push(c, 2, 0, g02).ok());
  ASSERT_TRUE(c.WaitStep(2, kWait).ok());
  EXPECT_EQ(st->Checksum(), reference);
  EXPECT_EQ(run->StepsAborted(), 1u);
}

// A rank that began step 2 before waiting for step 1 (steps overlap) asks WaitStep(1) after step
// 1 completed and step 2 was aborted: step 1's updates are all published, so the wait succeeds;
// only waits of step 2 itself see the abort. (A drop of a queued step 2 the instant step 1
// finishes moves the same abort epoch; hostd marks step 1 completed before it does.)
TEST_P(OverlapTest, AbortOfTheNextStepDoesNotFailTheWaitForACompletedStep) {
  auto run = Start();
  ASSERT_NE(run, nullptr);
  rankclient::RankClient& c = *run->client;
  Engine& e = *run->engine;
  ASSERT_TRUE(c.BeginStep(1, kWait).ok());
  ASSERT_TRUE(Push(c, 1, 1, Grad(1, 1, c.layer_numel(1))).ok());
  ASSERT_TRUE(Push(c, 1, 0, Grad(0, 1, c.layer_numel(0))).ok());
  ASSERT_TRUE(c.BeginStep(2, kWait).ok());
  ASSERT_TRUE(WaitUntil([&] { return run->Job().step() == 1; }));  // step 1 completed
  v1::AbortStepRequest ab;
  ab.set_step(2);
  ab.set_reason("test: abort of the step after the one waited for");
  ASSERT_TRUE(e.AbortStep(ab).ok());
  const absl::Status waited = c.WaitStep(1, kWait);
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_EQ(e.state()->control().completed_step, 1u);
  const absl::Status aborted = c.WaitStep(2, std::chrono::milliseconds(200));
  EXPECT_EQ(aborted.code(), absl::StatusCode::kAborted) << aborted;
}

INSTANTIATE_TEST_SUITE_P(Routes, OverlapTest,
                         ::testing::Values(v1::GRAD_ROUTE_CPU_REDUCTION,
                                           v1::GRAD_ROUTE_GPU_REDUCTION,
                                           v1::GRAD_ROUTE_REDUCE_SCATTER),
                         [](const auto& info) { return v1::GradRoute_Name(info.param); });

}  // namespace
}  // namespace slidedp::hostd
