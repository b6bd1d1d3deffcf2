/* ferry/loaders/plugin_abi.h — the C ABI between ferry and dataset plugins (shared libraries).
 *
 * A plugin is a shared library that exports one C function:
 *
 *   uint32_t ferry_plugin_init(const ferry_plugin_host* host);
 *
 * It calls host->register_dataset() once per dataset type it provides, and returns
 * FERRY_PLUGIN_ABI_VERSION as it was when the plugin was compiled; ferry refuses a plugin whose
 * version differs from its own (a clear ferry::Error, nothing registered). This header is plain
 * C, so a plugin can be written in C, C++ or anything with a C FFI, and needs nothing else from
 * ferry. See examples/plugin/ramp_plugin.c.
 *
 * A dataset type is a table of functions (ferry_dataset_ops). Every sample of an instance has the
 * same fields, each a fixed-shape tensor described by fields(); get() writes sample `index` into
 * one caller-owned buffer per field (itemsize x product(shape) bytes each, which may be pinned
 * memory). get(), size() and fields() are called from several worker threads at once and must be
 * thread-safe. Failures return non-zero (or NULL from create) with a message written into err
 * (at most err_size bytes, NUL-terminated); ferry raises it as an error naming the plugin.
 */
#ifndef FERRY_LOADERS_PLUGIN_ABI_H
#define FERRY_LOADERS_PLUGIN_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_PLUGIN_ABI_VERSION 1u
#define FERRY_PLUGIN_ENTRY "ferry_plugin_init"
#define FERRY_PLUGIN_MAX_DIMS 8

/* Element types; the values equal ferry::DType's. */
enum ferry_dtype {
  FERRY_BOOL = 0,
  FERRY_UINT8 = 1,
  FERRY_INT8 = 2,
  FERRY_INT16 = 3,
  FERRY_INT32 = 4,
  FERRY_INT64 = 5,
  FERRY_FLOAT16 = 6,
  FERRY_BFLOAT16 = 7,
  FERRY_FLOAT32 = 8,
  FERRY_FLOAT64 = 9
};

/* One field of a sample: a tensor of fixed dtype and shape. */
typedef struct ferry_field {
  char name[64];
  int32_t dtype; /* enum ferry_dtype */
  int32_t ndim;  /* 0 .. FERRY_PLUGIN_MAX_DIMS */
  int64_t shape[FERRY_PLUGIN_MAX_DIMS];
} ferry_field;

/* One configuration entry, from "key=value,key=value". */
typedef struct ferry_kv {
  const char* key;
  const char* value;
} ferry_kv;

typedef struct ferry_dataset_ops {
  uint32_t abi_version; /* FERRY_PLUGIN_ABI_VERSION */
  uint32_t struct_size; /* sizeof(ferry_dataset_ops) */
  /* A new instance configured by `config`; NULL with a message in err on failure. */
  void* (*create)(const ferry_kv* config, size_t n, char* err, size_t err_size);
  void (*destroy)(void* self);
  uint64_t (*size)(void* self);
  /* Writes up to `max` field descriptions; returns how many fields a sample has. */
  size_t (*fields)(void* self, ferry_field* out, size_t max);
  /* Writes sample `index` into outputs[0 .. nfields); 0 on success. */
  int (*get)(void* self, uint64_t index, void* const* outputs, char* err, size_t err_size);
} ferry_dataset_ops;

typedef struct ferry_plugin_host {
  uint32_t abi_version; /* the host's FERRY_PLUGIN_ABI_VERSION */
  void* context;
  /* Registers a dataset type under `name`; 0 on success. `ops` must stay valid while the
     library is loaded (a static table). */
  int (*register_dataset)(void* context, const char* name, const ferry_dataset_ops* ops);
} ferry_plugin_host;

typedef uint32_t (*ferry_plugin_init_fn)(const ferry_plugin_host* host);

#ifdef __cplusplus
}
#endif

#endif /* FERRY_LOADERS_PLUGIN_ABI_H */
