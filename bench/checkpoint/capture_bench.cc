// capture_bench: what a checkpoint taken while training runs costs hostd's update worker, with
// no GPU and no ranks: the real TrainingState, UpdateWorker and Checkpointer (hostd's code), a
// synthetic model of --layers x --params-per-layer, one BF16 gradient submitted for every layer
// each step (highest layer first, as backward does). A step's time is from its first submit to
// the last layer's publish: hostd's AdamW time for the step, which is the step time of a
// host-bound job. After --at steps a checkpoint of that version starts; --checkpoints of them run
// one after the other (the next two steps after the previous one committed: it finds that one's
// buffers kept, unless --keep-pool off), and the steps go on until the last one has committed
// (at least --steps in all). Prints JSON (and writes --out): per-step milliseconds and which
// checkpoint was in flight; per checkpoint the median/mean/max step and their ratios to the
// median step without one; the checkpointer's counters.
//   capture_bench [--layers 8] [--params-per-layer 16M] [--threads 0] [--steps 24] [--at 6]
//                 [--checkpoints 2] [--pool 0 (auto: all of the state)] [--keep-pool on|off]
//                 [--huge-pages on|off] [--prepare on|off] [--dir DIR] [--out FILE]
// --prepare on: Checkpointer::PreparePool after the first step, as hostd does with
// checkpoint.prepare_snapshot_pool (the first checkpoint then finds its buffers faulted in).
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/adam/json_writer.h"
#include "common/thread_pool.h"
#include "hostd/checkpoint.h"
#include "hostd/optimizer.h"
#include "hostd/state.h"
#include "kernels/cpu/adamw.h"
#include "model/manifest.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;
namespace v1 = slidedp::v1;
using Clock = std::chrono::steady_clock;

struct Args {
  uint32_t layers = 8;
  uint64_t params_per_layer = 16ull << 20;
  uint32_t threads = 0;  // 0: hardware concurrency
  uint32_t steps = 24;
  uint32_t at = 6;
  uint64_t pool = 0;         // 0: the whole state
  uint32_t checkpoints = 2;  // the second one finds the first one's buffers kept
  bool keep_pool = true;
  bool huge_pages = false;
  bool prepare = false;
  std::string dir;
  std::string out;
  std::string command;
};

bool ParseSize(const std::string& s, uint64_t* out) {
  uint64_t mult = 1;
  std::string n = s;
  if (!n.empty() && (n.back() == 'K' || n.back() == 'M' || n.back() == 'G')) {
    mult = n.back() == 'K' ? 1ull << 10 : n.back() == 'M' ? 1ull << 20 : 1ull << 30;
    n.pop_back();
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(n, &v)) return false;
  *out = v * mult;
  return true;
}

int Usage(const char* why) {
  std::fprintf(stderr,
               "capture_bench: %s\nusage: capture_bench [--layers N] [--params-per-layer N[K|M|G]] "
               "[--threads N] [--steps N] [--at N] [--checkpoints N] [--pool BYTES[K|M|G]] "
               "[--keep-pool on|off] [--huge-pages on|off] [--prepare on|off] "
               "[--dir DIR] [--out FILE]\n",
               why);
  return 2;
}

