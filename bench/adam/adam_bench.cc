// adam_bench: throughput of the fused AdamW + BF16-cast kernel against the memory bandwidth of the
// same machine, per layer size and thread count. Writes JSON to stdout and --out; progress and a
// table go to stderr.
//
//   adam_bench [--sizes 100M,200M,400M,800M] [--threads 1,2,4,...] [--isa avx512bf16]
//              [--reps 5] [--warmup 1] [--max-seconds S] [--quick] [--no-hugepages] [--out FILE]
//
// Figures, per (size, threads), their repetitions interleaved round by round:
//   adamw_bf16grad   fused update, BF16 grads, BF16 params out: 28 B/param (grad 2, master/m/v
//                    read + write 24, out 2)
//   adamw_fp32grad   the same with FP32 grads: 32 B/param
//   grad_stats_bf16  ComputeGradStats over the BF16 grads: 2 B/param
//   triad            STREAM triad a = b + s*c over FP32 arrays as large together as the update's
//                    arrays (16 B/param), counted STREAM's way at 24 B/elem, plain stores
//   triad_nt         the same with streaming stores
//   rmw              a = s*a in place over the triad's `a`, 8 B/elem: the read-modify-write stream
//                    that bounds any in-place update such as master/m/v
// Pages are huge (madvise) unless --no-hugepages, first touched in parallel with the kernels'
// split.
// --max-seconds caps the time spent on one (size, threads) point at S per figure, warm-up
// included: rounds stop early once it is exceeded and at least 3 were timed; the report gives the
// number of repetitions actually run.

#include <sched.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/adam/json_writer.h"
#include "bench/adam/triad.h"
#include "common/mapping.h"
#include "common/thread_pool.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"

namespace slidedp::bench {
namespace {

using kernels::GradType;
using kernels::Isa;

constexpr double kBytesBf16Grad = 28;
constexpr double kBytesFp32Grad = 32;
constexpr double kBytesStats = 2;
constexpr double kBytesTriad = 24;
constexpr double kBytesRmw = 8;
// Ranges of every ParallelFor start at multiples of this (cache lines for every array, and the
// statistics block).
constexpr size_t kAlign = kernels::kStatsBlock;

// ---- Command line.

struct Options {
  std::vector<size_t> sizes = {100'000'000, 200'000'000, 400'000'000, 800'000'000};
  std::vector<int> threads;  // default: 1, 2, 4, ... up to all physical cores
  std::optional<Isa> isa;
  int reps = 5;
  int warmup = 1;
  double max_seconds = 0;  // per figure; 0 = no cap
  bool quick = false;
  bool hugepages = true;
  std::string out;
  std::string command;
};

void Usage() {
  std::fprintf(stderr,
               "usage: adam_bench [--sizes LIST] [--threads LIST] [--isa NAME] [--reps N]\n"
               "                  [--warmup N] [--max-seconds S] [--quick] [--no-hugepages]\n"
               "                  [--out FILE]\n"
               "  LIST: comma-separated; sizes accept K/M/G suffixes (powers of 1000)\n"
               "  NAME: scalar, avx2, avx512, avx512bf16 (default: best supported)\n");
}

std::optional<size_t> ParseCount(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  double scale = 1;
  const std::string suffix(end);
  if (suffix == "K" || suffix == "k") {
    scale = 1e3;
  } else if (suffix == "M" || suffix == "m") {
    scale = 1e6;
  } else if (suffix == "G" || suffix == "g") {
    scale = 1e9;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  if (!(value >= 0)) return std::nullopt;
  return static_cast<size_t>(value * scale);
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) absl::StrAppend(&o.command, i == 0 ? "" : " ", argv[i]);
  bool sizes_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    const size_t eq = arg.find('=');
    const auto next = [&]() -> absl::StatusOr<std::string> {
      if (eq != std::string::npos) return arg.substr(eq + 1);
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
      return std::string(argv[++i]);
    };
    if (eq != std::string::npos) arg = arg.substr(0, eq);
    if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--no-hugepages") {
      o.hugepages = false;
    } else if (arg == "--help" || arg == "-h") {
      Usage();
      std::exit(0);
    } else if (arg == "--sizes" || arg == "--threads" || arg == "--isa" || arg == "--reps" ||
               arg == "--warmup" || arg == "--max-seconds" || arg == "--out") {
      absl::StatusOr<std::string> v = next();
      if (!v.ok()) return v.status();
      value = *v;
      if (arg == "--sizes") {
        o.sizes.clear();
        for (const std::string& p : Split(value)) {
          const std::optional<size_t> n = ParseCount(p);
          if (!n || *n == 0) {
            return absl::InvalidArgumentError(
                absl::StrCat("--sizes: '", p, "' is not a positive count (e.g. 100M)"));
          }
          o.sizes.push_back(*n);
        }
        sizes_given = true;
      } else if (arg == "--threads") {
        o.threads.clear();
        for (const std::string& p : Split(value)) {
          const int t = std::atoi(p.c_str());
          if (t < 1) {
            return absl::InvalidArgumentError(absl::StrCat("--threads: '", p, "' must be >= 1"));
          }
          o.threads.push_back(t);
        }
      } else if (arg == "--isa") {
        o.isa = kernels::ParseIsa(value);
        if (!o.isa) {
          return absl::InvalidArgumentError(
              absl::StrCat("--isa: '", value, "' is not one of scalar, avx2, avx512, avx512bf16"));
        }
      } else if (arg == "--reps") {
        o.reps = std::atoi(value.c_str());
        if (o.reps < 1) return absl::InvalidArgumentError("--reps must be >= 1");
      } else if (arg == "--warmup") {
        o.warmup = std::atoi(value.c_str());
        if (o.warmup < 0) return absl::InvalidArgumentError("--warmup must be >= 0");
      } else if (arg == "--max-seconds") {
        o.max_seconds = std::atof(value.c_str());
        if (!(o.max_seconds >= 0)) return absl::InvalidArgumentError("--max-seconds must be >= 0");
      } else {
        o.out = value;
      }
    } else {
      Usage();
      return absl::InvalidArgumentError(absl::StrCat("unknown argument '", argv[i], "'"));
    }
  }
  if (o.quick && !sizes_given) o.sizes = {1'000'000, 3'000'017};
  return o;
}

