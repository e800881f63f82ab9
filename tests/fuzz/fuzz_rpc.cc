// libFuzzer target: serialized requests through the control plane's handlers into a real Engine
// (hostd/engine.h) on a small in-memory job, without a socket.
//
// hostd/service.cc's handlers are one line each: Reply(engine_->Method(*req), resp) or
// ToGrpcStatus(engine_->Method(*req)). This target does the same with the bytes gRPC would hand
// them: ParseFromArray into the request message, the Engine method, ToGrpcStatus.
//
// Each input gets a fresh Engine (model "none", world size 2, hostd's configured chunk_bytes
// 4096) and is a sequence of records:
//   [method (1 byte)] [flags (1 byte)] [length (1 byte)] [length bytes of serialized request]
// method picks one of the 17 unary RPCs or a session call (OpenSession, heartbeat, SessionClosed,
// NextSessionEvent). Unless the input begins with a CreateJob record the job is created first
// from a built-in two-layer manifest. flags patch fields the fuzzer cannot guess: bit 0 the
// job's manifest_hash, bit 1 the attach_token issued to the request's rank (every rank RPC), bit 2
// the step to the job's next step, bit 3 rank % world size. For CreateJob and UpdateHyperParams,
// bit 4 says the request begins with ((flags >> 5) + 1) patches of two bytes [target, value]
// that set a size or a setting to an extreme value (kU64s, kDoubles: 0, 4095, 2^30 + 4096,
// 2^62, 2^64-1, NaN, -0.0, 1e308, ...): chunk_bytes, world_size, a dimension of the manifest
// (a CreateJob without a manifest gets the built-in one), a layer more, each OptimizerConfig
// field (UpdateHyperParams names it in `fields`). FetchCommId's wait is capped at 2 ms.
//
// Memory: a CreateJob is sent unless hostd would accept it (the harness runs the same
// validation) and its true shared-memory footprint (computed here in 128 bits: FP32 master,
// m, v and the BF16 copy per layer, page-aligned; the gradient rings world_size x 4 slots x
// chunk_bytes; the control segment) lies between 256 MiB and 2^44 bytes: it would only cost
// time. One beyond 2^44, which no machine can allocate, is sent and must be refused with
// INVALID_ARGUMENT or RESOURCE_EXHAUSTED.
//
// Oracles besides the sanitizers: no INTERNAL or UNKNOWN status, every error has a message, the
// gRPC status carries the Engine's code and message, GetStatus works after every call, and a
// failed call leaves the state's checksum unchanged. A CreateJob that creates the job returns a
// spec within the bounds (CheckJobId, CheckWorldSize, CheckRoutes, CheckOptimizer) and every
// segment has the size computed here; after an UpdateHyperParams that succeeds, the worker's
// optimizer is the one returned, within the bounds, and holds each value the request named.
#include <grpcpp/grpcpp.h>
#include <sched.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "hostd/engine.h"
#include "hostd/service.h"
#include "hostd/test_util.h"
#include "hostd/topology.h"
#include "model/job_spec.h"
#include "model/manifest.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

namespace v1 = slidedp::v1;

#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "fuzz_rpc: check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      abort();                                                                            \
    }                                                                                     \
  } while (0)

constexpr uint32_t kWorld = 2;
// hostd's configured chunk_bytes: what a request that leaves routes.chunk_bytes 0 gets.
constexpr uint64_t kDefaultChunkBytes = 4096;
// engine.cc's kGradRingSlots.
constexpr uint32_t kGradRingSlots = 4;
// A CreateJob hostd would accept with a footprint in [kSkipFrom, kSkipTo) is not sent.
constexpr uint64_t kSkipFrom = uint64_t{256} << 20;
constexpr uint64_t kSkipTo = uint64_t{1} << 44;

