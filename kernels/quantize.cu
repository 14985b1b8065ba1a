// cgx_ucx GPU codec: CGX max-min bucketed quantization (Markov et al., Middleware 2022).
//
// The same function as cgx_ucx/compression/reference.py and cpu.py, byte for byte: every
// float32 operation is an explicit round-to-nearest intrinsic (__fadd_rn, __fsub_rn,
// __fmul_rn, __fdiv_rn) and the module is compiled with --fmad=false --ftz=false
// --prec-div=true, so nothing is contracted into an FMA or flushed to zero.
//
// Wire format (see codec.py): 24-byte header, then per bucket float32 (unit, min), then the
// codes: value i occupies stream bits [i*bits, (i+1)*bits), stream bit k is bit k%8 of byte
// k/8. Segments may start at any byte address (several are packed back to back in one
// message), so the header and meta are written byte-wise and the codes through a shared
// staging buffer with 32-bit stores from the first 4-byte aligned address on. Values
// (inputs and outputs) may start at any address of their element size: loads are as wide
// as the start's alignment allows (16 bytes when it is 16-byte aligned).
//
// Kernels (all extern "C", names prefixed cgx_):
//   cgx_encode_{f32,f16,bf16}     one block per tile of whole buckets (below); optionally
//                                 writes what the codes decode to (encode_decode). One
//                                 segment given by the scalar arguments, or several back to
//                                 back in one launch, given by a device array of cgx_enc_seg
//                                 (each block finds its segment by binary search over the
//                                 segments' first blocks; RAW segments, bits == 32, are a
//                                 header and a byte copy).
//   cgx_decode_{f32,f16,bf16,f64} grid-stride, a warp per 256 values (coalesced).
//   cgx_decode_add                acc[i] = acc[i] + decoded value (float32), fused.
//   cgx_decode_{f32,f16,bf16,f64,add}_batch
//                                 several segments (cgx_dec_seg) in one launch; every block
//                                 first compares every segment's header with the expected
//                                 one and writes nothing unless all match (block 0 reports
//                                 the result in *status), so the caller can raise the
//                                 codec's error for the segment at fault.
//   cgx_raw_{f32,f16,bf16}_{f32,f16,bf16,f64,add}_{a,u}
//                                 RAW (bits == 32) payload conversion / accumulation;
//                                 _a when the payload is aligned to its element, _u when not.
//   cgx_write_header              the header alone (empty and RAW segments).
//
// Encode, one tile per block. A tile is a run of whole buckets starting on a value index
// that is a multiple of 8 (so it owns whole code bytes: 8 codes are `bits` bytes). Its
// values are cut into chunks of 8; thread t takes chunks t, t + 256, t + 512, t + 768 of a
// round of 1024 chunks (8192 values: loads of a warp are contiguous, 16 bytes a thread
// when aligned), and the values stay in registers:
//   1. load the round; min/max per bucket: a thread folds its chunk, a warp combines
//      neighbouring chunks of the same bucket (segmented shuffle scan), the last lane of
//      each run merges into shared memory with atomicMin/atomicMax (a chunk that crosses a
//      bucket boundary merges its first part directly);
//   2. (unit, min) per bucket into shared memory and the meta;
//   3. codes from the registers, staged in shared memory, stored with 32-bit words.
// The input is read once. Tiles of more than 8192 values (buckets larger than that) take
// several rounds and read their values twice (the second time from L2).
//
// float16 / bfloat16 travel as their 16-bit patterns and are converted here exactly as in
// cpu.py (float32 -> half: round half to even; NaN stays NaN).

#define CGX_BLOCK 256
#define CGX_WARP 32
#define CGX_SLOTS 4                                 // chunks per thread per round
#define CGX_ROUND_CHUNKS (CGX_SLOTS * CGX_BLOCK)     // 1024 chunks: 8192 values
#define CGX_MAX_TILE_BUCKETS 512
#define CGX_RAW_BLOCK_BYTES 4096                    // bytes of a RAW copy per block
#define CGX_DECODE_BLOCK_VALUES (8 * CGX_BLOCK)     // a warp per 256 values
#define CGX_FULL_MASK 0xFFFFFFFFu
#define CGX_HEADER_NBYTES 24
#define CGX_INT_MAX 0x7FFFFFFF
#define CGX_INT_MIN (-0x7FFFFFFF - 1)
#define CGX_FLAGS_STOCHASTIC (1ull << 56)           // header byte 7 bit 0: informational

typedef unsigned char cgx_u8;
typedef unsigned short cgx_u16;
typedef unsigned int cgx_u32;
typedef long long cgx_i64;
typedef unsigned long long cgx_u64;

