// The C ABI over RankClient: statuses become codes plus a thread-local message; nothing throws
// across it.
#include "rankclient/slidedp_rank.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/grad_clip.h"
#include "model/lr_schedule.h"
#include "model/manifest.h"
#include "nlohmann/json.hpp"
#include "rankclient/rank_client.h"
#ifdef SLIDEDP_RANK_WITH_GPU
#include <map>

#include "rankclient/gpu_plane.h"
#endif

struct slidedp_rank {
  std::unique_ptr<slidedp::rankclient::RankClient> client;
};

#ifdef SLIDEDP_RANK_WITH_GPU
struct slidedp_gpu_plane {
  std::unique_ptr<slidedp::rankclient::GpuDataPlane> plane;
  std::map<uint32_t, slidedp::rankclient::GpuDataPlane::Slot> held;  // by slot index
};
#else
struct slidedp_gpu_plane {};
#endif

// The C ABI's dtype integers are the shared-memory DType's values.
static_assert(SLIDEDP_DTYPE_FP32 == static_cast<int>(slidedp::shm::DType::kFp32));
static_assert(SLIDEDP_DTYPE_BF16 == static_cast<int>(slidedp::shm::DType::kBf16));

namespace {

thread_local std::string last_error;

int Fail(const absl::Status& s) {
  last_error = std::string(s.message());
  return static_cast<int>(s.code());
}

int Fail(absl::StatusCode code, std::string message) {
  last_error = std::move(message);
  return static_cast<int>(code);
}

int Ok() {
  last_error.clear();
  return 0;
}

template <typename Fn>
int Guard(Fn fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return Fail(absl::StatusCode::kInternal, absl::StrCat("internal error: ", e.what()));
  } catch (...) {
    return Fail(absl::StatusCode::kInternal, "internal error");
  }
}

std::chrono::milliseconds Ms(uint32_t ms) { return std::chrono::milliseconds(ms); }

// Copies `text` and a NUL into out; RESOURCE_EXHAUSTED naming the size needed.
int CopyOut(const std::string& text, char* out, size_t out_len, absl::string_view what) {
  if (text.size() + 1 > out_len) {
    return Fail(absl::StatusCode::kResourceExhausted,
                absl::StrCat("out_len: ", out_len, ", ", what, " needs ", text.size() + 1));
  }
  std::memcpy(out, text.c_str(), text.size() + 1);
  return Ok();
}

// The model of an HF config.json text, or of a built-in ("tiny", "tiny-tied").
absl::StatusOr<slidedp::model::LoadedModel> ModelOfConfig(const std::string& text) {
  return (text == "tiny" || text == "tiny-tied")
             ? slidedp::model::LoadModel(text)
             : slidedp::model::ManifestFromHfConfig(text, "config.json");
}

int CopyName(const std::string& src, char* dst, size_t dst_len) {
  if (dst == nullptr) return Ok();
  if (dst_len < src.size() + 1) {
    return Fail(absl::StatusCode::kOutOfRange, absl::StrCat("name_len: ", dst_len, ", the name '",
                                                            src, "' needs ", src.size() + 1));
  }
  std::memcpy(dst, src.c_str(), src.size() + 1);
  return Ok();
}
}  // namespace

