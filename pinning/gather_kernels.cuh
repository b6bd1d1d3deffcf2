// The device gather's kernel and its launch (gather.cu has the design and the host side), included
// by the translation units made from gather_launch.cu.in, each of which instantiates one
// launch<N, Index> (gather_launch.h). One kernel a unit, so nvcc compiles them in parallel: one
// file of all six took 9m48s on one core of a 2-core machine while the other idled.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "ferry/detail/pass_math.h"
#include "gather_launch.h"

namespace ferry::detail::gather_impl {

constexpr int kUnroll = 8;

// A launch's arguments: its fields (one batch's, or several batches'), and the host indices in
// the parameters themselves (N > 0), which fields without an index_dev read from their offset:
// the index words themselves (Index = std::int64_t) or narrow ones (std::uint32_t: the row, and
// kNarrowFlip for kGatherFlipBit).
template <int N, class Index>
struct Args {
  int nfields;
  GatherField field[kMaxGatherFields];
  int width[kMaxGatherFields];  // bytes a word: 16, 8, 4 or 1
  Index index[N > 0 ? N : 1];
};
constexpr std::uint32_t kNarrowFlip = 0x80000000u;

// Row r's index word of field f: the row, and kGatherFlipBit.
template <int N, class Index>
__device__ __forceinline__ std::int64_t row_word(const Args<N, Index>& a, const GatherField& f, std::size_t r) {
  if constexpr (N > 0) {
    if (!f.index_dev) {
      const Index w = a.index[static_cast<std::size_t>(f.index_offset) + r];
      if constexpr (sizeof(Index) == 4)
        return static_cast<std::int64_t>(w & ~kNarrowFlip) | ((w & kNarrowFlip) ? kGatherFlipBit : 0);
      else
        return w;
    }
  }
  return f.index_dev[r];
}

// Reads field f's words kUnroll at a time, every load in flight before any store, and hands each
// to store(r, w, v, flip): word w of row r, its value, and whether the row's index carries
// kGatherFlipBit. A thread's words lie a grid's stride apart; their rows and words are stepped
// from one to the next (no division in the loop: a 64-bit one is about a hundred instructions, and
// every instruction here is one the training step on the same SMs does not issue).
template <class Word, int N, class Index, class Store>
__device__ __forceinline__ void for_each_word(const Args<N, Index>& a, const GatherField& f, Store&& store) {
  const std::size_t words = f.row_bytes / sizeof(Word), total = static_cast<std::size_t>(f.rows) * words;
  const Word* __restrict__ src = static_cast<const Word*>(f.src);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (first >= total) return;
  const std::size_t step_rows = stride / words, step_words = stride - step_rows * words;
  std::size_t r = first / words, w = first - r * words;  // where `base` is
  for (std::size_t base = first; base < total; base += stride * kUnroll) {
    Word v[kUnroll];
    bool flip[kUnroll];
    std::size_t rs[kUnroll], ws[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < total) {
        rs[u] = r, ws[u] = w;
        const std::int64_t word = row_word(a, f, r);
        flip[u] = (word & kGatherFlipBit) != 0;
        v[u] = src[static_cast<std::size_t>(word & ~kGatherFlipBit) * words + w];
      }
      r += step_rows, w += step_words;
      if (w >= words) w -= words, ++r;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * stride < total) store(rs[u], ws[u], v[u], flip[u]);
  }
}

template <class Word, int N, class Index>
__device__ void gather_field(const Args<N, Index>& a, const GatherField& f) {
  Word* __restrict__ dst = static_cast<Word*>(f.dst);
  const std::size_t words = f.row_bytes / sizeof(Word);
  for_each_word<Word>(a, f, [&](std::size_t r, std::size_t w, const Word& v, bool) { dst[r * words + w] = v; });
}