__device__ __forceinline__ cgx_i64 cgx_min64(cgx_i64 a, cgx_i64 b) { return a < b ? a : b; }
__device__ __forceinline__ int cgx_mini(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int cgx_maxi(int a, int b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------------
// conversions

__device__ __forceinline__ float cgx_f16_to_f32(cgx_u32 h) {
  cgx_u32 mag = (h & 0x7FFFu) << 13;
  // normals and subnormals: exact rescale by 2**112 (0x77800000); Inf/NaN: exponent all ones
  cgx_u32 bits = ((h & 0x7C00u) == 0x7C00u)
                     ? (mag | 0x7F800000u)
                     : __float_as_uint(__fmul_rn(__uint_as_float(mag), __uint_as_float(0x77800000u)));
  return __uint_as_float(bits | ((h & 0x8000u) << 16));
}

__device__ __forceinline__ float cgx_bf16_to_f32(cgx_u32 h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ cgx_u16 cgx_f32_to_f16(float v) {
  cgx_u32 f = __float_as_uint(v);
  cgx_u32 sign = f & 0x80000000u;
  f ^= sign;
  cgx_u32 o;
  if (f >= 0x47800000u) {  // >= 65536: Inf, NaN stays a quiet NaN
    o = (f > 0x7F800000u) ? 0x7E00u : 0x7C00u;
  } else if (f < 0x38800000u) {  // below the smallest normal half: let the FPU round
    o = __float_as_uint(__fadd_rn(__uint_as_float(f), 0.5f)) - 0x3F000000u;
  } else {  // rebias the exponent 127 -> 15, round half to even (a carry may give Inf)
    o = (f - 0x38000000u + 0xFFFu + ((f >> 13) & 1u)) >> 13;
  }
  return (cgx_u16)(o | (sign >> 16));
}

__device__ __forceinline__ cgx_u16 cgx_f32_to_bf16(float v) {
  cgx_u32 f = __float_as_uint(v);
  cgx_u32 o;
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: quiet, keep the sign
    o = (f >> 16) | 0x40u;
  } else {
    o = (f + 0x7FFFu + ((f >> 16) & 1u)) >> 16;
  }
  return (cgx_u16)o;
}

// DT: 0 float32, 1 float16 bits, 2 bfloat16 bits (the codec's dtype codes)
template <int DT>
__device__ __forceinline__ float cgx_load(const void* x, cgx_i64 i);
template <>
__device__ __forceinline__ float cgx_load<0>(const void* x, cgx_i64 i) {
  return ((const float*)x)[i];
}
template <>
__device__ __forceinline__ float cgx_load<1>(const void* x, cgx_i64 i) {
  return cgx_f16_to_f32(((const cgx_u16*)x)[i]);
}
template <>
__device__ __forceinline__ float cgx_load<2>(const void* x, cgx_i64 i) {
  return cgx_bf16_to_f32(((const cgx_u16*)x)[i]);
}

// two values of a 32-bit word of 16-bit patterns (DT 1: float16, 2: bfloat16)
template <int DT>
__device__ __forceinline__ void cgx_unpack2(cgx_u32 w, float* v) {
  v[0] = DT == 1 ? cgx_f16_to_f32(w & 0xFFFFu) : cgx_bf16_to_f32(w & 0xFFFFu);
  v[1] = DT == 1 ? cgx_f16_to_f32(w >> 16) : cgx_bf16_to_f32(w >> 16);
}

// the largest power of two <= 16 that divides an address
__device__ __forceinline__ int cgx_align(cgx_u64 p) {
  const cgx_u64 a = (p | 16ull) & (~(p | 16ull) + 1ull);
  return (int)a;
}

// the chunk of 8 values at x + i0, `m` (1..8) of them valid: the others repeat v[0]. A
// full chunk is read with the widest loads that `align` (the alignment of x + i0) allows.
template <int DT>
__device__ __forceinline__ void cgx_load_chunk(const void* x, cgx_i64 i0, int m, int align,
                                               float* v) {
  if (m == 8 && align >= 16) {
    if (DT == 0) {
      const float4* p = (const float4*)((const float*)x + i0);
      const float4 a = p[0], b = p[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
      const uint4 a = *(const uint4*)((const cgx_u16*)x + i0);
      cgx_unpack2<DT>(a.x, v);
      cgx_unpack2<DT>(a.y, v + 2);
      cgx_unpack2<DT>(a.z, v + 4);
      cgx_unpack2<DT>(a.w, v + 6);
    }
    return;
  }
  if (m == 8 && align == 8) {
    if (DT == 0) {
      const float2* p = (const float2*)((const float*)x + i0);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 a = p[k];
        v[2 * k] = a.x;
        v[2 * k + 1] = a.y;
      }
    } else {
      const uint2* p = (const uint2*)((const cgx_u16*)x + i0);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint2 a = p[k];
        cgx_unpack2<DT>(a.x, v + 4 * k);
        cgx_unpack2<DT>(a.y, v + 4 * k + 2);
      }
    }
    return;
  }
  if (m == 8 && align == 4 && DT != 0) {
    const cgx_u32* p = (const cgx_u32*)((const cgx_u16*)x + i0);
#pragma unroll
    for (int k = 0; k < 4; ++k) cgx_unpack2<DT>(p[k], v + 2 * k);
    return;
  }
  v[0] = cgx_load<DT>(x, i0);
#pragma unroll
  for (int j = 1; j < 8; ++j) v[j] = j < m ? cgx_load<DT>(x, i0 + j) : v[0];
}

// the same from a byte address of unknown alignment (RAW payloads)
template <int DT>
__device__ __forceinline__ float cgx_load_bytes(const cgx_u8* p, cgx_i64 i) {
  if (DT == 0) {
    const cgx_u8* q = p + 4 * i;
    return __uint_as_float((cgx_u32)q[0] | ((cgx_u32)q[1] << 8) | ((cgx_u32)q[2] << 16) |
                           ((cgx_u32)q[3] << 24));
  }
  const cgx_u8* q = p + 2 * i;
  cgx_u32 h = (cgx_u32)q[0] | ((cgx_u32)q[1] << 8);
  return DT == 1 ? cgx_f16_to_f32(h) : cgx_bf16_to_f32(h);
}

// OT: 0 float32, 1 float16, 2 bfloat16, 3 float64; ADD accumulates (float32 only)
template <int OT, bool ADD>
__device__ __forceinline__ void cgx_store(void* out, cgx_i64 i, float v) {
  if (ADD) {
    float* o = (float*)out;
    o[i] = __fadd_rn(o[i], v);
  } else if (OT == 0) {
    ((float*)out)[i] = v;
  } else if (OT == 1) {
    ((cgx_u16*)out)[i] = cgx_f32_to_f16(v);
  } else if (OT == 2) {
    ((cgx_u16*)out)[i] = cgx_f32_to_bf16(v);
  } else {
    ((double*)out)[i] = (double)v;
  }
}

__device__ __forceinline__ void cgx_put_f32(cgx_u8* p, float v) {
  cgx_u32 u = __float_as_uint(v);
  p[0] = (cgx_u8)u;
  p[1] = (cgx_u8)(u >> 8);
  p[2] = (cgx_u8)(u >> 16);
  p[3] = (cgx_u8)(u >> 24);
}

__device__ __forceinline__ float cgx_get_f32(const cgx_u8* p) {
  return __uint_as_float((cgx_u32)p[0] | ((cgx_u32)p[1] << 8) | ((cgx_u32)p[2] << 16) |
                         ((cgx_u32)p[3] << 24));
}

__device__ __forceinline__ void cgx_put_header(cgx_u8* buf, cgx_u64 h0, cgx_u64 h1, cgx_u64 h2) {
  for (int q = 0; q < 8; ++q) {
    buf[q] = (cgx_u8)(h0 >> (8 * q));
    buf[8 + q] = (cgx_u8)(h1 >> (8 * q));
    buf[16 + q] = (cgx_u8)(h2 >> (8 * q));
  }
}

// ---------------------------------------------------------------------------------------
// quantization arithmetic (see codec.py)

// float bits as an int whose order is the floats' order (-0 < +0); its own inverse
__device__ __forceinline__ int cgx_key(int u) { return u ^ ((u >> 31) & 0x7FFFFFFF); }

__device__ __forceinline__ bool cgx_nonfinite(float v) {
  return (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u;
}

// splitmix64 of (key, index): u in [0, 1) with 24 random bits (reference.uniform)
__device__ __forceinline__ float cgx_uniform(cgx_u64 key, cgx_i64 index) {
  cgx_u64 z = key + ((cgx_u64)index + 1ull) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return __fmul_rn((float)(cgx_u32)(z >> 40), __uint_as_float(0x33800000u));  // * 2**-24
}

// (unit, min) from the reduced keys; NaN for non-finite values or a range overflow
__device__ __forceinline__ void cgx_finish_meta(int kmn, int kmx, int bad, float levels,
                                                float* unit_out, float* mn_out) {
  float mn = __fadd_rn(__int_as_float(cgx_key(kmn)), 0.0f);  // -0 -> +0
  float mx = __fadd_rn(__int_as_float(cgx_key(kmx)), 0.0f);
  float unit = __fdiv_rn(__fsub_rn(mx, mn), levels);
  if (bad || cgx_nonfinite(unit)) {
    unit = __uint_as_float(0x7FC00000u);
    mn = unit;
  }
  *unit_out = unit;
  *mn_out = mn;
}

__device__ __forceinline__ cgx_u32 cgx_code(float v, float mn, float unit, float levels,
                                            int stochastic, cgx_u64 key, cgx_i64 index) {
  if (!(unit > 0.0f)) return 0u;  // constant bucket (unit 0) or non-finite bucket (NaN)
  float c;
  if (stochastic) {
    float t = __fdiv_rn(__fsub_rn(v, mn), unit);
    c = floorf(t);
    if (cgx_uniform(key, index) < __fsub_rn(t, c)) c = __fadd_rn(c, 1.0f);
  } else {
    c = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(v, mn), unit), 0.5f));
  }
  if (c > levels) c = levels;
  return (cgx_u32)c;
}