constexpr uint64_t kU64s[] = {0,
                              1,
                              2,
                              3,
                              63,
                              64,
                              65,
                              4095,
                              4096,
                              4097,
                              8192,
                              uint64_t{1} << 20,
                              (uint64_t{1} << 30) - 4096,
                              uint64_t{1} << 30,
                              (uint64_t{1} << 30) + 4096,
                              uint64_t{1} << 31,
                              (uint64_t{1} << 32) - 1,
                              uint64_t{1} << 32,
                              uint64_t{1} << 40,
                              uint64_t{1} << 44,
                              uint64_t{1} << 56,
                              (uint64_t{1} << 56) + 1,
                              uint64_t{1} << 62,
                              uint64_t{1} << 63,
                              std::numeric_limits<uint64_t>::max()};
constexpr double kDoubles[] = {0.0,
                               -0.0,
                               1.0,
                               -1.0,
                               0.5,
                               0.9,
                               0.999,
                               0.99999999999999989,  // the largest double below 1
                               1e-8,
                               1e-308,
                               4.9406564584124654e-324,  // the smallest denormal
                               1e308,
                               std::numeric_limits<double>::max(),
                               std::numeric_limits<double>::infinity(),
                               -std::numeric_limits<double>::infinity(),
                               std::numeric_limits<double>::quiet_NaN(),
                               -std::numeric_limits<double>::quiet_NaN(),
                               2.0,
                               1e-3};

uint64_t U64(uint8_t v) { return kU64s[v % std::size(kU64s)]; }
double Double(uint8_t v) { return kDoubles[v % std::size(kDoubles)]; }

// Sets OptimizerConfig field `target` (0..10) to the extreme value `v`; returns its name.
const char* PatchOptimizer(v1::OptimizerConfig& o, uint8_t target, uint8_t v) {
  switch (target % 11) {
    case 0:
      o.set_lr(Double(v));
      return "lr";
    case 1:
      o.set_beta1(Double(v));
      return "beta1";
    case 2:
      o.set_beta2(Double(v));
      return "beta2";
    case 3:
      o.set_eps(Double(v));
      return "eps";
    case 4:
      o.set_weight_decay(Double(v));
      return "weight_decay";
    case 5:
      o.set_min_lr_ratio(Double(v));
      return "min_lr_ratio";
    case 6:
      o.set_max_grad_norm(Double(v));
      return "max_grad_norm";
    case 7:
      o.set_warmup_steps(U64(v));
      return "warmup_steps";
    case 8:
      o.set_total_steps(U64(v));
      return "total_steps";
    case 9:
      o.set_schedule(static_cast<v1::LrScheduleKind>(static_cast<int32_t>(U64(v))));
      return "schedule";
    default:
      o.set_clip(static_cast<v1::ClipPolicy>(static_cast<int32_t>(U64(v))));
      return "clip";
  }
}

// A dimension of the manifest (the first tensor's first, the last tensor's last), a copy of layer
// 0 with an extreme first dimension, or a field of the spec.
void PatchSpec(v1::JobSpec& spec, uint8_t target, uint8_t v) {
  v1::ModelManifest& m = *spec.mutable_manifest();
  const auto dim = static_cast<int64_t>(U64(v));
  switch (target % 20) {
    case 0:
      spec.mutable_routes()->set_chunk_bytes(U64(v));
      break;
    case 1:
      spec.set_world_size(static_cast<uint32_t>(U64(v)));
      break;
    case 2:
    case 3: {
      if (m.layers_size() == 0 || m.layers(0).tensors_size() == 0) break;
      v1::TensorSpec* t =
          target % 20 == 2
              ? m.mutable_layers(0)->mutable_tensors(0)
              : m.mutable_layers(m.layers_size() - 1)
                    ->mutable_tensors(m.layers(m.layers_size() - 1).tensors_size() - 1);
      if (t->shape_size() == 0) t->add_shape(1);
      t->set_shape(target % 20 == 2 ? 0 : t->shape_size() - 1, dim);
      break;
    }
    case 4: {
      if (m.layers_size() == 0) break;
      v1::LayerSpec copy = m.layers(0);
      copy.set_name(absl::StrCat(copy.name(), ".copy", m.layers_size()));
      for (v1::TensorSpec& t : *copy.mutable_tensors()) {
        t.set_name(absl::StrCat(t.name(), ".copy", m.layers_size()));
      }
      if (copy.tensors_size() > 0 && copy.tensors(0).shape_size() > 0) {
        copy.mutable_tensors(0)->set_shape(0, dim);
      }
      *m.add_layers() = std::move(copy);
      break;
    }
    case 16:
      spec.mutable_optimizer()->set_grad_dtype(
          static_cast<v1::DType>(static_cast<int32_t>(U64(v))));
      break;
    case 17:
      spec.mutable_routes()->set_param_route(
          static_cast<v1::ParamRoute>(static_cast<int32_t>(U64(v))));
      break;
    case 18:
      spec.mutable_routes()->set_grad_route(
          static_cast<v1::GradRoute>(static_cast<int32_t>(U64(v))));
      break;
    case 19:
      spec.set_seed(U64(v));
      break;
    default:  // 5..15: the optimizer
      PatchOptimizer(*spec.mutable_optimizer(), static_cast<uint8_t>(target % 20 - 5), v);
      break;
  }
}

