/* slidedp_rank.h — the C ABI of rankclient, for python_client (ctypes) and any language with a
 * C FFI. Versioned: SLIDEDP_RANK_ABI_VERSION changes on any incompatible change; check
 * slidedp_rank_abi_version() at load time.
 *
 * Every function returns a status code: 0 OK, otherwise the gRPC/absl code (3 INVALID_ARGUMENT,
 * 4 DEADLINE_EXCEEDED, 5 NOT_FOUND, 6 ALREADY_EXISTS, 9 FAILED_PRECONDITION, 10 ABORTED,
 * 11 OUT_OF_RANGE, 13 INTERNAL, 14 UNAVAILABLE, ...). slidedp_rank_last_error() returns the
 * message of the calling thread's last failure (valid until its next call). No function throws
 * or aborts on bad input. A handle is used by one thread at a time.
 *
 * A training step on this ABI:
 *   slidedp_rank_begin_step(h, t, ...);
 *   for l in forward order:  slidedp_rank_fetch_params(h, l, t - 1, buf, bytes, ...); compute
 *   for l in backward order: compute; slidedp_rank_push_grad(h, t, l, grad, dtype, bytes, ...)
 *   slidedp_rank_wait_step(h, t, ...)   (before the next step's forward or before detaching)
 */
#ifndef SLIDEDP_RANKCLIENT_SLIDEDP_RANK_H_
#define SLIDEDP_RANKCLIENT_SLIDEDP_RANK_H_

#include <stddef.h>
#include <stdint.h>

#define SLIDEDP_RANK_ABI_VERSION 2
#define SLIDEDP_RANK_EXPORT __attribute__((visibility("default")))
#define SLIDEDP_DTYPE_FP32 1
#define SLIDEDP_DTYPE_BF16 2