// ---------------------------------------------------------------------------------------
// small helpers

// o / d for non-negative 64-bit values, in 32 bits when both fit (the common case)
__device__ __forceinline__ cgx_i64 cgx_div(cgx_i64 o, cgx_i64 d) {
  if (((o | d) >> 31) == 0) return (cgx_i64)((cgx_u32)o / (cgx_u32)d);
  return o / d;
}

// what a value decodes to, written to out[i] as out_kind (0 float32, 1 float16,
// 2 bfloat16, 3 float64); 8 values at once, 16-byte stores when `vec` and the chunk is full
__device__ __forceinline__ void cgx_store_chunk(void* out, int out_kind, cgx_i64 i0, int m,
                                                bool vec, const float* d) {
  if (out_kind == 0) {
    float* o = (float*)out + i0;
    if (vec && m == 8) {
      ((float4*)o)[0] = make_float4(d[0], d[1], d[2], d[3]);
      ((float4*)o)[1] = make_float4(d[4], d[5], d[6], d[7]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < m) o[j] = d[j];
      }
    }
  } else if (out_kind == 3) {
    double* o = (double*)out + i0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < m) o[j] = (double)d[j];
    }
  } else {
    cgx_u16 h[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = out_kind == 1 ? cgx_f32_to_f16(d[j]) : cgx_f32_to_bf16(d[j]);
    cgx_u16* o = (cgx_u16*)out + i0;
    if (vec && m == 8) {
      *(uint4*)o = make_uint4(h[0] | ((cgx_u32)h[1] << 16), h[2] | ((cgx_u32)h[3] << 16),
                              h[4] | ((cgx_u32)h[5] << 16), h[6] | ((cgx_u32)h[7] << 16));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < m) o[j] = h[j];
      }
    }
  }
}