// Whether setting `field` of `asked` is the one `now` holds (the proto's names for schedule and
// clip 0 are constant and none). The last request naming a field sets it.
bool Applied(const std::string& field, const v1::OptimizerConfig& asked,
             const v1::OptimizerConfig& now) {
  auto same = [](double a, double b) { return std::memcmp(&a, &b, sizeof(a)) == 0; };
  if (field == "lr") return same(asked.lr(), now.lr());
  if (field == "beta1") return same(asked.beta1(), now.beta1());
  if (field == "beta2") return same(asked.beta2(), now.beta2());
  if (field == "eps") return same(asked.eps(), now.eps());
  if (field == "weight_decay") return same(asked.weight_decay(), now.weight_decay());
  if (field == "min_lr_ratio") return same(asked.min_lr_ratio(), now.min_lr_ratio());
  if (field == "max_grad_norm") return same(asked.max_grad_norm(), now.max_grad_norm());
  if (field == "warmup_steps") return asked.warmup_steps() == now.warmup_steps();
  if (field == "total_steps") return asked.total_steps() == now.total_steps();
  if (field == "schedule") {
    return now.schedule() == (asked.schedule() == v1::LR_SCHEDULE_UNSPECIFIED
                                  ? v1::LR_SCHEDULE_CONSTANT
                                  : asked.schedule());
  }
  if (field == "clip") {
    return now.clip() ==
           (asked.clip() == v1::CLIP_POLICY_UNSPECIFIED ? v1::CLIP_POLICY_NONE : asked.clip());
  }
  return false;  // not a settable field: the call must have failed
}

using Uint128 = unsigned __int128;
constexpr Uint128 kPage = shm::kPayloadAlign;
Uint128 AlignUp(Uint128 v) { return (v + kPage - 1) / kPage * kPage; }

// The segments a job of this (normalized) spec and manifest maps, sized as TrainingState lays
// them out, in 128 bits: whatever the request says, nothing here wraps (a product of dimensions
// saturates at 2^100, past any machine).
struct Footprint {
  Uint128 control = 0, state = 0, params = 0, grads = 0;
  Uint128 total() const { return control + state + params + grads; }
};

Footprint FootprintOf(const v1::ModelManifest& m, uint32_t world_size, uint64_t chunk_bytes) {
  constexpr Uint128 kSaturated = Uint128{1} << 100;
  Footprint f;
  f.state = shm::kHeaderBytes;
  f.params = shm::kHeaderBytes;
  for (const v1::LayerSpec& l : m.layers()) {
    Uint128 numel = 0;
    for (const v1::TensorSpec& t : l.tensors()) {
      Uint128 n = 1;
      for (int64_t d : t.shape()) {
        n = d <= 0 ? 0 : std::min(kSaturated, n * static_cast<Uint128>(d));
      }
      numel = std::min(kSaturated, numel + n);
    }
    f.state += 3 * AlignUp(numel * 4);
    f.params += AlignUp(numel * 2);
  }
  f.state = AlignUp(f.state);
  f.params = AlignUp(f.params);
  f.grads = AlignUp(shm::kHeaderBytes + Uint128{world_size} * kGradRingSlots * chunk_bytes);
  f.control = AlignUp(
      shm::ControlSegmentBytes(static_cast<uint32_t>(m.layers_size()), world_size, kGradRingSlots));
  return f;
}