// A word's bytes in order, each to where the transform puts it (RowCursor steps the element). The
// output's kind is a constant, so pass_store's switch folds away.
template <int Kind, class Word, int N, class Index>
__device__ void gather_transformed_as(const Args<N, Index>& a, const GatherField& f) {
  constexpr int kBytes = sizeof(Word);
  const int H = static_cast<int>(f.height), W = static_cast<int>(f.width), C = static_cast<int>(f.channels);
  for_each_word<Word>(a, f, [&](std::size_t r, std::size_t w, const Word& v, bool flipped) {
    char* out = static_cast<char*>(f.dst) + r * f.out_row_bytes;
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&v);
    RowCursor at(static_cast<int>(w * kBytes), H, W, C, f.flip && flipped, f.chw);
#pragma unroll
    for (int k = 0; k < kBytes; ++k) {
      pass_store(out, at.o, Kind, static_cast<float>(bytes[k]), f.a[at.c], f.b[at.c]);
      at.next();
    }
  });
}

template <class Word, int N, class Index>
__device__ void gather_transformed(const Args<N, Index>& a, const GatherField& f) {
  switch (f.out_kind) {
    case kPassFloat32: gather_transformed_as<kPassFloat32, Word>(a, f); break;
    case kPassFloat16: gather_transformed_as<kPassFloat16, Word>(a, f); break;
    case kPassBFloat16: gather_transformed_as<kPassBFloat16, Word>(a, f); break;
    default: gather_transformed_as<kPassUInt8, Word>(a, f); break;
  }
}

// A window field (GatherField::window): element j of row r is element index[r] + shift + j of the
// source, widened to Dst (sign- or zero-extended by Src's type). Consecutive threads take
// consecutive elements of a window, so a warp reads one run of the source; each thread has
// kUnroll loads in flight before it stores any, as for_each_word. The output is [rows, window]
// in order, so element e of the grid's walk is written at dst[e].
template <class Src, class Dst, int N, class Index>
__device__ void gather_window_as(const Args<N, Index>& a, const GatherField& f) {
  const std::size_t L = static_cast<std::size_t>(f.window), total = static_cast<std::size_t>(f.rows) * L;
  const Src* __restrict__ src = static_cast<const Src*>(f.src) + f.shift;
  Dst* __restrict__ dst = static_cast<Dst*>(f.dst);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (first >= total) return;
  const std::size_t step_rows = stride / L, step_elems = stride - step_rows * L;
  std::size_t r = first / L, j = first - r * L;
  for (std::size_t base = first; base < total; base += stride * kUnroll) {
    Src v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < total) v[u] = src[static_cast<std::size_t>(row_word(a, f, r) & ~kGatherFlipBit) + j];
      r += step_rows, j += step_elems;
      if (j >= L) j -= L, ++r;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * stride < total) dst[base + u * stride] = static_cast<Dst>(v[u]);
  }
}

template <class Dst, int N, class Index>
__device__ void gather_window_to(const Args<N, Index>& a, const GatherField& f) {
  switch (f.row_bytes * 2 + (f.src_signed ? 1 : 0)) {
    case 2: gather_window_as<std::uint8_t, Dst>(a, f); break;
    case 3: gather_window_as<std::int8_t, Dst>(a, f); break;
    case 4: gather_window_as<std::uint16_t, Dst>(a, f); break;
    case 5: gather_window_as<std::int16_t, Dst>(a, f); break;
    case 8: gather_window_as<std::uint32_t, Dst>(a, f); break;
    case 9: gather_window_as<std::int32_t, Dst>(a, f); break;
    default: gather_window_as<std::int64_t, Dst>(a, f); break;
  }
}

