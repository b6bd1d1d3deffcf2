/* ramp_plugin.c — an example ferry dataset plugin, in plain C.
 *
 * Registers the dataset "ramp": sample i has a float32 field "x" of `dim` values i + k / 1000
 * (k = 0 .. dim-1) and an int64 field "y" = i mod 10. Options: n (samples, default 1000), dim
 * (default 16). Build it as a shared library against include/ (nothing else from ferry), then:
 *
 *   ferry::DatasetRegistry::global().load_plugin("libferry_ramp_plugin.so");
 *   auto ds = ferry::DatasetRegistry::global().create("ramp", "n=100,dim=8");
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/loaders/plugin_abi.h"

#ifndef RAMP_ABI_VERSION /* tests build a copy with a wrong version */
#define RAMP_ABI_VERSION FERRY_PLUGIN_ABI_VERSION
#endif

typedef struct ramp {
  uint64_t n;
  int64_t dim;
} ramp;

static int parse_int(const char* s, int64_t* out) {
  char* end = NULL;
  long long v = strtoll(s, &end, 10);
  if (!*s || *end) return 0;
  *out = v;
  return 1;
}

static void* ramp_create(const ferry_kv* config, size_t n, char* err, size_t err_size) {
  int64_t size = 1000, dim = 16;
  for (size_t i = 0; i < n; ++i) {
    int64_t* target = strcmp(config[i].key, "n") == 0 ? &size : strcmp(config[i].key, "dim") == 0 ? &dim : NULL;
    if (!target) {
      snprintf(err, err_size, "unknown option '%s' (ramp takes n, dim)", config[i].key);
      return NULL;
    }
    if (!parse_int(config[i].value, target) || *target < 0 || (target == &dim && *target == 0)) {
      snprintf(err, err_size, "option '%s' must be a positive integer, got '%s'", config[i].key, config[i].value);
      return NULL;
    }
  }
  ramp* r = (ramp*)malloc(sizeof(ramp));
  if (!r) {
    snprintf(err, err_size, "out of memory");
    return NULL;
  }
  r->n = (uint64_t)size;
  r->dim = dim;
  return r;
}

static void ramp_destroy(void* self) { free(self); }

static uint64_t ramp_size(void* self) { return ((ramp*)self)->n; }

static size_t ramp_fields(void* self, ferry_field* out, size_t max) {
  if (max >= 2) {
    memset(out, 0, 2 * sizeof(ferry_field));
    snprintf(out[0].name, sizeof out[0].name, "x");
    out[0].dtype = FERRY_FLOAT32;
    out[0].ndim = 1;
    out[0].shape[0] = ((ramp*)self)->dim;
    snprintf(out[1].name, sizeof out[1].name, "y");
    out[1].dtype = FERRY_INT64;
    out[1].ndim = 0;
  }
  return 2;
}

static int ramp_get(void* self, uint64_t index, void* const* outputs, char* err, size_t err_size) {
  const ramp* r = (const ramp*)self;
  if (index >= r->n) {
    snprintf(err, err_size, "index %llu out of range for %llu samples", (unsigned long long)index, (unsigned long long)r->n);
    return 1;
  }
  float* x = (float*)outputs[0];
  for (int64_t k = 0; k < r->dim; ++k) x[k] = (float)index + (float)k / 1000.0f;
  *(int64_t*)outputs[1] = (int64_t)(index % 10);
  return 0;
}

static const ferry_dataset_ops kRampOps = {
    FERRY_PLUGIN_ABI_VERSION, sizeof(ferry_dataset_ops), ramp_create, ramp_destroy, ramp_size, ramp_fields, ramp_get};

__attribute__((visibility("default"))) uint32_t ferry_plugin_init(const ferry_plugin_host* host) {
  if (host->register_dataset(host->context, "ramp", &kRampOps) != 0) return 0;
  return RAMP_ABI_VERSION;
}