// The bytes of patches (flags bit 4) at the front of a record's payload.
size_t PatchCount(uint8_t flags, size_t n) {
  if (!(flags & 16)) return 0;
  return std::min<size_t>(2 * ((flags >> 5) + 1), n);
}

// One NUMA node holding the first CPU this process may run on: no hwloc discovery (its plugins
// are dlopen'ed and closed, so LeakSanitizer could not attribute what they keep).
const Topology& FixedTopology() {
  static const Topology topo = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    int cpu = 0;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &set)) ++cpu;
    }
    Topology t;
    NumaNodeInfo node;
    node.os_index = 0;
    node.core_cpus = {cpu};
    node.all_cpus = {cpu};
    node.memory_bytes = uint64_t{1} << 30;
    t.nodes.push_back(node);
    t.cores = 1;
    return t;
  }();
  return topo;
}

// FUZZ_VERBOSE=1 keeps hostd's log and prints each record's answer (reproducing an input).
bool Verbose() {
  static const bool verbose = getenv("FUZZ_VERBOSE") != nullptr;
  return verbose;
}

void CheckStatus(const absl::Status& s, const char* method) {
  if (s.ok()) return;
  if (s.code() == absl::StatusCode::kInternal || s.code() == absl::StatusCode::kUnknown ||
      s.message().empty()) {
    fprintf(stderr, "fuzz_rpc: %s returned %s\n", method, s.ToString().c_str());
    abort();
  }
  const grpc::Status g = ToGrpcStatus(s);
  FUZZ_CHECK(static_cast<int>(g.error_code()) == static_cast<int>(s.code()));
  FUZZ_CHECK(g.error_message() == s.message());
}

template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& r) {
  return r.status();
}
absl::Status StatusOf(const absl::Status& s) { return s; }

class Harness {
 public:
  Harness() {
    HostdConfig c;
    c.instance = testing::UniqueInstance("fzrpc");
    c.model = "none";
    c.world_size = kWorld;
    c.update_threads = 1;
    c.mlock = "off";
    c.isa = "scalar";
    c.heartbeat_interval_ms = 100;
    c.heartbeat_deadline_ms = 60000;
    c.routes.set_chunk_bytes(kDefaultChunkBytes);
    engine_ = Engine::Create(c, {}, FixedTopology()).value();
  }
  ~Harness() { engine_->Shutdown(/*remove_state=*/true).IgnoreError(); }

  void CreateDefaultJob() {
    v1::CreateJobRequest req;
    *req.mutable_spec()->mutable_manifest() = testing::SmallModel().manifest;
    req.mutable_spec()->set_world_size(kWorld);
    req.mutable_spec()->mutable_routes()->set_chunk_bytes(kDefaultChunkBytes);
    FUZZ_CHECK(engine_->CreateJob(req).ok());
  }