// cgx_store with the output type known at run time
__device__ __forceinline__ void cgx_store_value(void* out, int out_kind, cgx_i64 i, float d) {
  switch (out_kind) {
    case 0: cgx_store<0, false>(out, i, d); break;
    case 1: cgx_store<1, false>(out, i, d); break;
    case 2: cgx_store<2, false>(out, i, d); break;
    default: cgx_store<3, false>(out, i, d);
  }
}

// nb bytes from shared memory to dst (any alignment), by the whole block: the bytes before
// the first 4-byte aligned address and the last < 4 one by one, 32-bit words in between
__device__ __forceinline__ void cgx_store_bytes(cgx_u8* dst, const cgx_u8* s, int nb) {
  const int tid = (int)threadIdx.x;
  const int head = cgx_mini(nb, (int)((4u - (cgx_u32)((cgx_u64)dst & 3ull)) & 3u));
  const int nw = (nb - head) >> 2;
  if (tid < head) dst[tid] = s[tid];
  cgx_u32* dw = (cgx_u32*)(dst + head);
  const cgx_u8* sw = s + head;
  for (int w = tid; w < nw; w += CGX_BLOCK) {
    const cgx_u8* q = sw + 4 * w;
    dw[w] = (cgx_u32)q[0] | ((cgx_u32)q[1] << 8) | ((cgx_u32)q[2] << 16) | ((cgx_u32)q[3] << 24);
  }
  const int t0 = head + 4 * nw;
  if (t0 + tid < nb) dst[t0 + tid] = s[t0 + tid];
}

__device__ __forceinline__ void cgx_fold(float v, int& kmn, int& kmx, int& bad) {
  const int k = cgx_key(__float_as_int(v));
  kmn = cgx_mini(kmn, k);
  kmx = cgx_maxi(kmx, k);
  bad |= cgx_nonfinite(v) ? 1 : 0;
}

__device__ __forceinline__ void cgx_merge(int* s_kmn, int* s_kmx, int* s_bad, int lb, int kmn,
                                          int kmx, int bad) {
  atomicMin(s_kmn + lb, kmn);
  atomicMax(s_kmx + lb, kmx);
  if (bad) atomicOr(s_bad + lb, 1);
}

// ---------------------------------------------------------------------------------------
// encode

// One segment of an encode: its own arguments (the single-segment kernels) or a row of the
// device array of a batched launch. The field order is gpu.py's ENC_FIELDS.
struct cgx_enc_seg {
  cgx_u64 x;           // address of value 0 (float32 / float16 / bfloat16 of the kernel)
  cgx_u64 buf;         // address of the segment's first byte (its header)
  cgx_u64 decoded;     // where what the codes decode to goes (0: nowhere)
  cgx_u64 key;         // stochastic rounding key (reference.seed_key)
  cgx_i64 n;           // values
  cgx_i64 bits;        // 1..8, or 32: RAW (batched launches only)
  cgx_i64 bsize;       // values per bucket
  cgx_i64 tile_buckets;
  cgx_i64 stochastic;
  cgx_i64 codes_off;   // first code byte, from buf
  cgx_i64 block0;      // first block of the segment in a batched launch
  cgx_i64 raw_nbytes;  // RAW: payload bytes the kernel copies (0: copied by the caller)
  cgx_u64 h0, h1, h2;  // the header, little-endian words
  cgx_i64 out_kind;    // type of the decoded values: 0 float32, 1 float16, 2 bfloat16, 3 f64
};

// the chunks of round r of a tile into registers (slot k: chunk r*1024 + k*256 + tid)
template <int DT>
__device__ __forceinline__ void cgx_load_round(const void* x, cgx_i64 ts, cgx_i64 nv,
                                               cgx_i64 nch, int r, int align,
                                               float (&v)[CGX_SLOTS][8]) {
#pragma unroll
  for (int k = 0; k < CGX_SLOTS; ++k) {
    const cgx_i64 c = (cgx_i64)r * CGX_ROUND_CHUNKS + k * CGX_BLOCK + threadIdx.x;
    if (c < nch) {
      const cgx_i64 o = 8 * c;
      cgx_load_chunk<DT>(x, ts + o, (int)cgx_min64(8, nv - o), align, v[k]);
    }
  }
}