extern "C" {

int slidedp_rank_abi_version(void) { return SLIDEDP_RANK_ABI_VERSION; }

const char* slidedp_rank_last_error(void) { return last_error.c_str(); }

int slidedp_clip_scale(double grad_norm, double max_grad_norm, int* skip, double* scale) {
  if (skip == nullptr || scale == nullptr) {
    return Fail(absl::StatusCode::kInvalidArgument, "skip and scale must be non-null");
  }
  if (std::isfinite(grad_norm) && grad_norm < 0) {
    return Fail(absl::StatusCode::kInvalidArgument,
                absl::StrCat("grad_norm: expected a norm >= 0 (or NaN/Inf for a non-finite "
                             "gradient), got ",
                             grad_norm));
  }
  const slidedp::kernels::ClipDecision d = slidedp::kernels::DecideClip(grad_norm, max_grad_norm);
  *skip = d.skip ? 1 : 0;
  *scale = d.scale;
  return Ok();
}

int slidedp_manifest_hash_from_hf_config(const char* config, char* out, size_t out_len) {
  return Guard([&] {
    if (config == nullptr || out == nullptr || out_len < 17) {
      return Fail(absl::StatusCode::kInvalidArgument,
                  "config and out must be non-null and out_len >= 17");
    }
    auto model = ModelOfConfig(config);
    if (!model.ok()) return Fail(model.status());
    const std::string hex =
        slidedp::model::ManifestHashHex(slidedp::model::ManifestHash(model->manifest));
    std::memcpy(out, hex.c_str(), hex.size() + 1);
    return Ok();
  });
}

int slidedp_manifest_layers_from_hf_config(const char* config, char* out, size_t out_len) {
  return Guard([&] {
    if (config == nullptr || out == nullptr) {
      return Fail(absl::StatusCode::kInvalidArgument, "config and out must be non-null");
    }
    auto model = ModelOfConfig(config);
    if (!model.ok()) return Fail(model.status());
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& l : model->manifest.layers()) {
      layers.push_back({{"name", l.name()}, {"kind", slidedp::v1::LayerKind_Name(l.kind())}});
    }
    return CopyOut(layers.dump(), out, out_len, "the layer list");
  });
}

int slidedp_rank_attach(const slidedp_rank_options* o, slidedp_rank** out) {
  return Guard([&] {
    if (o == nullptr || out == nullptr) {
      return Fail(absl::StatusCode::kInvalidArgument, "options and out must be non-null");
    }
    if (o->abi_version != SLIDEDP_RANK_ABI_VERSION) {
      return Fail(absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("abi_version: the caller was built for ", o->abi_version,
                               ", this library implements ", SLIDEDP_RANK_ABI_VERSION));
    }
    if (o->socket == nullptr || o->socket[0] == '\0') {
      return Fail(absl::StatusCode::kInvalidArgument, "socket: expected hostd's socket path");
    }
    slidedp::rankclient::RankClient::Options opts;
    opts.socket = o->socket;
    opts.job_id = o->job_id != nullptr ? o->job_id : "";
    opts.rank = o->rank;
    opts.manifest_hash = o->manifest_hash != nullptr ? o->manifest_hash : "";
    opts.gpu = o->gpu;
    opts.timeout_ms = o->timeout_ms != 0 ? o->timeout_ms : 30000;
    if (o->num_client_updated_layers > 0 && o->client_updated_layers == nullptr) {
      return Fail(absl::StatusCode::kInvalidArgument,
                  "client_updated_layers: null with num_client_updated_layers > 0");
    }
    opts.client_updated_layers.assign(o->client_updated_layers,
                                      o->client_updated_layers + o->num_client_updated_layers);
    auto client = slidedp::rankclient::RankClient::Attach(opts);
    if (!client.ok()) return Fail(client.status());
    *out = new slidedp_rank{std::move(*client)};
    return Ok();
  });
}

int slidedp_rank_detach(slidedp_rank* h) {
  return Guard([&] {
    if (h == nullptr) return Ok();
    absl::Status s = h->client->Detach();
    delete h;
    return s.ok() ? Ok() : Fail(s);
  });
}

#define SLIDEDP_CHECK_HANDLE(h) \
  if ((h) == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "handle is null")

int slidedp_rank_num_layers(const slidedp_rank* h, uint32_t* out) {
  SLIDEDP_CHECK_HANDLE(h);
  if (out == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "out is null");
  *out = h->client->num_layers();
  return Ok();
}

int slidedp_rank_world_size(const slidedp_rank* h, uint32_t* out) {
  SLIDEDP_CHECK_HANDLE(h);
  if (out == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "out is null");
  *out = h->client->world_size();
  return Ok();
}

int slidedp_rank_layer_numel(const slidedp_rank* h, uint32_t layer, uint64_t* numel) {
  SLIDEDP_CHECK_HANDLE(h);
  if (numel == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "numel is null");
  if (absl::Status s = h->client->CheckLayer(layer); !s.ok()) return Fail(s);
  *numel = h->client->layer_numel(layer);
  return Ok();
}