// ---- Machine.

struct Machine {
  std::string cpu_model;
  std::string kernel;
  std::vector<int> cpus;  // allowed CPUs, one per physical core first, then their siblings
  int physical_cores = 0;
  int numa_nodes = 1;
};

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

Machine DetectMachine() {
  Machine m;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) m.cpu_model = line.substr(colon + 2);
      break;
    }
  }
  utsname u;
  if (uname(&u) == 0) m.kernel = absl::StrCat(u.sysname, " ", u.release);

  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  sched_getaffinity(0, sizeof(allowed), &allowed);
  // Rank each CPU among the hardware threads of its core (0 = first), so that the first N
  // threads of a run land on N distinct cores.
  std::map<std::pair<std::string, std::string>, int> seen_cores;
  std::vector<std::pair<int, int>> ranked;  // (rank, cpu)
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    const std::string topo = absl::StrCat("/sys/devices/system/cpu/cpu", cpu, "/topology/");
    const auto key = std::make_pair(ReadFirstLine(topo + "physical_package_id"),
                                    ReadFirstLine(topo + "core_id"));
    const int rank = key.second.empty() ? 0 : seen_cores[key]++;
    ranked.emplace_back(rank, cpu);
  }
  std::sort(ranked.begin(), ranked.end());
  for (const auto& [rank, cpu] : ranked) {
    m.cpus.push_back(cpu);
    if (rank == 0) ++m.physical_cores;
  }
  int nodes = 0;
  while (access(absl::StrCat("/sys/devices/system/node/node", nodes).c_str(), F_OK) == 0) ++nodes;
  m.numa_nodes = std::max(nodes, 1);
  return m;
}

// ---- Memory.

// An anonymous mapping aligned to a huge page, optionally backed by transparent huge pages.
// Move-only owner.
class HostArray {
 public:
  static absl::StatusOr<HostArray> Create(size_t bytes, bool hugepages) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t size = (std::max<size_t>(bytes, 1) + kHuge - 1) / kHuge * kHuge;
    // Over-allocate by one huge page so the start can be aligned to it.
    absl::StatusOr<Mapping> raw = Mapping::Anonymous(size + kHuge, "host array");
    if (!raw.ok()) return absl::ResourceExhaustedError(raw.status().message());
    const uintptr_t base = reinterpret_cast<uintptr_t>(raw->data());
    const uintptr_t aligned = (base + kHuge - 1) / kHuge * kHuge;
    if (hugepages) madvise(reinterpret_cast<void*>(aligned), size, MADV_HUGEPAGE);
    return HostArray(std::move(*raw), reinterpret_cast<void*>(aligned));
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  HostArray(Mapping raw, void* data) : raw_(std::move(raw)), data_(data) {}
  Mapping raw_;
  void* data_;
};