#ifdef __cplusplus
extern "C" {
#endif

typedef struct slidedp_rank slidedp_rank;

typedef struct slidedp_rank_options {
  uint32_t abi_version; /* SLIDEDP_RANK_ABI_VERSION */
  const char* socket;   /* hostd's unix socket path */
  const char* job_id;   /* NULL or "": hostd's job */
  uint32_t rank;
  const char* manifest_hash; /* 16 hex digits; see slidedp_manifest_hash_from_hf_config */
  int32_t gpu;               /* -1: CPU backend */
  uint32_t timeout_ms;       /* RPC timeout; 0: 30000 */
  /* Layers this rank keeps resident and updates itself (hostd never gets their gradients);
   * every rank must pass the same set. NULL/0: none. (ABI 2) */
  const uint32_t* client_updated_layers;
  uint32_t num_client_updated_layers;
} slidedp_rank_options;

SLIDEDP_RANK_EXPORT int slidedp_rank_abi_version(void);
SLIDEDP_RANK_EXPORT const char* slidedp_rank_last_error(void);

/* hostd's clip / skip rule (kernels/cpu/grad_clip.h), for the layers a rank updates itself.
 * grad_norm: the L2 norm of the gradient as applied (after any world-size scaling); NaN or Inf
 * for a gradient with a non-finite element. max_grad_norm: the threshold when the job's clip
 * policy clips the layer by itself ("per_layer"); <= 0 for no clipping. Writes *skip = 1 when
 * the update is to be skipped (non-finite norm; *scale = 1 then), else *skip = 0 and *scale =
 * min(1, max_grad_norm / (grad_norm + 1e-6)) (1 with clipping off). INVALID_ARGUMENT for a null
 * output or a negative finite grad_norm. Needs no handle. */
SLIDEDP_RANK_EXPORT int slidedp_clip_scale(double grad_norm, double max_grad_norm, int* skip,
                                           double* scale);

/* The manifest hash hostd computes for an HF config.json text ("tiny" and "tiny-tied" name the
 * built-ins). Writes 16 hex digits and a NUL into out (out_len >= 17). */
SLIDEDP_RANK_EXPORT int slidedp_manifest_hash_from_hf_config(const char* config_json_or_builtin,
                                                             char* out, size_t out_len);

/* The manifest's layers for an HF config.json text, in hostd's order (the layer index is the
 * position), as JSON: [{"name": "model.embed_tokens", "kind": "LAYER_KIND_EMBEDDING"}, ...]. */
SLIDEDP_RANK_EXPORT int slidedp_manifest_layers_from_hf_config(const char* config_json_or_builtin,
                                                               char* out, size_t out_len);

SLIDEDP_RANK_EXPORT int slidedp_rank_attach(const slidedp_rank_options* options,
                                            slidedp_rank** out);
/* Detaches and frees the handle (NULL is fine). */
SLIDEDP_RANK_EXPORT int slidedp_rank_detach(slidedp_rank* h);

SLIDEDP_RANK_EXPORT int slidedp_rank_num_layers(const slidedp_rank* h, uint32_t* out);
SLIDEDP_RANK_EXPORT int slidedp_rank_world_size(const slidedp_rank* h, uint32_t* out);
/* Elements of a layer and its BF16 parameter bytes. */
SLIDEDP_RANK_EXPORT int slidedp_rank_layer_numel(const slidedp_rank* h, uint32_t layer,
                                                 uint64_t* numel);
/* A layer's name (NUL-terminated into name, name_len bytes; OUT_OF_RANGE when too small) and its
 * number of tensors. */
SLIDEDP_RANK_EXPORT int slidedp_rank_layer_info(const slidedp_rank* h, uint32_t layer, char* name,
                                                size_t name_len, uint32_t* num_tensors);
/* Tensor `index` of a layer: its HF parameter name, where it starts in the layer's flat buffer
 * (elements), its element count and its shape (up to max_dims dims; *ndims = the tensor's rank,
 * OUT_OF_RANGE when max_dims is smaller). Any output pointer may be NULL. */
SLIDEDP_RANK_EXPORT int slidedp_rank_layer_tensor(const slidedp_rank* h, uint32_t layer,
                                                  uint32_t index, char* name, size_t name_len,
                                                  uint64_t* offset_elements, uint64_t* numel,
                                                  int64_t* shape, uint32_t max_dims,
                                                  uint32_t* ndims);
/* The job's gradient dtype (SLIDEDP_DTYPE_*). */
SLIDEDP_RANK_EXPORT int slidedp_rank_grad_dtype(const slidedp_rank* h, int* dtype);
/* The job's gradient route: 1 CPU reduction, 2 GPU reduction, 3 reduce-scatter. */
SLIDEDP_RANK_EXPORT int slidedp_rank_grad_route(const slidedp_rank* h, int* route);
/* The job's next step when this handle attached (1 for a fresh job): the first step to begin. */
SLIDEDP_RANK_EXPORT int slidedp_rank_next_step(const slidedp_rank* h, uint64_t* step);
/* hostd's optimizer for this job as JSON, for the layers a rank updates itself:
 * {"lr": LR of update `step` (schedule applied), "beta1", "beta2", "eps", "weight_decay",
 *  "no_decay_norms_and_biases", "no_decay_tensors": [names], "clip": "none"|"per_layer"|"global",
 *  "max_grad_norm", "scale_by_world_size", "steps_completed"}. One GetStatus RPC.
 * RESOURCE_EXHAUSTED when out_len is too small (the message gives the size needed). */
SLIDEDP_RANK_EXPORT int slidedp_rank_optimizer_json(const slidedp_rank* h, uint64_t step, char* out,
                                                    size_t out_len);

SLIDEDP_RANK_EXPORT int slidedp_rank_begin_step(slidedp_rank* h, uint64_t step,
                                                uint32_t timeout_ms);
/* Waits for `version` of `layer`, copies its BF16 parameters into dst (dst_bytes = numel * 2)
 * and writes the version copied to *got_version (may be NULL). */
SLIDEDP_RANK_EXPORT int slidedp_rank_fetch_params(slidedp_rank* h, uint32_t layer, uint64_t version,
                                                  void* dst, size_t dst_bytes, uint32_t timeout_ms,
                                                  uint64_t* got_version);
/* A read-only view of a client-updated layer's BF16 parameters in hostd's mapping (*bytes =
 * numel * 2), valid while the handle is attached. hostd writes those layers only when rank 0
 * uploads them (below), so the view is stable; for any other layer this is
 * FAILED_PRECONDITION (use slidedp_rank_fetch_params, which waits for a version). Lets a rank
 * load a resident layer without a host copy. */
SLIDEDP_RANK_EXPORT int slidedp_rank_client_layer_view(const slidedp_rank* h, uint32_t layer,
                                                       const void** ptr, uint64_t* bytes);
/* Client-updated layers in checkpoints and exports. *step = the version hostd asks rank 0 to
 * upload them at (a checkpoint of that step waits for them); 0: none. */
SLIDEDP_RANK_EXPORT int slidedp_rank_client_sync_step(const slidedp_rank* h, uint64_t* step);
/* *current = 1 when hostd's copy of the client-updated layers (master, m, v) was the job's
 * state when this handle attached (a fresh job, a resumed checkpoint, an upload): read it with
 * slidedp_rank_read_client_layer to resume. */
SLIDEDP_RANK_EXPORT int slidedp_rank_client_layers_current(const slidedp_rank* h, int* current);
/* Uploads `count` FP32 elements of `part` (0 master, 1 exp_avg, 2 exp_avg_sq) of client-updated
 * `layer` at version `step`, from element `offset` (parts in order). Accepted for the version
 * hostd asks for, or between steps for the last completed one. *all_complete (may be NULL) = 1
 * once hostd holds every client-updated layer at `step`. Rank 0 only. */
SLIDEDP_RANK_EXPORT int slidedp_rank_upload_client_layer(slidedp_rank* h, uint64_t step,
                                                         uint32_t layer, uint32_t part,
                                                         uint64_t offset, const float* data,
                                                         uint64_t count, int* all_complete);
/* Reads `count` elements of `part` of hostd's copy of client-updated `layer` into dst, while it
 * is the job's current state (FAILED_PRECONDITION naming the versions otherwise). */
SLIDEDP_RANK_EXPORT int slidedp_rank_read_client_layer(const slidedp_rank* h, uint32_t layer,
                                                       uint32_t part, uint64_t offset, float* dst,
                                                       uint64_t count, uint64_t* version);
SLIDEDP_RANK_EXPORT int slidedp_rank_push_grad(slidedp_rank* h, uint64_t step, uint32_t layer,
                                               const void* grad, int dtype, size_t bytes,
                                               uint32_t timeout_ms);
SLIDEDP_RANK_EXPORT int slidedp_rank_wait_step(slidedp_rank* h, uint64_t step, uint32_t timeout_ms);

/* ---- The GPU data plane (rankclient/gpu_plane.h) ----
 * Present when the library was built with CUDA (slidedp_rank_has_gpu() returns 1); otherwise
 * every slidedp_gpu_* call returns 12 (UNIMPLEMENTED). Device pointers and streams are passed as
 * void* (a cudaStream_t; NULL is the legacy default stream), so a caller needs no CUDA headers:
 * from PyTorch, tensor.data_ptr() and torch.cuda.current_stream().cuda_stream.
 *
 * A step:
 *   slidedp_gpu_begin_step(p, t, ...);
 *   forward:  slidedp_gpu_fetch(p, l, t - 1, ..., &slot, &ptr, &numel) a few layers ahead;
 *             slidedp_gpu_wait_slot(p, slot, stream); compute with ptr (BF16, numel elements);
 *             slidedp_gpu_release_slot(p, slot, stream);
 *   backward: compute grad_l; slidedp_gpu_push_grad(p, t, l, grad_l, dtype, stream, ...);
 *             before overwriting grad_l: slidedp_gpu_wait_grad_consumed(p, l, stream);
 *   slidedp_gpu_wait_pushes(p, ...); slidedp_rank_wait_step(h, t, ...). */
typedef struct slidedp_gpu_plane slidedp_gpu_plane;

typedef struct slidedp_gpu_plane_options {
  uint32_t abi_version;     /* SLIDEDP_RANK_ABI_VERSION */
  int32_t device;           /* CUDA device */
  uint32_t window_slots;    /* GPU window slots; 0: 3 */
  uint64_t h2d_chunk_bytes; /* 0: 64 MiB */
  int32_t param_route;      /* 0 or 1 replicated, 2 sharded (equal on every rank) */
  int32_t reduce_in_fp32; /* widen BF16 gradients before a collective (1, the default) or not (0) */
  void* nccl_comm;        /* an existing ncclComm_t of the job's ranks, or NULL */
  /* Gradient staging buffers (1..64; 0: 2). On the GPU-reduction route each gradient waiting for
   * its D2H holds one, so more let backward run ahead of hostd's updates. (ABI 2) */
  uint32_t staging_buffers;
} slidedp_gpu_plane_options;

SLIDEDP_RANK_EXPORT int slidedp_rank_has_gpu(void);
/* The rank handle must outlive the plane. */
SLIDEDP_RANK_EXPORT int slidedp_gpu_plane_create(slidedp_rank* h,
                                                 const slidedp_gpu_plane_options* options,
                                                 slidedp_gpu_plane** out);
SLIDEDP_RANK_EXPORT int slidedp_gpu_plane_destroy(slidedp_gpu_plane* p);
SLIDEDP_RANK_EXPORT int slidedp_gpu_begin_step(slidedp_gpu_plane* p, uint64_t step,
                                               uint32_t timeout_ms);
SLIDEDP_RANK_EXPORT int slidedp_gpu_fetch(slidedp_gpu_plane* p, uint32_t layer, uint64_t version,
                                          uint32_t timeout_ms, uint32_t* slot, void** data,
                                          uint64_t* numel);
SLIDEDP_RANK_EXPORT int slidedp_gpu_wait_slot(slidedp_gpu_plane* p, uint32_t slot, void* stream);
SLIDEDP_RANK_EXPORT int slidedp_gpu_release_slot(slidedp_gpu_plane* p, uint32_t slot, void* stream);
SLIDEDP_RANK_EXPORT int slidedp_gpu_push_grad(slidedp_gpu_plane* p, uint64_t step, uint32_t layer,
                                              const void* grad, int dtype, void* stream,
                                              uint32_t timeout_ms);
SLIDEDP_RANK_EXPORT int slidedp_gpu_wait_grad_consumed(slidedp_gpu_plane* p, uint32_t layer,
                                                       void* stream);
SLIDEDP_RANK_EXPORT int slidedp_gpu_wait_pushes(slidedp_gpu_plane* p, uint32_t timeout_ms);

/* Cumulative counters of a plane (since its creation) and the shape of its window. */
typedef struct slidedp_gpu_plane_stats {
  uint64_t h2d_bytes;
  uint64_t d2h_bytes;
  uint64_t chunks_pushed;
  uint64_t layers_fetched;
  double register_seconds;    /* cudaHostRegister of the mappings */
  double nccl_init_seconds;   /* communicator creation */
  double copier_wait_seconds; /* gradient copier blocked on hostd freeing ring slots */
  uint32_t window_slots;
  uint64_t slot_elems; /* BF16 elements per window slot */
} slidedp_gpu_plane_stats;
SLIDEDP_RANK_EXPORT int slidedp_gpu_stats(const slidedp_gpu_plane* p, slidedp_gpu_plane_stats* out);

#ifdef __cplusplus
}
#endif

#endif /* SLIDEDP_RANKCLIENT_SLIDEDP_RANK_H_ */