int slidedp_rank_layer_info(const slidedp_rank* h, uint32_t layer, char* name, size_t name_len,
                            uint32_t* num_tensors) {
  SLIDEDP_CHECK_HANDLE(h);
  return Guard([&] {
    if (absl::Status s = h->client->CheckLayer(layer); !s.ok()) return Fail(s);
    const auto& ll = h->client->layout().layers(static_cast<int>(layer));
    if (num_tensors != nullptr) *num_tensors = static_cast<uint32_t>(ll.tensors_size());
    return CopyName(ll.name(), name, name_len);
  });
}

int slidedp_rank_layer_tensor(const slidedp_rank* h, uint32_t layer, uint32_t index, char* name,
                              size_t name_len, uint64_t* offset_elements, uint64_t* numel,
                              int64_t* shape, uint32_t max_dims, uint32_t* ndims) {
  SLIDEDP_CHECK_HANDLE(h);
  return Guard([&] {
    if (absl::Status s = h->client->CheckLayer(layer); !s.ok()) return Fail(s);
    const auto& ll = h->client->layout().layers(static_cast<int>(layer));
    if (index >= static_cast<uint32_t>(ll.tensors_size())) {
      return Fail(absl::StatusCode::kNotFound,
                  absl::StrCat("index: layer ", layer, " has ", ll.tensors_size(), " tensors, got ",
                               index));
    }
    const auto& t = ll.tensors(static_cast<int>(index));
    if (shape != nullptr && max_dims < static_cast<uint32_t>(t.shape_size())) {
      return Fail(absl::StatusCode::kOutOfRange,
                  absl::StrCat("max_dims: ", max_dims, ", tensor '", t.name(), "' has ",
                               t.shape_size(), " dimensions"));
    }
    if (offset_elements != nullptr) *offset_elements = t.offset_elements();
    if (numel != nullptr) *numel = t.numel();
    if (ndims != nullptr) *ndims = static_cast<uint32_t>(t.shape_size());
    if (shape != nullptr) {
      for (int d = 0; d < t.shape_size(); ++d) shape[d] = t.shape(d);
    }
    return CopyName(t.name(), name, name_len);
  });
}

int slidedp_rank_grad_dtype(const slidedp_rank* h, int* dtype) {
  SLIDEDP_CHECK_HANDLE(h);
  if (dtype == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "dtype is null");
  *dtype = h->client->layout().grad_dtype() == slidedp::v1::DTYPE_FP32 ? SLIDEDP_DTYPE_FP32
                                                                       : SLIDEDP_DTYPE_BF16;
  return Ok();
}

int slidedp_rank_optimizer_json(const slidedp_rank* h, uint64_t step, char* out, size_t out_len) {
  SLIDEDP_CHECK_HANDLE(h);
  if (out == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "out is null");
  absl::StatusOr<slidedp::v1::JobStatus> st = h->client->JobStatus();
  if (!st.ok()) return Fail(st.status());
  const slidedp::v1::OptimizerConfig& o = st->optimizer();
  nlohmann::json j;
  j["lr"] = slidedp::model::LearningRate(o, step);
  j["beta1"] = o.beta1();
  j["beta2"] = o.beta2();
  j["eps"] = o.eps();
  j["weight_decay"] = o.weight_decay();
  j["no_decay_norms_and_biases"] = o.no_decay_norms_and_biases();
  j["clip"] = o.clip() == slidedp::v1::CLIP_POLICY_PER_LAYER ? "per_layer"
              : o.clip() == slidedp::v1::CLIP_POLICY_GLOBAL  ? "global"
                                                             : "none";
  j["max_grad_norm"] = o.max_grad_norm();
  j["scale_by_world_size"] = o.scale_by_world_size();
  j["steps_completed"] = st->step();
  nlohmann::json names = nlohmann::json::array();
  for (const auto& l : h->client->layout().layers()) {
    for (const auto& t : l.tensors()) {
      if (t.no_decay()) names.push_back(t.name());
    }
  }
  j["no_decay_tensors"] = std::move(names);
  return CopyOut(j.dump(), out, out_len, "the optimizer JSON");
}