// min/max of round r into the tile's shared keys
template <int DT>
__device__ __forceinline__ void cgx_reduce_round(const float (&v)[CGX_SLOTS][8], const void* x,
                                                 cgx_i64 ts, cgx_i64 nv, cgx_i64 nch, int r,
                                                 cgx_i64 bsize, int* s_kmn, int* s_kmx,
                                                 int* s_bad) {
  const int lane = (int)threadIdx.x & (CGX_WARP - 1);
#pragma unroll
  for (int k = 0; k < CGX_SLOTS; ++k) {
    if ((cgx_i64)r * CGX_ROUND_CHUNKS + k * CGX_BLOCK >= nch) break;  // block-uniform
    const cgx_i64 c = (cgx_i64)r * CGX_ROUND_CHUNKS + k * CGX_BLOCK + threadIdx.x;
    const bool active = c < nch;
    int id = CGX_INT_MAX, kmn = CGX_INT_MAX, kmx = CGX_INT_MIN, bad = 0;
    if (active) {
      const cgx_i64 o = 8 * c;
      const int m = (int)cgx_min64(8, nv - o);
      cgx_i64 lb = cgx_div(o, bsize);
      cgx_i64 left = (lb + 1) * bsize - o;  // values of bucket lb from o on
      if (left >= m) {  // the usual case: the chunk lies in one bucket (padding repeats v[0])
#pragma unroll
        for (int j = 0; j < 8; ++j) cgx_fold(v[k][j], kmn, kmx, bad);
      } else {  // it crosses bucket boundaries (buckets not a multiple of 8): all but its
                // last part merge now; a rolled loop re-reading the values keeps code small
        for (int j = 0; j < m; ++j) {
          if (left == 0) {
            cgx_merge(s_kmn, s_kmx, s_bad, (int)lb, kmn, kmx, bad);
            ++lb;
            left = bsize;
            kmn = CGX_INT_MAX;
            kmx = CGX_INT_MIN;
            bad = 0;
          }
          cgx_fold(cgx_load<DT>(x, ts + o + j), kmn, kmx, bad);
          --left;
        }
      }
      id = (int)lb;
    }
    // lanes hold consecutive chunks, so equal ids are neighbours: an inclusive segmented
    // scan leaves each run's total in its last lane
#pragma unroll
    for (int d = 1; d < CGX_WARP; d <<= 1) {
      const int oid = __shfl_up_sync(CGX_FULL_MASK, id, d);
      const int omn = __shfl_up_sync(CGX_FULL_MASK, kmn, d);
      const int omx = __shfl_up_sync(CGX_FULL_MASK, kmx, d);
      const int obad = __shfl_up_sync(CGX_FULL_MASK, bad, d);
      if (lane >= d && oid == id) {
        kmn = cgx_mini(kmn, omn);
        kmx = cgx_maxi(kmx, omx);
        bad |= obad;
      }
    }
    const int nid = __shfl_down_sync(CGX_FULL_MASK, id, 1);
    if (active && (lane == CGX_WARP - 1 || nid != id)) {
      cgx_merge(s_kmn, s_kmx, s_bad, id, kmn, kmx, bad);
    }
  }
}

// tile `tile` of segment d: header (tile 0), meta of its buckets, codes, decoded values
template <int DT>
__device__ void cgx_encode_tile(const cgx_enc_seg& d, cgx_i64 tile) {
  __shared__ int s_kmn[CGX_MAX_TILE_BUCKETS];
  __shared__ int s_kmx[CGX_MAX_TILE_BUCKETS];
  __shared__ int s_bad[CGX_MAX_TILE_BUCKETS];
  __shared__ float s_unit[CGX_MAX_TILE_BUCKETS];
  __shared__ float s_min[CGX_MAX_TILE_BUCKETS];
  __shared__ cgx_u32 s_codes[CGX_ROUND_CHUNKS * 8 / 4];  // a round's code bytes

  const int tid = (int)threadIdx.x;
  const void* x = (const void*)d.x;
  cgx_u8* buf = (cgx_u8*)d.buf;
  cgx_u8* meta = buf + CGX_HEADER_NBYTES;
  cgx_u8* codes = buf + d.codes_off;
  cgx_u8* stage = (cgx_u8*)s_codes;
  const cgx_i64 n = d.n, bsize = d.bsize;
  const int bits = (int)d.bits;
  const int stochastic = (int)d.stochastic;
  const cgx_u64 key = d.key;
  void* dec = (void*)d.decoded;
  const int out_kind = (int)d.out_kind;
  const bool dvec = (d.decoded & 15ull) == 0ull;
  const cgx_i64 nbuckets = (n + bsize - 1) / bsize;
  const cgx_i64 b0 = tile * d.tile_buckets;
  const int nbt = (int)cgx_min64(d.tile_buckets, nbuckets - b0);
  const cgx_i64 ts = b0 * bsize;  // a multiple of 8
  const cgx_i64 nv = cgx_min64((cgx_i64)nbt * bsize, n - ts);
  const cgx_i64 nch = (nv + 7) >> 3;
  const int nrounds = (int)((nch + CGX_ROUND_CHUNKS - 1) / CGX_ROUND_CHUNKS);
  const float levels = (float)((1 << bits) - 1);
  // chunks start 8 values apart (16 or 32 bytes): all have the alignment of the tile's start
  const int align = cgx_align(d.x + (cgx_u64)ts * (DT == 0 ? 4ull : 2ull));
  const cgx_i64 code_nbytes = (n * bits + 7) >> 3;

  if (tile == 0 && tid == 0) cgx_put_header(buf, d.h0, d.h1, d.h2);
  for (int lb = tid; lb < nbt; lb += CGX_BLOCK) {
    s_kmn[lb] = CGX_INT_MAX;
    s_kmx[lb] = CGX_INT_MIN;
    s_bad[lb] = 0;
  }
  __syncthreads();

  float v[CGX_SLOTS][8];
  for (int r = 0; r < nrounds; ++r) {
    cgx_load_round<DT>(x, ts, nv, nch, r, align, v);
    cgx_reduce_round<DT>(v, x, ts, nv, nch, r, bsize, s_kmn, s_kmx, s_bad);
  }
  __syncthreads();

  for (int lb = tid; lb < nbt; lb += CGX_BLOCK) {
    float unit, mn;
    cgx_finish_meta(s_kmn[lb], s_kmx[lb], s_bad[lb], levels, &unit, &mn);
    s_unit[lb] = unit;
    s_min[lb] = mn;
    cgx_put_f32(meta + 8 * (b0 + lb), unit);
    cgx_put_f32(meta + 8 * (b0 + lb) + 4, mn);
  }
  __syncthreads();

  for (int r = 0; r < nrounds; ++r) {
    if (nrounds > 1) cgx_load_round<DT>(x, ts, nv, nch, r, align, v);  // one round: still here
#pragma unroll
    for (int k = 0; k < CGX_SLOTS; ++k) {
      const cgx_i64 c = (cgx_i64)r * CGX_ROUND_CHUNKS + k * CGX_BLOCK + tid;
      if (c >= nch) break;
      const cgx_i64 o = 8 * c;
      const cgx_i64 i0 = ts + o;
      const int m = (int)cgx_min64(8, nv - o);
      cgx_i64 lb = cgx_div(o, bsize);
      cgx_i64 left = (lb + 1) * bsize - o;
      float unit = s_unit[lb], mn = s_min[lb];
      cgx_u64 word = 0;
      if (left >= m) {  // one bucket
        cgx_u32 q[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          q[j] = cgx_code(v[k][j], mn, unit, levels, stochastic, key, i0 + j);
          if (j < m) word |= (cgx_u64)q[j] << (j * bits);
        }
        if (dec) {
          float dv[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) dv[j] = __fadd_rn(mn, __fmul_rn(unit, (float)q[j]));
          cgx_store_chunk(dec, out_kind, i0, m, dvec, dv);
        }
      } else {  // across buckets: rolled, re-reading the values (see cgx_reduce_round)
        for (int j = 0; j < m; ++j) {
          if (left == 0) {
            ++lb;
            left = bsize;
            unit = s_unit[lb];
            mn = s_min[lb];
          }
          const cgx_i64 i = i0 + j;
          const cgx_u32 q = cgx_code(cgx_load<DT>(x, i), mn, unit, levels, stochastic, key, i);
          word |= (cgx_u64)q << (j * bits);
          if (dec) cgx_store_value(dec, out_kind, i, __fadd_rn(mn, __fmul_rn(unit, (float)q)));
          --left;
        }
      }
      cgx_u8* st = stage + (c - (cgx_i64)r * CGX_ROUND_CHUNKS) * bits;
      for (int q = 0; q < bits; ++q) st[q] = (cgx_u8)(word >> (8 * q));
    }
    __syncthreads();
    const cgx_i64 cfirst = (ts >> 3) + (cgx_i64)r * CGX_ROUND_CHUNKS;  // chunk of the segment
    const cgx_i64 clast = cgx_min64(cfirst + CGX_ROUND_CHUNKS, (ts >> 3) + nch);
    const cgx_i64 cb0 = cfirst * bits;
    const cgx_i64 cb1 = cgx_min64(clast * bits, code_nbytes);
    cgx_store_bytes(codes + cb0, stage, (int)(cb1 - cb0));
    __syncthreads();  // the stage is free again
  }
}

