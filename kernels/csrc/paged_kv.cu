// Paged KV-cache kernels: decode attention through a block table, the cache write of new
// tokens, and block copies (copy-on-write, gather to / scatter from a staging buffer).
//
// Compiled at run time by NVRTC (cupy RawModule, see kernels/cuda.py) and, in CI, by nvcc to
// PTX (tests/unit/test_cuda_sources.py), so: no host headers, no templates reached only by
// name (every instantiation has an extern "C" entry point, which also keeps nvcc honest:
// an uninstantiated template is barely checked), `long long` instead of <cstdint> types.
//
// Layouts (see kernels/reference.py): one layer's K or V pool is
// [num_blocks, block_size, num_kv_heads, head_dim], contiguous; slot = block * block_size +
// offset. The whole cache is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kvk {

constexpr int kWarp = 32;
constexpr int kDecodeWarps = 4;
// Tokens a warp scores per step: their K and V rows are all loaded before the first use, so
// each warp keeps several row loads in flight instead of one dependent load per token.
constexpr int kDecodeUnroll = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarp;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Butterfly sum: every lane ends with the total, so the softmax state stays warp-uniform.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = kWarp / 2; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

struct DecodeArgs {
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int block_table_stride;
  long long q_seq_stride;
  long long q_head_stride;
  float scale;
};

// One warp's online softmax over tokens warp*U, warp*U+1, ... (U = kDecodeUnroll) with a
// stride of all warps' tokens. Lane `lane` owns head-dim elements lane + 32*i, i < ELEMS.
// On return m is the running max (-inf if the warp saw no token), l the sum of
// exp(score - m) and acc the exp-weighted sum of V rows.
template <typename T, int ELEMS>
__device__ __forceinline__ void decode_warp_pass(
    const float (&q)[ELEMS], const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ table, int context_len, long long head_offset, const DecodeArgs& a,
    float& m, float& l, float (&acc)[ELEMS]) {
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const long long slot_stride = static_cast<long long>(a.num_kv_heads) * a.head_dim;
  for (int t0 = warp * kDecodeUnroll; t0 < context_len; t0 += kDecodeWarps * kDecodeUnroll) {
    long long row[kDecodeUnroll];
    float s[kDecodeUnroll];
    float v[kDecodeUnroll][ELEMS];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int t = t0 + u;  // the same t on every lane: branches below never diverge
      row[u] = -1;
      if (t < context_len) {
        const long long block = table[t / a.block_size];
        row[u] = (block * a.block_size + t % a.block_size) * slot_stride + head_offset;
      }
      float part = 0.f;
#pragma unroll
      for (int i = 0; i < ELEMS; ++i) {
        const int d = lane + i * kWarp;
        const bool ok = row[u] >= 0 && d < a.head_dim;
        part += ok ? q[i] * to_float(k_cache[row[u] + d]) : 0.f;
        v[u][i] = ok ? to_float(v_cache[row[u] + d]) : 0.f;
      }
      s[u] = part;
    }
    float m_new = m;
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      s[u] = warp_sum(s[u]);
      if (row[u] >= 0) m_new = fmaxf(m_new, s[u]);
    }
    // m_new is finite: token t0 < context_len is always valid. exp(-inf) = 0 on the first step.
    const float alpha = __expf(m - m_new);
    l *= alpha;
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) acc[i] *= alpha;
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const float p = row[u] >= 0 ? __expf(s[u] - m_new) : 0.f;
      l += p;
#pragma unroll
      for (int i = 0; i < ELEMS; ++i) acc[i] += p * v[u][i];
    }
    m = m_new;
  }
}

// grid (num_heads, num_seqs), kDecodeThreads threads: one block per (sequence, query head).
template <typename T, int ELEMS>
__device__ __forceinline__ void decode_attention(
    T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, const DecodeArgs& a) {
  __shared__ float warp_max[kDecodeWarps];
  __shared__ float warp_denom[kDecodeWarps];
  __shared__ float warp_acc[kDecodeWarps][ELEMS * kWarp];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int context_len = context_lens[seq];
  T* out_row = out + (static_cast<long long>(seq) * a.num_heads + head) * a.head_dim;
  if (context_len <= 0) {  // a padding row of the batch: zeros, as the reference gives
    for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) out_row[d] = from_float<T>(0.f);
    return;
  }
  const int kv_head = head / (a.num_heads / a.num_kv_heads);  // as HF repeat_kv
  const T* q_row = query + seq * a.q_seq_stride + head * a.q_head_stride;
  float q[ELEMS];
  float acc[ELEMS];
#pragma unroll
  for (int i = 0; i < ELEMS; ++i) {
    const int d = lane + i * kWarp;
    q[i] = d < a.head_dim ? to_float(q_row[d]) * a.scale : 0.f;
    acc[i] = 0.f;
  }
  float m = neg_inf();
  float l = 0.f;
  const int* table = block_tables + static_cast<long long>(seq) * a.block_table_stride;
  decode_warp_pass<T, ELEMS>(q, k_cache, v_cache, table, context_len,
                             static_cast<long long>(kv_head) * a.head_dim, a, m, l, acc);
  if (lane == 0) {
    warp_max[warp] = m;
    warp_denom[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < ELEMS; ++i) warp_acc[warp][lane + i * kWarp] = acc[i];
  __syncthreads();
  // Merge the warps' partial softmaxes; a warp that saw no token has m = -inf, weight 0.
  float top = neg_inf();
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, warp_max[w]);
  float weight[kDecodeWarps];
  float denom = 0.f;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    weight[w] = __expf(warp_max[w] - top);
    denom += weight[w] * warp_denom[w];
  }
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    float num = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) num += weight[w] * warp_acc[w][d];
    out_row[d] = from_float<T>(num / denom);
  }
}

