// The C ABI over RankClient: statuses become codes plus a thread-local message; nothing throws
// across it.
#include "rankclient/slidedp_rank.h"

#include <cstring>
#include <exception>
#include <string>

#include "absl/strings/str_cat.h"
#include "hostd/manifest.h"
#include "rankclient/rank_client.h"

struct slidedp_rank {
  std::unique_ptr<slidedp::rankclient::RankClient> client;
};

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

}  // namespace

extern "C" {

int slidedp_rank_abi_version(void) { return SLIDEDP_RANK_ABI_VERSION; }

const char* slidedp_rank_last_error(void) { return last_error.c_str(); }

int slidedp_manifest_hash_from_hf_config(const char* config, char* out, size_t out_len) {
  return Guard([&] {
    if (config == nullptr || out == nullptr || out_len < 17) {
      return Fail(absl::StatusCode::kInvalidArgument,
                  "config and out must be non-null and out_len >= 17");
    }
    const std::string text(config);
    auto model = (text == "tiny" || text == "tiny-tied")
                     ? slidedp::hostd::LoadModel(text)
                     : slidedp::hostd::ManifestFromHfConfig(text, "config.json");
    if (!model.ok()) return Fail(model.status());
    const std::string hex =
        slidedp::hostd::ManifestHashHex(slidedp::hostd::ManifestHash(model->manifest));
    std::memcpy(out, hex.c_str(), hex.size() + 1);
    return Ok();
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
  if (layer >= h->client->num_layers()) {
    return Fail(absl::StatusCode::kNotFound,
                absl::StrCat("layer: ", layer, " does not exist; the model has ",
                             h->client->num_layers(), " layers"));
  }
  *numel = h->client->layer_numel(layer);
  return Ok();
}

int slidedp_rank_grad_dtype(const slidedp_rank* h, int* dtype) {
  SLIDEDP_CHECK_HANDLE(h);
  if (dtype == nullptr) return Fail(absl::StatusCode::kInvalidArgument, "dtype is null");
  *dtype = h->client->layout().grad_dtype() == slidedp::v1::DTYPE_FP32 ? SLIDEDP_DTYPE_FP32
                                                                       : SLIDEDP_DTYPE_BF16;
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

}  // extern "C"