  void Record(uint8_t method, uint8_t flags, const uint8_t* p, size_t n) {
    const uint64_t before = engine_->state() ? engine_->state()->Checksum() : 0;
    absl::Status s;
    const char* name = "";
    switch (method % 20) {
      case 0:
        s = Call<v1::HandshakeRequest>(p, n, flags, "Handshake", &name,
                                       [&](auto& r) { return engine_->Handshake(r); });
        break;
      case 1: {
        const size_t np = PatchCount(flags, n);
        s = Call<v1::CreateJobRequest>(p + np, n - np, flags, "CreateJob", &name,
                                       [&](auto& r) { return CreateJob(r, p, np); });
        break;
      }
      case 2:
        s = Call<v1::AttachRankRequest>(p, n, flags, "AttachRank", &name, [&](auto& r) {
          if (flags & 1) r.set_manifest_hash(Hash());
          auto resp = engine_->AttachRank(r);
          if (resp.ok()) tokens_[r.rank()] = resp->attach_token();
          return resp;
        });
        break;
      case 3:
        s = Call<v1::DetachRankRequest>(p, n, flags, "DetachRank", &name, [&](auto& r) {
          if (flags & 2) r.set_attach_token(tokens_[r.rank()]);
          return engine_->DetachRank(r);
        });
        break;
      case 4:
        s = Call<v1::BeginStepRequest>(p, n, flags, "BeginStep", &name, [&](auto& r) {
          if (flags & 2) r.set_attach_token(tokens_[r.rank()]);
          if (flags & 4) r.set_step(NextStep() + (flags >> 4) % 3);
          return engine_->BeginStep(r);
        });
        break;
      case 5:
        s = Call<v1::AbortStepRequest>(p, n, flags, "AbortStep", &name, [&](auto& r) {
          if (flags & 4) r.set_step(NextStep() + (flags >> 4) % 3);
          return engine_->AbortStep(r);
        });
        break;
      case 6:
        s = Call<v1::PublishCommIdRequest>(p, n, flags, "PublishCommId", &name, [&](auto& r) {
          if (flags & 2) r.set_attach_token(tokens_[r.rank()]);
          return engine_->PublishCommId(r);
        });
        break;
      case 7:
        s = Call<v1::FetchCommIdRequest>(p, n, flags, "FetchCommId", &name, [&](auto& r) {
          r.set_wait_ms(r.wait_ms() % 3);
          if (flags & 2) r.set_attach_token(tokens_[r.rank()]);
          return engine_->FetchCommId(r);
        });
        break;
      case 8:
        s = Call<v1::GetStatusRequest>(p, n, flags, "GetStatus", &name,
                                       [&](auto&) { return engine_->GetStatus(); });
        break;
      case 9:
        s = Call<v1::ListLayersRequest>(p, n, flags, "ListLayers", &name,
                                        [&](auto& r) { return engine_->ListLayers(r); });
        break;
      case 10:
        s = Call<v1::ListRanksRequest>(p, n, flags, "ListRanks", &name,
                                       [&](auto& r) { return engine_->ListRanks(r); });
        break;
      case 11:
        s = Call<v1::GetStatsRequest>(p, n, flags, "GetStats", &name,
                                      [&](auto& r) { return engine_->GetStats(r); });
        break;
      case 12:
        s = Call<v1::GetConfigRequest>(p, n, flags, "GetConfig", &name, [&](auto&) {
          engine_->GetConfig();
          return absl::OkStatus();
        });
        break;
      case 13: {
        const size_t np = PatchCount(flags, n);
        s = Call<v1::UpdateHyperParamsRequest>(
            p + np, n - np, flags, "UpdateHyperParams", &name, [&](auto& r) {
              for (size_t i = 0; i + 1 < np; i += 2) {
                *r.add_fields() = PatchOptimizer(*r.mutable_optimizer(), p[i], p[i + 1]);
              }
              return UpdateHyperParams(r);
            });
        break;
      }
      case 14:
        s = Call<v1::SessionOpen>(p, n, flags, "OpenSession", &name, [&](auto& r) {
          if (flags & 2) r.set_attach_token(tokens_[r.rank()]);
          auto opened = engine_->OpenSession(r);
          if (opened.ok()) open_.insert(r.rank());
          return opened;
        });
        break;
      // The session calls get the rank of an open that OpenSession accepted (as service.cc's
      // stream handler does).
      case 15:
        s = Call<v1::SessionClientMessage>(p, n, flags, "SessionHeartbeat", &name, [&](auto& r) {
          if (open_.count(flags % kWorld)) {
            engine_->SessionHeartbeat(flags % kWorld, tokens_[flags % kWorld], r.heartbeat());
          }
          return absl::OkStatus();
        });
        break;
      case 16:
        name = "SessionClosed";
        if (open_.erase(flags % kWorld)) {
          engine_->SessionClosed(flags % kWorld, tokens_[flags % kWorld], "fuzz");
        }
        break;
      case 18:
        s = Call<v1::UploadClientLayerRequest>(p, n, flags, "UploadClientLayer", &name,
                                               [&](auto& r) {
                                                 if (flags & 2)
                                                   r.set_attach_token(tokens_[r.rank()]);
                                                 return engine_->UploadClientLayer(r).status();
                                               });
        break;
      case 19:
        s = Call<v1::ReadClientLayerRequest>(p, n, flags, "ReadClientLayer", &name, [&](auto& r) {
          if (flags & 2) r.set_attach_token(tokens_[r.rank()]);
          return engine_->ReadClientLayer(r).status();
        });
        break;
      case 17:
        name = "NextSessionEvent";
        if (open_.count(flags % kWorld)) {
          engine_->SessionActive(flags % kWorld, tokens_[flags % kWorld]);
          engine_->NextSessionEvent(flags % kWorld, tokens_[flags % kWorld],
                                    std::chrono::milliseconds(0));
        }
        break;
    }
    if (Verbose()) fprintf(stderr, "fuzz_rpc: %s: %s\n", name, s.ToString().c_str());
    CheckStatus(s, name);
    absl::StatusOr<v1::GetStatusResponse> st = engine_->GetStatus();
    FUZZ_CHECK(st.ok());
    // A refused request changes nothing (a CreateJob that failed created no state either).
    if (!s.ok() && engine_->state() != nullptr && before != 0) {
      FUZZ_CHECK(engine_->state()->Checksum() == before);
    }
  }