model::LoadedModel SyntheticModel(const Args& a) {
  model::LoadedModel m;
  m.manifest.set_family("bench");
  m.manifest.set_name("capture_bench");
  for (uint32_t l = 0; l < a.layers; ++l) {
    auto* layer = m.manifest.add_layers();
    layer->set_name(absl::StrCat("block", l));
    layer->set_kind(v1::LAYER_KIND_DECODER);
    auto* t = layer->add_tensors();
    t->set_name(absl::StrCat("block", l, ".weight"));
    t->add_shape(static_cast<int64_t>(a.params_per_layer));
    t->set_dtype(v1::DTYPE_BF16);
  }
  m.initializer_range = 0.02;
  m.source = "capture_bench";
  m.manifest.set_manifest_hash(model::ManifestHashHex(model::ManifestHash(m.manifest)));
  return m;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

int Run(const Args& a) {
  const uint32_t threads =
      a.threads ? a.threads : std::max(1u, std::thread::hardware_concurrency());
  auto pool = ThreadPool::Create({.num_threads = static_cast<int>(threads)});
  if (!pool.ok()) return Usage(std::string(pool.status().message()).c_str());
  TrainingState::Options so;
  so.instance = absl::StrCat("capbench", getpid());
  so.model = SyntheticModel(a);
  so.mlock = MlockPolicy::kBestEffort;
  so.seed = 1;
  auto created = TrainingState::Create(so, pool->get());
  if (!created.ok()) {
    std::fprintf(stderr, "capture_bench: %s\n", std::string(created.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<TrainingState> state = std::move(*created);
  state->set_remove_on_destroy(true);
  const uint64_t state_bytes = 12ull * a.params_per_layer * a.layers;

  v1::OptimizerConfig cfg;
  cfg.set_lr(1e-4);
  cfg.set_beta1(0.9);
  cfg.set_beta2(0.999);
  cfg.set_eps(1e-8);
  cfg.set_weight_decay(0.01);
  cfg = *model::NormalizeOptimizerConfig(cfg);
  UpdateWorker worker(state.get(), pool->get(), {kernels::BestIsa(), 1 << 20}, cfg);
  Checkpointer::Options co;
  co.keep_last = 1;
  co.snapshot_pool_bytes = a.pool ? a.pool : state_bytes;
  co.snapshot_huge_pages = a.huge_pages;
  co.keep_snapshot_pool = a.keep_pool;
  Checkpointer cp(state.get(), pool->get(), co);
  worker.SetBeforeWriteHook([&cp](uint32_t l, uint64_t s) { cp.BeforeLayerWrite(l, s); });
  worker.Start();

  std::vector<uint16_t> grad(a.params_per_layer);
  std::mt19937 rng(3);
  for (uint16_t& g : grad)
    g = static_cast<uint16_t>(0x3c00 | (rng() & 0x3ff));  // ~[0.0078, 0.0156)
  const std::string dir =
      a.dir.empty()
          ? (fs::temp_directory_path() / absl::StrCat("capture_bench_", getpid())).string()
          : a.dir;
  fs::create_directories(dir);

  struct StepRec {
    uint64_t step;
    double ms;
    int checkpoint;  // index of the checkpoint in flight during the step, -1: none
  };
  struct CkRec {
    uint64_t step = 0;  // its version
    double seconds = 0;
    bool ok = false;
  };
  std::vector<StepRec> recs;
  std::vector<CkRec> cks;
  uint64_t next_at = a.at;
  Clock::time_point ck0;
  for (uint64_t step = 1;; ++step) {
    const bool flight_before = cp.in_flight();
    const auto t0 = Clock::now();
    for (uint32_t l = a.layers; l-- > 0;) {
      absl::Status s =
          worker.Submit(l, step, {grad.data(), kernels::GradType::kBf16, grad.size()}, nullptr);
      if (!s.ok()) {
        std::fprintf(stderr, "capture_bench: submit: %s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
    while (state->committed_version(0) < step) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (step == 1 && a.prepare) cp.PreparePool();
    const bool flight = flight_before || cp.in_flight();
    recs.push_back({step, ms, flight ? static_cast<int>(cks.size()) - 1 : -1});
    std::fprintf(stderr, "step %3llu %8.1f ms%s\n", static_cast<unsigned long long>(step), ms,
                 flight ? "  (checkpoint in flight)" : "");
    if (!cks.empty() && cks.back().seconds == 0 && !cp.in_flight()) {
      CkRec& c = cks.back();
      c.seconds = std::chrono::duration<double>(Clock::now() - ck0).count();
      c.ok = cp.Wait(c.step, 0).ok();
      if (cks.size() == a.checkpoints) {
        if (step >= a.steps) break;
      } else {
        next_at = step + 2;  // a step without a checkpoint in between
      }
    }
    if (step == next_at && cks.size() < a.checkpoints) {
      model::CheckpointInfo info;
      info.job_id = "bench";
      info.manifest_hash = model::ManifestHashHex(state->manifest_hash());
      *info.spec.mutable_manifest() = state->model().manifest;
      *info.spec.mutable_optimizer() = cfg;
      info.spec.set_world_size(1);
      info.model_source = "capture_bench";
      if (absl::Status s = cp.Start(dir, step, info); !s.ok()) {
        std::fprintf(stderr, "capture_bench: checkpoint: %s\n", std::string(s.message()).c_str());
        return 1;
      }
      cks.push_back({step, 0, false});
      ck0 = Clock::now();
    }
    if (cks.size() == a.checkpoints && cks.back().seconds > 0 && step >= a.steps) break;
  }
  worker.Stop();
  const CheckpointStats st = cp.stats();
  if (a.dir.empty()) fs::remove_all(dir);

  std::vector<double> without;
  for (const StepRec& r : recs) {
    if (r.step > 1 && r.checkpoint < 0) without.push_back(r.ms);  // step 1 faults pages in
  }
  const double med_without = Median(without);
  bool all_ok = true;

  utsname un{};
  uname(&un);
  bench::JsonWriter j;
  j.BeginObject();
  j.Key("bench").String("checkpoint_capture");
  j.Key("command").String(a.command);
  j.Key("machine").BeginObject();
  j.Key("host").String(un.nodename);
  j.Key("cpus").Int(std::thread::hardware_concurrency());
  j.Key("isa").String(kernels::IsaName(kernels::BestIsa()));
  j.EndObject();
  j.Key("layers").Int(a.layers);
  j.Key("params_per_layer").Int(static_cast<int64_t>(a.params_per_layer));
  j.Key("state_bytes").Int(static_cast<int64_t>(state_bytes));
  j.Key("update_threads").Int(threads);
  j.Key("snapshot_pool_bytes").Int(static_cast<int64_t>(co.snapshot_pool_bytes));
  j.Key("keep_snapshot_pool").Bool(a.keep_pool);
  j.Key("snapshot_huge_pages").Bool(a.huge_pages);
  j.Key("prepare_snapshot_pool").Bool(a.prepare);
  j.Key("pool_prepared_bytes").Int(static_cast<int64_t>(st.pool_prepared_bytes));
  j.Key("pool_prepare_seconds").Number(st.pool_prepare_seconds);
  j.Key("snapshot_buffers_allocated").Int(static_cast<int64_t>(st.snapshot_buffers_allocated));
  j.Key("median_step_ms_without").Number(med_without);
  j.Key("checkpoints").BeginArray();
  for (size_t c = 0; c < cks.size(); ++c) {
    std::vector<double> with;
    for (const StepRec& r : recs) {
      if (r.checkpoint == static_cast<int>(c)) with.push_back(r.ms);
    }
    const double mean =
        with.empty() ? 0 : std::accumulate(with.begin(), with.end(), 0.0) / with.size();
    const double mx = with.empty() ? 0 : *std::max_element(with.begin(), with.end());
    all_ok = all_ok && cks[c].ok;
    j.BeginObject();
    j.Key("version").Int(static_cast<int64_t>(cks[c].step));
    j.Key("ok").Bool(cks[c].ok);
    j.Key("seconds").Number(cks[c].seconds);
    j.Key("steps_in_flight").Int(static_cast<int64_t>(with.size()));
    j.Key("median_step_ms").Number(Median(with));
    j.Key("mean_step_ms").Number(mean);
    j.Key("max_step_ms").Number(mx);
    j.Key("mean_ratio").Number(med_without > 0 ? mean / med_without : 0);
    j.Key("max_ratio").Number(med_without > 0 ? mx / med_without : 0);
    j.EndObject();
  }
  j.EndArray();
  j.Key("checkpoint_ok").Bool(all_ok && cks.size() == a.checkpoints);
  j.Key("step_ms").BeginArray();
  for (const StepRec& r : recs) j.Number(r.ms);
  j.EndArray();
  j.Key("step_checkpoint").BeginArray();
  for (const StepRec& r : recs) j.Int(r.checkpoint);
  j.EndArray();
  j.Key("stall_seconds").Number(st.stall_seconds);
  j.Key("snapshot_seconds").Number(st.snapshot_seconds);
  j.Key("layers_snapshotted").Int(static_cast<int64_t>(st.layers_snapshotted));
  j.Key("layers_copied_by_writer").Int(static_cast<int64_t>(st.layers_copied_by_writer));
  j.Key("layers_written_live").Int(static_cast<int64_t>(st.layers_written_live));
  j.Key("pool_kept_bytes").Int(static_cast<int64_t>(st.pool_kept_bytes));
  j.Key("last_checkpoint_mb_per_s").Number(st.last_mb_per_s);
  j.EndObject();
  const std::string doc = j.str();
  std::printf("%s\n", doc.c_str());
  if (!a.out.empty()) std::ofstream(a.out) << doc << '\n';
  return all_ok && cks.size() == a.checkpoints ? 0 : 1;
}

}  // namespace
}  // namespace slidedp::hostd

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);  // spdlog writes to stdout, where the JSON goes
  slidedp::hostd::Args a;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) a.command += ' ';
    a.command += argv[i];
  }
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) return slidedp::hostd::Usage(("missing value for " + k).c_str());
    const std::string v = argv[++i];
    uint64_t n = 0;
    if (k == "--layers" && absl::SimpleAtoi(v, &n) && n >= 1 && n <= 4096) {
      a.layers = static_cast<uint32_t>(n);
    } else if (k == "--params-per-layer" && slidedp::hostd::ParseSize(v, &n) && n >= 1) {
      a.params_per_layer = n;
    } else if (k == "--threads" && absl::SimpleAtoi(v, &n) && n <= 1024) {
      a.threads = static_cast<uint32_t>(n);
    } else if (k == "--steps" && absl::SimpleAtoi(v, &n) && n >= 2) {
      a.steps = static_cast<uint32_t>(n);
    } else if (k == "--at" && absl::SimpleAtoi(v, &n) && n >= 1) {
      a.at = static_cast<uint32_t>(n);
    } else if (k == "--pool" && slidedp::hostd::ParseSize(v, &n)) {
      a.pool = n;
    } else if (k == "--checkpoints" && absl::SimpleAtoi(v, &n) && n >= 1 && n <= 100) {
      a.checkpoints = static_cast<uint32_t>(n);
    } else if (k == "--keep-pool" && (v == "on" || v == "off")) {
      a.keep_pool = v == "on";
    } else if (k == "--huge-pages" && (v == "on" || v == "off")) {
      a.huge_pages = v == "on";
    } else if (k == "--prepare" && (v == "on" || v == "off")) {
      a.prepare = v == "on";
    } else if (k == "--dir") {
      a.dir = v;
    } else if (k == "--out") {
      a.out = v;
    } else {
      return slidedp::hostd::Usage(("bad option or value: " + k + " " + v).c_str());
    }
  }
  if (a.at >= a.steps) return slidedp::hostd::Usage("--at must be below --steps");
  return slidedp::hostd::Run(a);
}
