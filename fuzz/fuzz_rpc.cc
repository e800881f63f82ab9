// libFuzzer target: serialized requests through the control plane's handlers into a real Engine
// (hostd/engine.h) on a small in-memory job, without a socket.
//
// hostd/service.cc's handlers are one line each: Reply(engine_->Method(*req), resp) or
// ToGrpcStatus(engine_->Method(*req)). This target does the same with the bytes gRPC would hand
// them: ParseFromArray into the request message, the Engine method, ToGrpcStatus.
//
// Each input gets a fresh Engine (model "none", world size 2) and is a sequence of records:
//   [method (1 byte)] [flags (1 byte)] [length (1 byte)] [length bytes of serialized request]
// method picks one of the 17 unary RPCs or a session call (OpenSession, heartbeat, SessionClosed,
// NextSessionEvent). Unless the input begins with a CreateJob record the job is created first
// from a built-in two-layer manifest. flags patch fields the fuzzer cannot guess: bit 0 the
// job's manifest_hash, bit 1 the attach_token issued to the request's rank (every rank RPC), bit 2
// the step to the job's next step, bit 3 rank % world size. FetchCommId's wait is capped at 2 ms,
// and a CreateJob of more than 2^20 parameters is not sent (it would only cost memory and time).
// Oracles besides the sanitizers: no INTERNAL or UNKNOWN status, every error has a message, the
// gRPC status carries the Engine's code and message, GetStatus works after every call, and a
// failed call leaves the state's checksum unchanged.
#include <grpcpp/grpcpp.h>
#include <sched.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "hostd/engine.h"
#include "hostd/service.h"
#include "hostd/test_util.h"
#include "hostd/topology.h"
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
constexpr uint64_t kMaxFuzzParams = 1u << 20;

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
    c.routes.set_chunk_bytes(4096);
    engine_ = Engine::Create(c, {}, FixedTopology()).value();
  }
  ~Harness() { engine_->Shutdown(/*remove_state=*/true).IgnoreError(); }

  void CreateDefaultJob() {
    v1::CreateJobRequest req;
    *req.mutable_spec()->mutable_manifest() = testing::SmallModel().manifest;
    req.mutable_spec()->set_world_size(kWorld);
    req.mutable_spec()->mutable_routes()->set_chunk_bytes(4096);
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
      case 1:
        s = Call<v1::CreateJobRequest>(p, n, flags, "CreateJob", &name, [&](auto& r) {
          uint64_t total = 0;
          for (const auto& l : r.spec().manifest().layers()) {
            for (const auto& t : l.tensors()) {
              uint64_t numel = 1;
              for (int64_t d : t.shape()) {
                if (d <= 0 || d > static_cast<int64_t>(kMaxFuzzParams)) {
                  numel = 0;
                  break;
                }
                numel *= static_cast<uint64_t>(d);
                if (numel > kMaxFuzzParams) break;
              }
              total += numel;
              if (total > kMaxFuzzParams) break;
            }
            if (total > kMaxFuzzParams) break;
          }
          if (total > kMaxFuzzParams) {
            return absl::StatusOr<v1::CreateJobResponse>(v1::CreateJobResponse());
          }
          r.mutable_spec()->mutable_routes()->set_chunk_bytes(4096);
          return engine_->CreateJob(r);
        });
        break;
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
      case 13:
        s = Call<v1::UpdateHyperParamsRequest>(
            p, n, flags, "UpdateHyperParams", &name,
            [&](auto& r) { return engine_->UpdateHyperParams(r); });
        break;
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
    CheckStatus(s, name);
    absl::StatusOr<v1::GetStatusResponse> st = engine_->GetStatus();
    FUZZ_CHECK(st.ok());
    // A refused request changes nothing (a CreateJob that failed created no state either).
    if (!s.ok() && engine_->state() != nullptr && before != 0) {
      FUZZ_CHECK(engine_->state()->Checksum() == before);
    }
  }

 private:
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
  // FUZZ_VERBOSE=1 keeps hostd's log (the reasons of protocol errors) when reproducing.
  if (getenv("FUZZ_VERBOSE") == nullptr) spdlog::set_level(spdlog::level::off);
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