 private:
  absl::StatusOr<v1::CreateJobResponse> CreateJob(v1::CreateJobRequest& r, const uint8_t* patches,
                                                  size_t np) {
    if (np > 0 && r.spec().manifest().layers_size() == 0 && r.resume_path().empty()) {
      *r.mutable_spec()->mutable_manifest() = testing::SmallModel().manifest;
    }
    for (size_t i = 0; i + 1 < np; i += 2) PatchSpec(*r.mutable_spec(), patches[i], patches[i + 1]);
    const bool had_job = engine_->state() != nullptr;
    // What hostd allocates for it, were it accepted (with the defaults CreateJob fills).
    const uint32_t world = r.spec().world_size() == 0 ? 1 : r.spec().world_size();
    const uint64_t chunk =
        r.spec().routes().chunk_bytes() == 0 ? kDefaultChunkBytes : r.spec().routes().chunk_bytes();
    const Footprint f = FootprintOf(r.spec().manifest(), world, chunk);
    if (!had_job && r.resume_path().empty() && f.total() >= kSkipFrom && f.total() < kSkipTo) {
      v1::Routes defaults;
      defaults.set_chunk_bytes(kDefaultChunkBytes);
      if (model::ValidateManifest(r.spec().manifest()).ok() &&
          model::NormalizeJobSpec(r.spec(), defaults).ok()) {
        if (Verbose())
          fprintf(stderr, "fuzz_rpc: CreateJob of %.3g bytes not sent\n",
                  static_cast<double>(f.total()));
        return v1::CreateJobResponse();  // would be accepted: costs memory and time only
      }
    }
    absl::StatusOr<v1::CreateJobResponse> resp = engine_->CreateJob(r);
    if (had_job) return resp;
    if (f.total() >= kSkipTo && r.resume_path().empty()) {
      // No machine holds it: refused as bad input or as too large, never attempted.
      if (resp.ok() || (resp.status().code() != absl::StatusCode::kInvalidArgument &&
                        resp.status().code() != absl::StatusCode::kResourceExhausted)) {
        fprintf(stderr, "fuzz_rpc: a CreateJob of %.3g bytes answered %s\n",
                static_cast<double>(f.total()),
                resp.ok() ? "OK" : resp.status().ToString().c_str());
        abort();
      }
    }
    if (resp.ok()) CheckCreatedJob(*resp);
    return resp;
  }