// Deterministic pseudo-random values by index (splitmix64), so the fill is independent of the
// thread split.
inline uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline float Uniform(uint64_t i, uint64_t stream) {  // [-1, 1)
  return static_cast<float>(static_cast<int64_t>(Mix(i * 8 + stream)) >> 40) * 0x1p-23f;
}

// Every array of one size: the update's, and the triad's.
struct Arrays {
  HostArray grad16, grad32, master, m, v, out, triad_a, triad_b, triad_c;
  size_t n = 0;
  size_t triad_n = 0;

  static absl::StatusOr<Arrays> Create(size_t n, size_t triad_n, bool hugepages) {
    std::vector<HostArray> h;
    for (size_t bytes :
         {n * 2, n * 4, n * 4, n * 4, n * 4, n * 2, triad_n * 4, triad_n * 4, triad_n * 4}) {
      absl::StatusOr<HostArray> a = HostArray::Create(bytes, hugepages);
      if (!a.ok()) return a.status();
      h.push_back(std::move(*a));
    }
    return Arrays{
        std::move(h[0]), std::move(h[1]), std::move(h[2]), std::move(h[3]), std::move(h[4]),
        std::move(h[5]), std::move(h[6]), std::move(h[7]), std::move(h[8]), n,
        triad_n};
  }

  // Fills every array with the split the kernels use, so each page is first touched (and placed)
  // by the thread that later works on it.
  void FirstTouch(ThreadPool& pool) {
    pool.ParallelFor(n, kAlign, [&](size_t begin, size_t end, int) {
      for (size_t i = begin; i < end; ++i) {
        const float g = Uniform(i, 0) * 1e-3f;
        grad32.as<float>()[i] = g;
        grad16.as<uint16_t>()[i] = kernels::RoundToBf16(g);
        master.as<float>()[i] = Uniform(i, 1) * 0.05f;
        m.as<float>()[i] = Uniform(i, 2) * 1e-4f;
        v.as<float>()[i] = std::abs(Uniform(i, 3)) * 1e-7f;
        out.as<uint16_t>()[i] = 0;
      }
    });
    pool.ParallelFor(triad_n, kAlign, [&](size_t begin, size_t end, int) {
      for (size_t i = begin; i < end; ++i) {
        triad_a.as<float>()[i] = 1.0f;
        triad_b.as<float>()[i] = 1.0f;
        triad_c.as<float>()[i] = 2.0f;
      }
    });
  }
};

// ---- Timing.

struct Figure {
  std::vector<double> seconds;  // per repetition
  double bytes = 0;             // per repetition, as counted
  double params = 0;            // elements per repetition

  double Median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    const size_t k = s.size();
    return k % 2 == 1 ? s[k / 2] : 0.5 * (s[k / 2 - 1] + s[k / 2]);
  }
  double Best() const { return *std::min_element(seconds.begin(), seconds.end()); }
};

constexpr int kMinRepsUnderCap = 3;

struct FigureSpec {
  Figure* figure;
  double params;
  double bytes_per_param;
  std::function<void()> run;
};

// Repetitions of all figures are interleaved (one of each per round), so that a slow drift of the
// machine (other tenants, frequency) affects the figures alike and their ratios stay meaningful.
void MeasureInterleaved(const Options& o, const std::vector<FigureSpec>& specs) {
  const auto first = std::chrono::steady_clock::now();
  for (int i = 0; i < o.warmup; ++i) {
    for (const FigureSpec& spec : specs) spec.run();
  }
  for (const FigureSpec& spec : specs) {
    *spec.figure = Figure();
    spec.figure->params = spec.params;
    spec.figure->bytes = spec.params * spec.bytes_per_param;
  }
  const double cap = o.max_seconds * static_cast<double>(specs.size());
  for (int i = 0; i < o.reps; ++i) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - first).count();
    if (o.max_seconds > 0 && i >= kMinRepsUnderCap && elapsed >= cap) break;
    for (const FigureSpec& spec : specs) {
      const auto start = std::chrono::steady_clock::now();
      spec.run();
      const auto stop = std::chrono::steady_clock::now();
      spec.figure->seconds.push_back(std::chrono::duration<double>(stop - start).count());
    }
  }
}

