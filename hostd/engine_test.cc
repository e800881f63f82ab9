// The engine in process, behind its real gRPC service on a temporary unix socket: every RPC's
// bad input gets its specific status and a message naming the field, and leaves the state
// untouched (checksum before and after); a session stream's end aborts a running step.
#include "hostd/engine.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <barrier>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <random>
#include <thread>

#include "common/version.h"
#include "gtest/gtest.h"
#include "hostd/checkpoint_format.h"
#include "hostd/service.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"
#include "rankclient/rank_client.h"
#include "slidedp/v1/control.grpc.pb.h"

namespace slidedp::hostd {
namespace {

namespace v1 = slidedp::v1;
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
    if (engine_) engine_->Shutdown(/*remove_state=*/true);
    engine_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Start() {
    auto e = Engine::Create(config_);
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

  v1::AttachRankResponse Attach(uint32_t rank) {
    grpc::ClientContext ctx;
    v1::AttachRankRequest req;
    req.set_rank(rank);
    req.set_manifest_hash(Hash());
    req.set_pid(getpid());
    v1::AttachRankResponse resp;
    grpc::Status s = stub_->AttachRank(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
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
    v1::PublishCommIdResponse resp;
    cases.push_back({"publish from rank 1", call(&v1::Control::Stub::PublishCommId, r, &resp),
                     grpc::StatusCode::PERMISSION_DENIED, "rank"});
    r.set_rank(0);
    r.set_unique_id("");
    cases.push_back({"empty comm id", call(&v1::Control::Stub::PublishCommId, r, &resp),
                     grpc::StatusCode::INVALID_ARGUMENT, "unique_id"});
    v1::FetchCommIdRequest f;
    f.set_wait_ms(50);
    v1::FetchCommIdResponse fresp;
    cases.push_back({"fetch before publish", call(&v1::Control::Stub::FetchCommId, f, &fresp),
                     grpc::StatusCode::DEADLINE_EXCEEDED, "published"});
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
  ASSERT_TRUE(std::filesystem::exists(
      dir_ / "ck" / CheckpointDirName(1, {config_.instance, "default"}) / kCheckpointMarker));
  for (uint32_t layer : {0u, last}) {
    const std::vector<float> m = pattern(layer, 0), v = pattern(layer, 2);
    EXPECT_EQ(std::memcmp(s->master(layer), m.data(), m.size() * 4), 0) << layer;
    EXPECT_EQ(std::memcmp(s->exp_avg_sq(layer), v.data(), v.size() * 4), 0) << layer;
    EXPECT_EQ(s->params(layer)[5], kernels::RoundToBf16(m[5])) << layer;
    // Read back while hostd's copy is the job's state (between steps, at version 1).
    grpc::ClientContext ctx;
    v1::ReadClientLayerRequest req;
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
  EXPECT_FALSE(
      std::filesystem::exists(dir_ / "ck" / CheckpointDirName(2, {config_.instance, "default"})));
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

TEST_F(EngineTest, NcclIdRendezvous) {
  config_.world_size = 2;
  Start();
  std::thread fetcher([&] {
    grpc::ClientContext ctx;
    v1::FetchCommIdRequest f;
    f.set_rank(1);
    f.set_wait_ms(5000);
    v1::FetchCommIdResponse resp;
    grpc::Status s = stub_->FetchCommId(&ctx, f, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.unique_id(), std::string(128, '\x07'));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  grpc::ClientContext ctx;
  v1::PublishCommIdRequest p;
  p.set_unique_id(std::string(128, '\x07'));
  v1::PublishCommIdResponse pr;
  ASSERT_TRUE(stub_->PublishCommId(&ctx, p, &pr).ok());
  fetcher.join();
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
      o.manifest_hash = ManifestHashHex(ManifestHash(testing::SmallModel().manifest));
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
    run.engine->Shutdown(/*remove_state=*/true);
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
      if (engine) engine->Shutdown(/*remove_state=*/true);
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
    // Full ring slots of rank 0 holding a chunk of `step`.
    int ChunksInRing(uint64_t step) {
      TrainingState* s = engine->state();
      int n = 0;
      for (uint32_t i = 0; i < s->grad_ring_slots(); ++i) {
        const shm::ChunkSlot& cs = s->chunk_slot(0, i);
        if (shm::Atomic(cs.state).load() == shm::kSlotFull && cs.step == step) n++;
      }
      return n;
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
    o.manifest_hash = ManifestHashHex(ManifestHash(testing::SmallModel().manifest));
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
  static absl::Status Begin(Engine& e, uint64_t step) {
    v1::BeginStepRequest b;
    b.set_step(step);
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
  absl::Status ahead = Begin(e, 3);
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
  absl::StatusOr<CheckpointInfo> info = FindLatestCheckpoint((run->dir / "ck").string());
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
  auto stopped = std::async(std::launch::async, [&] { e.Shutdown(/*remove_state=*/true); });
  ASSERT_EQ(stopped.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "the stop waits for a checkpoint of a step that never ran";
  absl::StatusOr<CheckpointInfo> info = FindLatestCheckpoint((run->dir / "ck").string());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step, 1u);  // the final checkpoint (step 1 aborted: its layers are at 1)
  EXPECT_FALSE(std::filesystem::exists(run->dir / "ck" /
                                       CheckpointDirName(2, {e.config().instance, "default"})));
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
  EXPECT_EQ(Begin(e, 3).code(), absl::StatusCode::kOutOfRange);  // 2 is the next step
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