  // The job CreateJob made: its effective spec within the bounds, its segments the sizes its
  // spec and manifest call for.
  void CheckCreatedJob(const v1::CreateJobResponse& resp) {
    const v1::JobSpec& spec = resp.spec();
    FUZZ_CHECK(!model::CheckJobId(spec.job_id()));
    FUZZ_CHECK(!model::CheckWorldSize(spec.world_size()));
    FUZZ_CHECK(!model::CheckRoutes(spec.routes()));
    FUZZ_CHECK(!model::CheckOptimizer(spec.optimizer()));
    FUZZ_CHECK(model::ValidateManifest(spec.manifest()).ok());
    const Footprint f =
        FootprintOf(spec.manifest(), spec.world_size(), spec.routes().chunk_bytes());
    FUZZ_CHECK(f.total() < kSkipFrom);
    absl::StatusOr<v1::GetStatusResponse> st = engine_->GetStatus();
    FUZZ_CHECK(st.ok());
    int seen = 0;
    for (const v1::SegmentInfo& seg : st->segments()) {
      const Uint128 want = seg.kind() == v1::SEGMENT_KIND_CONTROL  ? f.control
                           : seg.kind() == v1::SEGMENT_KIND_STATE  ? f.state
                           : seg.kind() == v1::SEGMENT_KIND_PARAMS ? f.params
                                                                   : f.grads;
      if (Uint128{seg.size_bytes()} != want) {
        fprintf(stderr, "fuzz_rpc: segment %s is %llu bytes, the spec calls for %llu\n",
                seg.name().c_str(), static_cast<unsigned long long>(seg.size_bytes()),
                static_cast<unsigned long long>(want));
        abort();
      }
      ++seen;
    }
    FUZZ_CHECK(seen == 4);
    FUZZ_CHECK(Uint128{st->shm_bytes()} == f.total());
  }

  absl::StatusOr<v1::UpdateHyperParamsResponse> UpdateHyperParams(
      const v1::UpdateHyperParamsRequest& r) {
    absl::StatusOr<v1::UpdateHyperParamsResponse> resp = engine_->UpdateHyperParams(r);
    if (resp.ok()) {
      const v1::OptimizerConfig now = engine_->worker()->optimizer();
      FUZZ_CHECK(!model::CheckOptimizer(now));
      FUZZ_CHECK(now.SerializeAsString() == resp->optimizer().SerializeAsString());
      // What was asked is what was applied: a named field is a value, not "unset".
      for (const std::string& f : r.fields()) {
        if (!Applied(f, r.optimizer(), now)) {
          fprintf(stderr, "fuzz_rpc: UpdateHyperParams answered OK but %s is not the value asked\n",
                  f.c_str());
          abort();
        }
      }
    }
    return resp;
  }

  std::string Hash() {
    auto st = engine_->GetStatus();
    return st.ok() ? st->job().manifest_hash() : std::string();
  }
  uint64_t NextStep() {
    auto st = engine_->GetStatus();
    return st.ok() ? st->job().step() + 1 : 1;
  }

  template <typename Req, typename Fn>
  absl::Status Call(const uint8_t* p, size_t n, uint8_t flags, const char* method,
                    const char** name, Fn fn) {
    *name = method;
    Req req;
    // gRPC answers a message that does not parse with INTERNAL before any handler runs.
    if (!req.ParseFromArray(p, static_cast<int>(n))) return absl::OkStatus();
    if constexpr (requires {
                    req.rank();
                    req.set_rank(0u);
                  }) {
      if (flags & 8) req.set_rank(req.rank() % kWorld);
    }
    return StatusOf(fn(req));
  }

  std::unique_ptr<Engine> engine_;
  std::map<uint32_t, std::string> tokens_;
  std::set<uint32_t> open_;  // ranks with an open session
};

}  // namespace
}  // namespace slidedp::hostd

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (!slidedp::hostd::Verbose()) spdlog::set_level(spdlog::level::off);
  slidedp::hostd::FixedTopology();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slidedp::hostd;
  Harness h;
  if (size == 0 || data[0] % 20 != 1) h.CreateDefaultJob();
  size_t pos = 0;
  for (int records = 0; pos + 3 <= size && records < 64; ++records) {
    const uint8_t method = data[pos];
    const uint8_t flags = data[pos + 1];
    const size_t len = std::min<size_t>(data[pos + 2], size - pos - 3);
    h.Record(method, flags, data + pos + 3, len);
    pos += 3 + len;
  }
  return 0;
}