void WriteFigure(JsonWriter& j, std::string_view name, const Figure& f, const std::string& unit) {
  j.Key(name).BeginObject();
  j.Field("reps", static_cast<int64_t>(f.seconds.size()));
  j.Field("elements", static_cast<int64_t>(f.params));
  j.Field("bytes_per_rep", f.bytes);
  j.Field("median_s", f.Median());
  j.Field("best_s", f.Best());
  j.Field(absl::StrCat("median_g", unit, "_per_s"), f.params / f.Median() * 1e-9);
  j.Field(absl::StrCat("best_g", unit, "_per_s"), f.params / f.Best() * 1e-9);
  j.Field("median_gb_per_s", f.bytes / f.Median() * 1e-9);
  j.Field("best_gb_per_s", f.bytes / f.Best() * 1e-9);
  j.Key("all_s").BeginArray();
  for (double s : f.seconds) j.Number(s);
  j.EndArray();
  j.EndObject();
}

struct Result {
  size_t size = 0;
  int threads = 0;
  Figure adamw_bf16grad, adamw_fp32grad, grad_stats_bf16, triad, triad_nt, rmw;
};

double GbPerS(const Figure& f) { return f.bytes / f.Median() * 1e-9; }

absl::Status Run(const Options& options) {
  const Machine machine = DetectMachine();
  const Isa best = kernels::BestIsa();
  const Isa isa = options.isa.value_or(best);
  if (!kernels::IsaSupported(isa)) {
    return absl::FailedPreconditionError(absl::StrCat("--isa ", std::string(kernels::IsaName(isa)),
                                                      " is not supported on this CPU"));
  }
  std::vector<int> thread_counts = options.threads;
  if (thread_counts.empty()) {
    const int all = std::max(machine.physical_cores, 1);
    for (int t = 1; t < all; t *= 2) thread_counts.push_back(t);
    thread_counts.push_back(all);
    if (options.quick) thread_counts = {1, all};
    std::sort(thread_counts.begin(), thread_counts.end());
    thread_counts.erase(std::unique(thread_counts.begin(), thread_counts.end()),
                        thread_counts.end());
  }

  std::map<int, std::unique_ptr<ThreadPool>> pools;
  for (int t : thread_counts) {
    ThreadPool::Options po;
    po.num_threads = t;
    po.name = "adam-bench";
    if (static_cast<size_t>(t) <= machine.cpus.size()) {
      po.cpus.assign(machine.cpus.begin(), machine.cpus.begin() + t);
    }
    absl::StatusOr<std::unique_ptr<ThreadPool>> pool = ThreadPool::Create(po);
    if (!pool.ok()) return pool.status();
    pools[t] = std::move(*pool);
  }
  const int max_threads = thread_counts.back();
  // On one NUMA node page placement does not depend on who touched a page, so arrays are touched
  // once per size by the largest pool; on several nodes, once per (size, threads) by that pool.
  const bool touch_per_thread_count = machine.numa_nodes > 1;

  std::fprintf(stderr, "adam_bench: %s, %d cores (%zu cpus), %d NUMA node(s), isa %s\n",
               machine.cpu_model.c_str(), machine.physical_cores, machine.cpus.size(),
               machine.numa_nodes, std::string(kernels::IsaName(isa)).c_str());

  std::vector<Result> results;
  for (size_t n : options.sizes) {
    // Triad arrays with the memory footprint of the update's arrays (16 bytes per parameter:
    // BF16 grad, master, m, v, BF16 out), far beyond any cache at the sizes of interest.
    const size_t triad_n = n * 16 / 12;
    std::optional<Arrays> arrays;
    const auto prepare = [&](ThreadPool& pool) -> absl::Status {
      arrays.reset();
      absl::StatusOr<Arrays> a = Arrays::Create(n, triad_n, options.hugepages);
      if (!a.ok()) return a.status();
      arrays.emplace(std::move(*a));
      arrays->FirstTouch(pool);
      return absl::OkStatus();
    };
    if (!touch_per_thread_count) {
      if (absl::Status s = prepare(*pools[max_threads]); !s.ok()) return s;
    }
    for (int t : thread_counts) {
      ThreadPool& pool = *pools[t];
      if (touch_per_thread_count) {
        if (absl::Status s = prepare(pool); !s.ok()) return s;
      }
      Arrays& a = *arrays;
      Result r;
      r.size = n;
      r.threads = t;
      uint64_t step = 1;
      const auto update = [&](GradType type) {
        const kernels::AdamWScalars s =
            kernels::MakeAdamWScalars(1e-4, 0.9, 0.999, 1e-8, 0.01, 1.0, step++);
        const void* grad = type == GradType::kBf16 ? a.grad16.as<void>() : a.grad32.as<void>();
        const size_t grad_bytes = kernels::GradTypeBytes(type);
        pool.ParallelFor(n, kAlign, [&](size_t begin, size_t end, int) {
          kernels::AdamWUpdate(isa, s, static_cast<const char*>(grad) + begin * grad_bytes, type,
                               a.master.as<float>() + begin, a.m.as<float>() + begin,
                               a.v.as<float>() + begin, a.out.as<uint16_t>() + begin, end - begin);
        });
      };
      std::vector<kernels::GradStats> partial(t);
      double checksum = 0;
      const auto stats = [&] {
        pool.ParallelFor(n, kAlign, [&](size_t begin, size_t end, int thread) {
          partial[thread] = kernels::ComputeGradStats(isa, a.grad16.as<uint16_t>() + begin,
                                                      GradType::kBf16, end - begin);
        });
        kernels::GradStats total;
        for (const kernels::GradStats& p : partial) total = kernels::CombineGradStats(total, p);
        checksum += total.sum_squares;
      };
      const auto triad = [&](bool stream) {
        pool.ParallelFor(triad_n, kAlign, [&](size_t begin, size_t end, int) {
          Triad(isa, a.triad_a.as<float>() + begin, a.triad_b.as<float>() + begin,
                a.triad_c.as<float>() + begin, 3.0f, end - begin, stream);
        });
      };
      const auto rmw = [&] {
        pool.ParallelFor(triad_n, kAlign, [&](size_t begin, size_t end, int) {
          ScaleInPlace(isa, a.triad_a.as<float>() + begin, 0.5f, end - begin);
        });
      };
      const double params = static_cast<double>(n);
      const double elems = static_cast<double>(triad_n);
      MeasureInterleaved(
          options, {{&r.adamw_bf16grad, params, kBytesBf16Grad, [&] { update(GradType::kBf16); }},
                    {&r.adamw_fp32grad, params, kBytesFp32Grad, [&] { update(GradType::kFp32); }},
                    {&r.grad_stats_bf16, params, kBytesStats, stats},
                    {&r.triad, elems, kBytesTriad, [&] { triad(false); }},
                    {&r.triad_nt, elems, kBytesTriad, [&] { triad(true); }},
                    {&r.rmw, elems, kBytesRmw, rmw}});
      if (!(checksum > 0)) return absl::InternalError("gradient statistics returned nothing");
      std::fprintf(stderr,
                   "  size %zu threads %d: adamw bf16 %.2f Gparam/s %.1f GB/s, triad %.1f GB/s, "
                   "rmw %.1f GB/s (%zu reps)\n",
                   n, t, params / r.adamw_bf16grad.Median() * 1e-9, GbPerS(r.adamw_bf16grad),
                   GbPerS(r.triad), GbPerS(r.rmw), r.adamw_bf16grad.seconds.size());
      results.push_back(std::move(r));
    }
  }

  // Report.
  JsonWriter j;
  j.BeginObject();
  j.Field("benchmark", "adam_bench");
  j.Field("command", options.command);
  j.Key("machine").BeginObject();
  j.Field("cpu_model", machine.cpu_model);
  j.Field("kernel", machine.kernel);
  j.Field("physical_cores", machine.physical_cores);
  j.Field("logical_cpus", static_cast<int64_t>(machine.cpus.size()));
  j.Field("numa_nodes", machine.numa_nodes);
  j.Field("transparent_hugepage", ReadFirstLine("/sys/kernel/mm/transparent_hugepage/enabled"));
  // Thread i of every pool is pinned to cpu_order[i] (one per physical core first).
  j.Key("cpu_order").BeginArray();
  for (int cpu : machine.cpus) j.Int(cpu);
  j.EndArray();
  j.Field("best_isa", kernels::IsaName(best));
  j.Key("isa_supported").BeginArray();
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (kernels::IsaSupported(i)) j.String(kernels::IsaName(i));
  }
  j.EndArray();
  j.EndObject();
  j.Key("config").BeginObject();
  j.Field("isa", kernels::IsaName(isa));
  j.Field("reps", options.reps);
  j.Field("warmup", options.warmup);
  j.Field("max_seconds_per_figure", options.max_seconds);
  j.Field("hugepages", options.hugepages);
  j.Field("first_touch", touch_per_thread_count ? "per size and thread count" : "per size");
  j.Key("bytes_per_param").BeginObject();
  j.Field("adamw_bf16grad", kBytesBf16Grad);
  j.Field("adamw_fp32grad", kBytesFp32Grad);
  j.Field("grad_stats_bf16", kBytesStats);
  j.Field("triad_per_element", kBytesTriad);
  j.Field("rmw_per_element", kBytesRmw);
  j.EndObject();
  j.EndObject();
  j.Key("results").BeginArray();
  for (const Result& r : results) {
    j.BeginObject();
    j.Field("size", static_cast<int64_t>(r.size));
    j.Field("threads", r.threads);
    WriteFigure(j, "adamw_bf16grad", r.adamw_bf16grad, "param");
    WriteFigure(j, "adamw_fp32grad", r.adamw_fp32grad, "param");
    WriteFigure(j, "grad_stats_bf16", r.grad_stats_bf16, "param");
    WriteFigure(j, "triad", r.triad, "elem");
    WriteFigure(j, "triad_nt", r.triad_nt, "elem");
    WriteFigure(j, "rmw", r.rmw, "elem");
    j.Field("ratio_adamw_bf16grad_to_triad", GbPerS(r.adamw_bf16grad) / GbPerS(r.triad));
    j.Field("ratio_adamw_bf16grad_to_triad_nt", GbPerS(r.adamw_bf16grad) / GbPerS(r.triad_nt));
    j.Field("ratio_adamw_bf16grad_to_rmw", GbPerS(r.adamw_bf16grad) / GbPerS(r.rmw));
    j.EndObject();
  }
  j.EndArray();
  j.EndObject();
  const std::string json = j.str() + "\n";

  std::fprintf(stderr, "\n%11s %4s %10s %10s %10s %10s %10s %10s %10s %9s %7s\n", "size", "thr",
               "bf16 Gp/s", "bf16 GB/s", "fp32 GB/s", "stats GB/s", "triad GB/s", "triad_nt",
               "rmw GB/s", "vs triad", "vs rmw");
  for (const Result& r : results) {
    std::fprintf(stderr, "%11zu %4d %10.3f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %9.3f %7.3f\n",
                 r.size, r.threads, r.size / r.adamw_bf16grad.Median() * 1e-9,
                 GbPerS(r.adamw_bf16grad), GbPerS(r.adamw_fp32grad), GbPerS(r.grad_stats_bf16),
                 GbPerS(r.triad), GbPerS(r.triad_nt), GbPerS(r.rmw),
                 GbPerS(r.adamw_bf16grad) / GbPerS(r.triad),
                 GbPerS(r.adamw_bf16grad) / GbPerS(r.rmw));
  }
  std::fputs(json.c_str(), stdout);
  if (!options.out.empty()) {
    std::ofstream out(options.out);
    out << json;
    if (!out) {
      return absl::PermissionDeniedError(absl::StrCat("cannot write --out ", options.out));
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace slidedp::bench

int main(int argc, char** argv) {
  absl::StatusOr<slidedp::bench::Options> options = slidedp::bench::ParseOptions(argc, argv);
  if (!options.ok()) {
    std::fprintf(stderr, "adam_bench: %s\n", options.status().ToString().c_str());
    return 2;
  }
  const absl::Status status = slidedp::bench::Run(*options);
  if (!status.ok()) {
    std::fprintf(stderr, "adam_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