int slidedp_rank_client_layer_view(const slidedp_rank* h, uint32_t layer, const void** ptr,
                                   uint64_t* bytes) {
  SLIDEDP_CHECK_HANDLE(h);
  if (ptr == nullptr || bytes == nullptr) {
    return Fail(absl::StatusCode::kInvalidArgument, "ptr and bytes must be non-null");
  }
  if (absl::Status s = h->client->CheckLayer(layer); !s.ok()) return Fail(s);
  if (!h->client->client_updated(layer)) {
    return Fail(absl::StatusCode::kFailedPrecondition,
                absl::StrCat("layer ", layer,
                             " is updated by hostd, so its parameters change "
                             "under a view; use slidedp_rank_fetch_params"));
  }
  *ptr = h->client->LayerParams(layer);
  *bytes = h->client->layer_numel(layer) * 2;
  return Ok();
}

int slidedp_rank_client_sync_step(const slidedp_rank* h, uint64_t* step) {
  SLIDEDP_CHECK_HANDLE(h);
  if (step == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "step is null");
  *step = h->client->client_sync_step();
  return Ok();
}

int slidedp_rank_client_layers_current(const slidedp_rank* h, int* current) {
  SLIDEDP_CHECK_HANDLE(h);
  if (current == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "current is null");
  *current = h->client->client_layers_current() ? 1 : 0;
  return Ok();
}

int slidedp_rank_upload_client_layer(slidedp_rank* h, uint64_t step, uint32_t layer, uint32_t part,
                                     uint64_t offset, const float* data, uint64_t count,
                                     int* all_complete) {
  SLIDEDP_CHECK_HANDLE(h);
  if (data == nullptr || count == 0) {
    return Fail(absl::StatusCode::kInvalidArgument, "data must be non-null and count > 0");
  }
  absl::StatusOr<bool> all = h->client->UploadClientLayer(step, layer, part, offset, data, count);
  if (!all.ok()) return Fail(all.status());
  if (all_complete != nullptr) *all_complete = *all ? 1 : 0;
  return Ok();
}

int slidedp_rank_read_client_layer(const slidedp_rank* h, uint32_t layer, uint32_t part,
                                   uint64_t offset, float* dst, uint64_t count, uint64_t* version) {
  SLIDEDP_CHECK_HANDLE(h);
  if (dst == nullptr || count == 0) {
    return Fail(absl::StatusCode::kInvalidArgument, "dst must be non-null and count > 0");
  }
  if (absl::Status s = h->client->ReadClientLayer(layer, part, offset, dst, count, version);
      !s.ok()) {
    return Fail(s);
  }
  return Ok();
}

int slidedp_rank_grad_route(const slidedp_rank* h, int* route) {
  SLIDEDP_CHECK_HANDLE(h);
  if (route == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "route is null");
  switch (h->client->layout().grad_route()) {
    case slidedp::v1::GRAD_ROUTE_GPU_REDUCTION:
      *route = 2;
      break;
    case slidedp::v1::GRAD_ROUTE_REDUCE_SCATTER:
      *route = 3;
      break;
    default:
      *route = 1;
  }
  return Ok();
}

int slidedp_rank_next_step(const slidedp_rank* h, uint64_t* step) {
  SLIDEDP_CHECK_HANDLE(h);
  if (step == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "step is null");
  *step = h->client->next_step_at_attach();
  return Ok();
}