// RAW segment of a batched encode: the header and `raw_nbytes` bytes of values, one window
// of CGX_RAW_BLOCK_BYTES per block
__device__ void cgx_encode_raw(const cgx_enc_seg& d, cgx_i64 tile) {
  const int tid = (int)threadIdx.x;
  cgx_u8* buf = (cgx_u8*)d.buf;
  if (tile == 0 && tid == 0) cgx_put_header(buf, d.h0, d.h1, d.h2);
  const cgx_u8* src = (const cgx_u8*)d.x;
  cgx_u8* dst = buf + CGX_HEADER_NBYTES;
  const cgx_i64 w0 = tile * CGX_RAW_BLOCK_BYTES;
  const cgx_i64 w1 = cgx_min64(w0 + CGX_RAW_BLOCK_BYTES, d.raw_nbytes);
  for (cgx_i64 i = w0 + tid; i < w1; i += CGX_BLOCK) dst[i] = src[i];
}

// the index of the segment holding block b: the last one whose first block is <= b
template <class SEG>
__device__ __forceinline__ int cgx_find_segment(const SEG* segs, int nseg, cgx_i64 b) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (segs[mid].block0 <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <int DT>
__device__ __forceinline__ void cgx_encode_batch(const cgx_enc_seg* segs, int nseg,
                                                 const cgx_enc_seg& one) {
  const cgx_i64 b = blockIdx.x;
  const cgx_enc_seg d = segs ? segs[cgx_find_segment(segs, nseg, b)] : one;
  const cgx_i64 tile = b - d.block0;
  if (d.bits == 32) {
    cgx_encode_raw(d, tile);
  } else if (d.n == 0) {
    if (threadIdx.x == 0) cgx_put_header((cgx_u8*)d.buf, d.h0, d.h1, d.h2);
  } else {
    cgx_encode_tile<DT>(d, tile);
  }
}

// ---------------------------------------------------------------------------------------
// decode / decode_add: each warp takes 256 consecutive values, lane l the values
// base + l + 32 j (j < 8), so loads and stores of values are coalesced; a value's code is
// read from the one or two bytes holding its bits.

template <int OT, bool ADD>
__device__ __forceinline__ void cgx_decode_chunk(const cgx_u8* meta, const cgx_u8* codes,
                                                 cgx_i64 n, int bits, cgx_i64 bsize,
                                                 void* out, cgx_i64 w) {
  const cgx_u32 mask = (1u << bits) - 1u;
  const int lane = (int)threadIdx.x & (CGX_WARP - 1);
  const cgx_i64 base = w * (8 * CGX_WARP) + lane;
  cgx_i64 b = -1, bend = 0;
  float unit = 0.0f, mn = 0.0f;
  for (int j = 0; j < 8; ++j) {
    const cgx_i64 i = base + CGX_WARP * j;
    if (i >= n) break;
    if (i >= bend) {  // entered another bucket (bend starts at 0): one division
      b = cgx_div(i, bsize);
      bend = (b + 1) * bsize;
      unit = cgx_get_f32(meta + 8 * b);
      mn = cgx_get_f32(meta + 8 * b + 4);
    }
    const cgx_i64 bit = i * bits;
    const cgx_u8* p = codes + (bit >> 3);
    const int sh = (int)(bit & 7);
    cgx_u32 word = p[0];
    if (sh + bits > 8) word |= (cgx_u32)p[1] << 8;  // never reads past the last code byte
    const float c = (float)((word >> sh) & mask);
    cgx_store<OT, ADD>(out, i, __fadd_rn(mn, __fmul_rn(unit, c)));
  }
}

// grid-stride over 256-value chunks
template <int OT, bool ADD>
__device__ void cgx_decode(const cgx_u8* buf, cgx_i64 codes_off, cgx_i64 n, int bits,
                           cgx_i64 bsize, void* out) {
  const cgx_i64 warps_per_block = blockDim.x / CGX_WARP;
  const cgx_i64 nchunks = (n + 8 * CGX_WARP - 1) / (8 * CGX_WARP);
  const cgx_i64 stride = (cgx_i64)gridDim.x * warps_per_block;
  for (cgx_i64 w = (cgx_i64)blockIdx.x * warps_per_block + threadIdx.x / CGX_WARP; w < nchunks;
       w += stride) {
    cgx_decode_chunk<OT, ADD>(buf + CGX_HEADER_NBYTES, buf + codes_off, n, bits, bsize, out, w);
  }
}

// one RAW value: converted (or accumulated), or its bit pattern copied when the output has
// the payload's own type (a NaN keeps its payload, as a memcpy would)
template <int OT, bool ADD>
__device__ __forceinline__ void cgx_raw_value(const cgx_u8* src, int dt, bool aligned,
                                              cgx_i64 i, void* out) {
  if (!ADD && OT == dt) {
    if (dt == 0) {
      const cgx_u8* q = src + 4 * i;
      ((cgx_u32*)out)[i] = aligned ? ((const cgx_u32*)src)[i]
                                   : (cgx_u32)q[0] | ((cgx_u32)q[1] << 8) |
                                         ((cgx_u32)q[2] << 16) | ((cgx_u32)q[3] << 24);
    } else {
      const cgx_u8* q = src + 2 * i;
      ((cgx_u16*)out)[i] =
          aligned ? ((const cgx_u16*)src)[i] : (cgx_u16)((cgx_u32)q[0] | ((cgx_u32)q[1] << 8));
    }
    return;
  }
  float v;
  if (dt == 0) {
    v = aligned ? cgx_load<0>(src, i) : cgx_load_bytes<0>(src, i);
  } else if (dt == 1) {
    v = aligned ? cgx_load<1>(src, i) : cgx_load_bytes<1>(src, i);
  } else {
    v = aligned ? cgx_load<2>(src, i) : cgx_load_bytes<2>(src, i);
  }
  cgx_store<OT, ADD>(out, i, v);
}

// RAW payload (bits == 32): convert or accumulate element-wise, grid-stride
template <int DT, int OT, bool ADD, bool ALIGNED>
__device__ void cgx_raw(const cgx_u8* src, cgx_i64 n, void* out) {
  const cgx_i64 stride = (cgx_i64)gridDim.x * blockDim.x;
  for (cgx_i64 i = (cgx_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v = ALIGNED ? cgx_load<DT>(src, i) : cgx_load_bytes<DT>(src, i);
    cgx_store<OT, ADD>(out, i, v);
  }
}

// One segment of a batched decode (a row of its device array; field order: gpu.py's
// DEC_FIELDS).
struct cgx_dec_seg {
  cgx_u64 buf;         // address of the segment's first byte (its header)
  cgx_u64 out;         // address of its first output value
  cgx_u64 h0, h1, h2;  // the expected header, the stochastic flag cleared
  cgx_i64 n;
  cgx_i64 bits;        // 1..8, or 32: RAW
  cgx_i64 bsize;
  cgx_i64 codes_off;
  cgx_i64 block0;      // first block of the segment (CGX_DECODE_BLOCK_VALUES values each)
  cgx_i64 src_dt;      // RAW: the payload's dtype (0 float32, 1 float16, 2 bfloat16)
  cgx_i64 pad;
};

template <int OT, bool ADD>
__device__ void cgx_decode_batch(const cgx_dec_seg* segs, int nseg, int* status) {
  __shared__ int s_bad;
  const int tid = (int)threadIdx.x;
  if (tid == 0) s_bad = 0;
  __syncthreads();
  for (int s = tid; s < nseg; s += CGX_BLOCK) {
    const cgx_u8* p = (const cgx_u8*)segs[s].buf;
    cgx_u64 w[3] = {0ull, 0ull, 0ull};
    for (int q = 0; q < 24; ++q) w[q >> 3] |= (cgx_u64)p[q] << (8 * (q & 7));
    if ((w[0] & ~CGX_FLAGS_STOCHASTIC) != segs[s].h0 || w[1] != segs[s].h1 ||
        w[2] != segs[s].h2) {
      atomicOr(&s_bad, 1);
    }
  }
  __syncthreads();
  const int bad = s_bad;
  if (blockIdx.x == 0 && tid == 0) *status = bad;
  if (bad) return;  // every block saw the same headers: nothing is written anywhere

  const cgx_i64 b = blockIdx.x;
  const cgx_dec_seg d = segs[cgx_find_segment(segs, nseg, b)];
  const cgx_i64 lb = b - d.block0;
  const cgx_u8* buf = (const cgx_u8*)d.buf;
  void* out = (void*)d.out;
  if (d.bits == 32) {
    const int dt = (int)d.src_dt;
    const cgx_u8* src = buf + CGX_HEADER_NBYTES;
    const bool aligned = ((cgx_u64)src & (dt == 0 ? 3ull : 1ull)) == 0ull;
    const cgx_i64 i1 = cgx_min64((lb + 1) * CGX_DECODE_BLOCK_VALUES, d.n);
    for (cgx_i64 i = lb * CGX_DECODE_BLOCK_VALUES + tid; i < i1; i += CGX_BLOCK) {
      cgx_raw_value<OT, ADD>(src, dt, aligned, i, out);
    }
  } else {
    const cgx_i64 w = lb * (CGX_BLOCK / CGX_WARP) + tid / CGX_WARP;
    cgx_decode_chunk<OT, ADD>(buf + CGX_HEADER_NBYTES, buf + d.codes_off, d.n, (int)d.bits,
                              d.bsize, out, w);
  }
}

// ---------------------------------------------------------------------------------------
// entry points

// One kernel per value type serves both entry points (the encode body is compiled once
// per type): segs == 0 encodes the one segment the other arguments describe, else the
// nseg segments of the device array segs (the other arguments unused). Launch bounds: at
// most 80 registers a thread (the 32 values of a round and no spills to speak of), so
// 3 blocks, 24 warps and 96 KiB of loads in flight fit on an SM.
#define CGX_ENCODE_KERNEL(NAME, DT)                                                         \
  extern "C" __global__ void __launch_bounds__(CGX_BLOCK, 3)                                \
      NAME(const cgx_enc_seg* segs, int nseg, int out_kind, const void* x, cgx_i64 n,       \
           int bits, cgx_i64 bsize, int tile_buckets, int stochastic, cgx_u64 key,          \
           cgx_u8* buf, cgx_i64 codes_off, cgx_u64 h0, cgx_u64 h1, cgx_u64 h2,              \
           void* decoded) {                                                                 \
    cgx_enc_seg one;                                                                        \
    one.x = (cgx_u64)x;                                                                     \
    one.buf = (cgx_u64)buf;                                                                 \
    one.decoded = (cgx_u64)decoded;                                                         \
    one.key = key;                                                                          \
    one.n = n;                                                                              \
    one.bits = bits;                                                                        \
    one.bsize = bsize;                                                                      \
    one.tile_buckets = tile_buckets;                                                        \
    one.stochastic = stochastic;                                                            \
    one.codes_off = codes_off;                                                              \
    one.block0 = 0;                                                                         \
    one.raw_nbytes = 0;                                                                     \
    one.h0 = h0;                                                                            \
    one.h1 = h1;                                                                            \
    one.h2 = h2;                                                                            \
    one.out_kind = out_kind;                                                                \
    cgx_encode_batch<DT>(segs, nseg, one);                                                  \
  }

CGX_ENCODE_KERNEL(cgx_encode_f32, 0)
CGX_ENCODE_KERNEL(cgx_encode_f16, 1)
CGX_ENCODE_KERNEL(cgx_encode_bf16, 2)

#define CGX_DECODE_KERNEL(NAME, OT, ADD)                                                \
  extern "C" __global__ void NAME(const cgx_u8* buf, cgx_i64 codes_off, cgx_i64 n,      \
                                  int bits, cgx_i64 bsize, void* out) {                 \
    cgx_decode<OT, ADD>(buf, codes_off, n, bits, bsize, out);                           \
  }                                                                                     \
  extern "C" __global__ void NAME##_batch(const cgx_dec_seg* segs, int nseg, int* status) { \
    cgx_decode_batch<OT, ADD>(segs, nseg, status);                                      \
  }

CGX_DECODE_KERNEL(cgx_decode_f32, 0, false)
CGX_DECODE_KERNEL(cgx_decode_f16, 1, false)
CGX_DECODE_KERNEL(cgx_decode_bf16, 2, false)
CGX_DECODE_KERNEL(cgx_decode_f64, 3, false)
CGX_DECODE_KERNEL(cgx_decode_add, 0, true)

#define CGX_RAW_KERNEL(NAME, DT, OT, ADD, ALIGNED)                                      \
  extern "C" __global__ void NAME(const cgx_u8* src, cgx_i64 n, void* out) {           \
    cgx_raw<DT, OT, ADD, ALIGNED>(src, n, out);                                         \
  }

#define CGX_RAW_KERNELS(SRC, DT)                                      \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_f32_a, DT, 0, false, true)           \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_f16_a, DT, 1, false, true)           \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_bf16_a, DT, 2, false, true)          \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_f64_a, DT, 3, false, true)           \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_add_a, DT, 0, true, true)            \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_f32_u, DT, 0, false, false)          \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_f16_u, DT, 1, false, false)          \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_bf16_u, DT, 2, false, false)         \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_f64_u, DT, 3, false, false)          \
  CGX_RAW_KERNEL(cgx_raw_##SRC##_add_u, DT, 0, true, false)

CGX_RAW_KERNELS(f32, 0)
CGX_RAW_KERNELS(f16, 1)
CGX_RAW_KERNELS(bf16, 2)

extern "C" __global__ void cgx_write_header(cgx_u8* buf, cgx_u64 h0, cgx_u64 h1, cgx_u64 h2) {
  if (blockIdx.x == 0 && threadIdx.x == 0) cgx_put_header(buf, h0, h1, h2);
}