template <int N, class Index>
__global__ void gather_fields(const __grid_constant__ Args<N, Index> a) {
  for (int k = 0; k < a.nfields; ++k) {
    if (a.field[k].window > 0) {
      switch (a.field[k].out_elem_bytes) {  // as wide as the source (raw windows) or wider
        case 1: gather_window_to<std::int8_t>(a, a.field[k]); break;
        case 2: gather_window_to<std::int16_t>(a, a.field[k]); break;
        case 4: gather_window_to<std::int32_t>(a, a.field[k]); break;
        default: gather_window_to<std::int64_t>(a, a.field[k]); break;
      }
      continue;
    }
    if (a.field[k].out_kind >= 0) {
      switch (a.width[k]) {
        case 16: gather_transformed<uint4>(a, a.field[k]); break;
        case 8: gather_transformed<unsigned long long>(a, a.field[k]); break;
        case 4: gather_transformed<unsigned>(a, a.field[k]); break;
        default: gather_transformed<unsigned char>(a, a.field[k]); break;
      }
      continue;
    }
    switch (a.width[k]) {
      case 16: gather_field<uint4>(a, a.field[k]); break;
      case 8: gather_field<unsigned long long>(a, a.field[k]); break;
      case 4: gather_field<unsigned>(a, a.field[k]); break;
      default: gather_field<unsigned char>(a, a.field[k]); break;
    }
  }
}

inline int sm_count() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaGetLastError();
  return sms > 0 ? sms : 16;
}

// `host_index`'s words as a launch's Index: narrow ones only where every row fits 31 bits
// (launch_gather checks).
template <class Index>
void put_index(const std::int64_t* host_index, std::int64_t host_rows, Index* out) {
  if constexpr (sizeof(Index) == 4) {
    for (std::int64_t i = 0; i < host_rows; ++i) {
      const std::int64_t w = host_index[i];
      out[i] = static_cast<std::uint32_t>(w & ~kGatherFlipBit) | ((w & kGatherFlipBit) ? kNarrowFlip : 0u);
    }
  } else {
    std::copy(host_index, host_index + host_rows, out);
  }
}

template <int N, class Index>
void launch(const std::int64_t* host_index, std::int64_t host_rows, const GatherField* fields, int nfields, cudaStream_t stream) {
  static_assert(sizeof(Args<N, Index>) <= 32764, "CUDA's kernel parameter limit");
  Args<N, Index> a;  // the fields and indices past nfields and host_rows are never read: not zeroed
  a.nfields = nfields;
  std::size_t words = 0;
  bool transformed = false;
  for (int k = 0; k < nfields; ++k) {
    a.field[k] = fields[k];
    if (fields[k].window > 0) {  // element by element
      a.width[k] = 1;
      words += static_cast<std::size_t>(fields[k].rows) * static_cast<std::size_t>(fields[k].window);
      continue;
    }
    // A transformed field writes element by element: only its source's alignment counts.
    const std::uintptr_t dst = fields[k].out_kind >= 0 ? 0 : reinterpret_cast<std::uintptr_t>(fields[k].dst);
    const std::uintptr_t m = reinterpret_cast<std::uintptr_t>(fields[k].src) | dst | fields[k].row_bytes;
    a.width[k] = m % 16 == 0 ? 16 : m % 8 == 0 ? 8 : m % 4 == 0 ? 4 : 1;
    // A transformed word is as much work as the bytes it holds (each written on its own).
    const std::size_t per_word = fields[k].out_kind >= 0 ? static_cast<std::size_t>(a.width[k]) : 1;
    transformed = transformed || fields[k].out_kind >= 0;
    // The grid is sized by all the fields' words: several batches in one launch fill more SMs.
    words += static_cast<std::size_t>(fields[k].rows) * fields[k].row_bytes / static_cast<std::size_t>(a.width[k]) * per_word;
  }
  if constexpr (N > 0) put_index(host_index, host_rows, a.index);
  if (words == 0) return;
  thread_local const int sms = sm_count();
  // Transforms compute as well as wait on the link: two blocks a SM.
  const std::size_t cap = static_cast<std::size_t>(sms) * (transformed ? 2 : 1);
  const std::size_t blocks = std::min<std::size_t>((words + 256 * kUnroll - 1) / (256 * kUnroll), cap);
  gather_fields<N, Index><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
}

}  // namespace ferry::detail::gather_impl