int slidedp_rank_begin_step(slidedp_rank* h, uint64_t step, uint32_t timeout_ms) {
  SLIDEDP_CHECK_HANDLE(h);
  return Guard([&] {
    absl::Status s = h->client->BeginStep(step, Ms(timeout_ms));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_rank_fetch_params(slidedp_rank* h, uint32_t layer, uint64_t version, void* dst,
                              size_t dst_bytes, uint32_t timeout_ms, uint64_t* got_version) {
  SLIDEDP_CHECK_HANDLE(h);
  return Guard([&] {
    auto v = h->client->FetchParams(layer, version, dst, dst_bytes, Ms(timeout_ms));
    if (!v.ok()) return Fail(v.status());
    if (got_version != nullptr) *got_version = *v;
    return Ok();
  });
}

int slidedp_rank_push_grad(slidedp_rank* h, uint64_t step, uint32_t layer, const void* grad,
                           int dtype, size_t bytes, uint32_t timeout_ms) {
  SLIDEDP_CHECK_HANDLE(h);
  return Guard([&] {
    absl::Status s = h->client->PushGrad(step, layer, grad, dtype, bytes, Ms(timeout_ms));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_rank_wait_step(slidedp_rank* h, uint64_t step, uint32_t timeout_ms) {
  SLIDEDP_CHECK_HANDLE(h);
  return Guard([&] {
    absl::Status s = h->client->WaitStep(step, Ms(timeout_ms));
    return s.ok() ? Ok() : Fail(s);
  });
}

#ifdef SLIDEDP_RANK_WITH_GPU
#define SLIDEDP_CHECK_PLANE(p) \
  if ((p) == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "plane handle is null")

int slidedp_rank_has_gpu(void) { return 1; }

int slidedp_gpu_plane_create(slidedp_rank* h, const slidedp_gpu_plane_options* o,
                             slidedp_gpu_plane** out) {
  SLIDEDP_CHECK_HANDLE(h);
  return Guard([&] {
    if (o == nullptr || out == nullptr) {
      return Fail(absl::StatusCode::kInvalidArgument, "options and out must be non-null");
    }
    if (o->abi_version != SLIDEDP_RANK_ABI_VERSION) {
      return Fail(absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("abi_version: the caller was built for ", o->abi_version,
                               ", this library is ", SLIDEDP_RANK_ABI_VERSION));
    }
    if (o->param_route < 0 || o->param_route > 2) {
      return Fail(absl::StatusCode::kInvalidArgument,
                  absl::StrCat("param_route: ", o->param_route,
                               ", expected 0 or 1 (replicated) or 2 (sharded)"));
    }
    slidedp::rankclient::GpuDataPlane::Options po;
    po.device = o->device;
    if (o->window_slots != 0) po.window_slots = o->window_slots;
    po.prefetch_depth = std::min<uint32_t>(po.prefetch_depth, po.window_slots - 1);
    if (o->h2d_chunk_bytes != 0) po.h2d_chunk_bytes = o->h2d_chunk_bytes;
    po.param_route = o->param_route == 2 ? slidedp::v1::PARAM_ROUTE_SHARDED
                                         : slidedp::v1::PARAM_ROUTE_REPLICATED;
    po.reduce_in_fp32 = o->reduce_in_fp32 != 0;
    po.comm = static_cast<ncclComm_t>(o->nccl_comm);
    if (o->staging_buffers != 0) po.staging_buffers = o->staging_buffers;
    auto plane = slidedp::rankclient::GpuDataPlane::Create(h->client.get(), po);
    if (!plane.ok()) return Fail(plane.status());
    auto* p = new slidedp_gpu_plane;
    p->plane = std::move(*plane);
    *out = p;
    return Ok();
  });
}

int slidedp_gpu_plane_destroy(slidedp_gpu_plane* p) {
  return Guard([&] {
    delete p;
    return Ok();
  });
}

int slidedp_gpu_begin_step(slidedp_gpu_plane* p, uint64_t step, uint32_t timeout_ms) {
  SLIDEDP_CHECK_PLANE(p);
  return Guard([&] {
    absl::Status s = p->plane->BeginStep(step, Ms(timeout_ms));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_gpu_fetch(slidedp_gpu_plane* p, uint32_t layer, uint64_t version, uint32_t timeout_ms,
                      uint32_t* slot, void** data, uint64_t* numel) {
  SLIDEDP_CHECK_PLANE(p);
  return Guard([&] {
    if (slot == nullptr || data == nullptr) {
      return Fail(absl::StatusCode::kInvalidArgument, "slot and data must be non-null");
    }
    auto s = p->plane->Fetch(layer, version, Ms(timeout_ms));
    if (!s.ok()) return Fail(s.status());
    p->held[s->index] = *s;
    *slot = s->index;
    *data = s->data;
    if (numel != nullptr) *numel = s->numel;
    return Ok();
  });
}

int slidedp_gpu_wait_slot(slidedp_gpu_plane* p, uint32_t slot, void* stream) {
  SLIDEDP_CHECK_PLANE(p);
  return Guard([&] {
    auto it = p->held.find(slot);
    if (it == p->held.end()) {
      return Fail(absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("slot: ", slot, " is not held (fetch first)"));
    }
    absl::Status s = p->plane->WaitSlot(it->second, static_cast<cudaStream_t>(stream));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_gpu_release_slot(slidedp_gpu_plane* p, uint32_t slot, void* stream) {
  SLIDEDP_CHECK_PLANE(p);
  return Guard([&] {
    auto it = p->held.find(slot);
    if (it == p->held.end()) {
      return Fail(absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("slot: ", slot, " is not held (fetch first)"));
    }
    const slidedp::rankclient::GpuDataPlane::Slot held = it->second;
    p->held.erase(it);
    absl::Status s = p->plane->ReleaseSlot(held, static_cast<cudaStream_t>(stream));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_gpu_push_grad(slidedp_gpu_plane* p, uint64_t step, uint32_t layer, const void* grad,
                          int dtype, void* stream, uint32_t timeout_ms) {
  SLIDEDP_CHECK_PLANE(p);
  return Guard([&] {
    absl::Status s = p->plane->PushGrad(step, layer, grad, dtype, static_cast<cudaStream_t>(stream),
                                        Ms(timeout_ms));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_gpu_wait_grad_consumed(slidedp_gpu_plane* p, uint32_t layer, void* stream) {
  SLIDEDP_CHECK_PLANE(p);
  return Guard([&] {
    absl::Status s = p->plane->WaitGradConsumed(layer, static_cast<cudaStream_t>(stream));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_gpu_wait_pushes(slidedp_gpu_plane* p, uint32_t timeout_ms) {
  SLIDEDP_CHECK_PLANE(p);
  return Guard([&] {
    absl::Status s = p->plane->WaitPushes(Ms(timeout_ms));
    return s.ok() ? Ok() : Fail(s);
  });
}

int slidedp_gpu_stats(const slidedp_gpu_plane* p, slidedp_gpu_plane_stats* out) {
  SLIDEDP_CHECK_PLANE(p);
  if (out == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "out is null");
  const slidedp::rankclient::GpuDataPlane::Stats s = p->plane->stats();
  out->h2d_bytes = s.h2d_bytes;
  out->d2h_bytes = s.d2h_bytes;
  out->chunks_pushed = s.chunks_pushed;
  out->layers_fetched = s.layers_fetched;
  out->register_seconds = s.register_seconds;
  out->nccl_init_seconds = s.nccl_init_seconds;
  out->copier_wait_seconds = s.copier_wait_seconds;
  out->window_slots = p->plane->window_slots();
  out->slot_elems = p->plane->slot_elems();
  return Ok();
}

#else  // !SLIDEDP_RANK_WITH_GPU

namespace {
int NoGpu() {
  return Fail(absl::StatusCode::kUnimplemented,
              "this libslidedp_rank was built without CUDA (SLIDEDP_CUDA=OFF)");
}
}  // namespace

int slidedp_rank_has_gpu(void) { return 0; }
int slidedp_gpu_plane_create(slidedp_rank*, const slidedp_gpu_plane_options*, slidedp_gpu_plane**) {
  return NoGpu();
}
int slidedp_gpu_plane_destroy(slidedp_gpu_plane*) { return NoGpu(); }
int slidedp_gpu_begin_step(slidedp_gpu_plane*, uint64_t, uint32_t) { return NoGpu(); }
int slidedp_gpu_fetch(slidedp_gpu_plane*, uint32_t, uint64_t, uint32_t, uint32_t*, void**,
                      uint64_t*) {
  return NoGpu();
}
int slidedp_gpu_wait_slot(slidedp_gpu_plane*, uint32_t, void*) { return NoGpu(); }
int slidedp_gpu_release_slot(slidedp_gpu_plane*, uint32_t, void*) { return NoGpu(); }
int slidedp_gpu_push_grad(slidedp_gpu_plane*, uint64_t, uint32_t, const void*, int, void*,
                          uint32_t) {
  return NoGpu();
}
int slidedp_gpu_wait_grad_consumed(slidedp_gpu_plane*, uint32_t, void*) { return NoGpu(); }
int slidedp_gpu_wait_pushes(slidedp_gpu_plane*, uint32_t) { return NoGpu(); }
int slidedp_gpu_stats(const slidedp_gpu_plane*, slidedp_gpu_plane_stats*) { return NoGpu(); }
#endif

}  // extern "C"