// Copy units: the Python side picks the widest one that divides every size and address.
struct alignas(16) Bytes16 {
  unsigned int w[4];
};
struct alignas(8) Bytes8 {
  unsigned int w[2];
};
typedef unsigned int Bytes4;
typedef unsigned short Bytes2;
typedef unsigned char Bytes1;

// grid (num_tokens), any block size: token i's K and V rows (num_kv_heads * head_dim
// elements, `row_units` units) go to slot slot_mapping[i]; a negative slot skips the token.
template <typename U>
__device__ __forceinline__ void write_cache(U* __restrict__ k_cache, U* __restrict__ v_cache,
                                            const U* __restrict__ key,
                                            const U* __restrict__ value,
                                            const long long* __restrict__ slot_mapping,
                                            long long key_stride, long long value_stride,
                                            long long row_units) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  U* k_dst = k_cache + slot * row_units;
  U* v_dst = v_cache + slot * row_units;
  const U* k_src = key + token * key_stride;
  const U* v_src = value + token * value_stride;
  for (long long i = threadIdx.x; i < row_units; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

// grid (num_pairs, num_planes): copy `block_units` units from
// src + src_ids[p] * src_block_stride + plane * src_plane_stride to the same place in dst.
// A null id array means the identity (pair p is block p): gather writes staging[p] and
// scatter reads it. No restrict: copy-on-write copies within one cache (src and dst blocks
// are disjoint by contract, the buffer is not).
template <typename U>
__device__ __forceinline__ void copy_blocks(U* dst, const U* src, const long long* dst_ids,
                                            const long long* src_ids, long long dst_block_stride,
                                            long long dst_plane_stride,
                                            long long src_block_stride,
                                            long long src_plane_stride, long long block_units) {
  const long long pair = blockIdx.x;
  const long long plane = blockIdx.y;
  const long long d = dst_ids != nullptr ? dst_ids[pair] : pair;
  const long long s = src_ids != nullptr ? src_ids[pair] : pair;
  U* out = dst + d * dst_block_stride + plane * dst_plane_stride;
  const U* in = src + s * src_block_stride + plane * src_plane_stride;
  for (long long i = threadIdx.x; i < block_units; i += blockDim.x) out[i] = in[i];
}

}  // namespace kvk

// Entry points: decode_attention_<dtype>_d<max head_dim>, write_cache_b<unit bytes>,
// copy_blocks_b<unit bytes>. kernels/cuda.py names them the same way.

#define KVK_DECODE_ENTRY(TAG, T, MAX_DIM)                                                     \
  extern "C" __global__ void __launch_bounds__(kvk::kDecodeThreads)                           \
      decode_attention_##TAG##_d##MAX_DIM(                                                    \
          T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ k_cache,    \
          const T* __restrict__ v_cache, const int* __restrict__ block_tables,                \
          const int* __restrict__ context_lens, float scale, int num_heads, int num_kv_heads, \
          int head_dim, int block_size, int block_table_stride, long long q_seq_stride,       \
          long long q_head_stride) {                                                          \
    const kvk::DecodeArgs a{num_heads,          num_kv_heads, head_dim,      block_size,      \
                            block_table_stride, q_seq_stride, q_head_stride, scale};          \
    kvk::decode_attention<T, (MAX_DIM) / kvk::kWarp>(out, query, k_cache, v_cache,            \
                                                     block_tables, context_lens, a);          \
  }

#define KVK_DECODE_DTYPE(TAG, T) \
  KVK_DECODE_ENTRY(TAG, T, 32)   \
  KVK_DECODE_ENTRY(TAG, T, 64)   \
  KVK_DECODE_ENTRY(TAG, T, 128)  \
  KVK_DECODE_ENTRY(TAG, T, 256)

KVK_DECODE_DTYPE(f32, float)
KVK_DECODE_DTYPE(f16, __half)
KVK_DECODE_DTYPE(bf16, __nv_bfloat16)

#define KVK_COPY_ENTRIES(BYTES)                                                               \
  extern "C" __global__ void write_cache_b##BYTES(                                            \
      kvk::Bytes##BYTES* k_cache, kvk::Bytes##BYTES* v_cache, const kvk::Bytes##BYTES* key,   \
      const kvk::Bytes##BYTES* value, const long long* slot_mapping, long long key_stride,    \
      long long value_stride, long long row_units) {                                          \
    kvk::write_cache(k_cache, v_cache, key, value, slot_mapping, key_stride, value_stride,    \
                     row_units);                                                              \
  }                                                                                           \
  extern "C" __global__ void copy_blocks_b##BYTES(                                            \
      kvk::Bytes##BYTES* dst, const kvk::Bytes##BYTES* src, const long long* dst_ids,         \
      const long long* src_ids, long long dst_block_stride, long long dst_plane_stride,       \
      long long src_block_stride, long long src_plane_stride, long long block_units) {        \
    kvk::copy_blocks(dst, src, dst_ids, src_ids, dst_block_stride, dst_plane_stride,          \
                     src_block_stride, src_plane_stride, block_units);                        \
  }

KVK_COPY_ENTRIES(1)
KVK_COPY_ENTRIES(2)
KVK_COPY_ENTRIES(4)
KVK_COPY_ENTRIES(8)
KVK_COPY_ENTRIES(16)
