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
// message), so the header, meta and codes are accessed byte-wise; the values and outputs
// are the caller's arrays (naturally aligned).
//
// Kernels (all extern "C", names prefixed cgx_):
//   cgx_encode_{f32,f16,bf16}     one block per tile of buckets: min/max per bucket
//                                 (warp per bucket, or the whole block for big buckets),
//                                 then quantize + pack 8 values per thread (8 codes are
//                                 exactly `bits` bytes); block 0 also writes the header.
//   cgx_decode_{f32,f16,bf16,f64} grid-stride, a warp per 256 values (coalesced).
//   cgx_decode_add                acc[i] = acc[i] + decoded value (float32), fused.
//   cgx_raw_{f32,f16,bf16}_{f32,f16,bf16,f64,add}_{a,u}
//                                 RAW (bits == 32) payload conversion / accumulation;
//                                 _a when the payload is aligned to its element, _u when not.
//   cgx_write_header              the header alone (empty and RAW segments).
//
// float16 / bfloat16 travel as their 16-bit patterns and are converted here exactly as in
// cpu.py (float32 -> half: round half to even; NaN stays NaN).

#define CGX_BLOCK 256
#define CGX_WARP 32
#define CGX_MAX_TILE_BUCKETS 512
#define CGX_FULL_MASK 0xFFFFFFFFu
#define CGX_HEADER_NBYTES 24

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

// 8 values from x + i0 (16-byte aligned): two float4, or one uint4 of 16-bit patterns
template <int DT>
__device__ __forceinline__ void cgx_load8(const void* x, cgx_i64 i0, float* v) {
  if (DT == 0) {
    const float4* p = (const float4*)((const float*)x + i0);
    const float4 a = p[0], b = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 a = *(const uint4*)((const cgx_u16*)x + i0);
    const cgx_u32 w[4] = {a.x, a.y, a.z, a.w};
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = DT == 1 ? cgx_f16_to_f32(w[k] & 0xFFFFu) : cgx_bf16_to_f32(w[k] & 0xFFFFu);
      v[2 * k + 1] = DT == 1 ? cgx_f16_to_f32(w[k] >> 16) : cgx_bf16_to_f32(w[k] >> 16);
    }
  }
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
// encode: one block per tile of `tile_buckets` buckets (a multiple of 8 values from the
// start, so tiles own whole code bytes)

template <int DT>
__device__ void cgx_encode(const void* x, cgx_i64 n, int bits, cgx_i64 bsize, int tile_buckets,
                           int stochastic, cgx_u64 key, cgx_u8* buf, cgx_i64 codes_off,
                           cgx_u64 h0, cgx_u64 h1, cgx_u64 h2) {
  __shared__ float s_unit[CGX_MAX_TILE_BUCKETS];
  __shared__ float s_min[CGX_MAX_TILE_BUCKETS];
  __shared__ int s_red[3 * (CGX_BLOCK / CGX_WARP)];

  const int tid = (int)threadIdx.x;
  const int lane = tid & (CGX_WARP - 1);
  const int warp = tid / CGX_WARP;
  const int nwarps = (int)blockDim.x / CGX_WARP;
  const cgx_i64 nbuckets = (n + bsize - 1) / bsize;
  const cgx_i64 b0 = (cgx_i64)blockIdx.x * tile_buckets;
  const int nbt = (int)(cgx_min64(b0 + tile_buckets, nbuckets) - b0);
  const cgx_i64 ts = b0 * bsize;
  const cgx_i64 te = cgx_min64((b0 + nbt) * bsize, n);
  const float levels = (float)((1 << bits) - 1);
  cgx_u8* meta = buf + CGX_HEADER_NBYTES;
  cgx_u8* codes = buf + codes_off;

  if (blockIdx.x == 0 && tid == 0) cgx_put_header(buf, h0, h1, h2);

  // phase 1: (unit, min) of every bucket of the tile into shared memory and the buffer
  if (nbt >= nwarps) {  // small buckets: one warp per bucket
    for (int lb = warp; lb < nbt; lb += nwarps) {
      const cgx_i64 s = ts + (cgx_i64)lb * bsize;
      const cgx_i64 e = cgx_min64(s + bsize, n);
      int kmn = 0x7FFFFFFF, kmx = -0x7FFFFFFF - 1, bad = 0;
      for (cgx_i64 i = s + lane; i < e; i += CGX_WARP) {
        float v = cgx_load<DT>(x, i);
        int k = cgx_key(__float_as_int(v));
        kmn = cgx_mini(kmn, k);
        kmx = cgx_maxi(kmx, k);
        bad |= cgx_nonfinite(v) ? 1 : 0;
      }
      for (int m = CGX_WARP / 2; m > 0; m >>= 1) {
        kmn = cgx_mini(kmn, __shfl_xor_sync(CGX_FULL_MASK, kmn, m));
        kmx = cgx_maxi(kmx, __shfl_xor_sync(CGX_FULL_MASK, kmx, m));
        bad |= __shfl_xor_sync(CGX_FULL_MASK, bad, m);
      }
      if (lane == 0) {
        float unit, mn;
        cgx_finish_meta(kmn, kmx, bad, levels, &unit, &mn);
        s_unit[lb] = unit;
        s_min[lb] = mn;
        cgx_put_f32(meta + 8 * (b0 + lb), unit);
        cgx_put_f32(meta + 8 * (b0 + lb) + 4, mn);
      }
    }
  } else {  // big buckets: the whole block reduces one bucket at a time
    for (int lb = 0; lb < nbt; ++lb) {
      const cgx_i64 s = ts + (cgx_i64)lb * bsize;
      const cgx_i64 e = cgx_min64(s + bsize, n);
      int kmn = 0x7FFFFFFF, kmx = -0x7FFFFFFF - 1, bad = 0;
      for (cgx_i64 i = s + tid; i < e; i += blockDim.x) {
        float v = cgx_load<DT>(x, i);
        int k = cgx_key(__float_as_int(v));
        kmn = cgx_mini(kmn, k);
        kmx = cgx_maxi(kmx, k);
        bad |= cgx_nonfinite(v) ? 1 : 0;
      }
      for (int m = CGX_WARP / 2; m > 0; m >>= 1) {
        kmn = cgx_mini(kmn, __shfl_xor_sync(CGX_FULL_MASK, kmn, m));
        kmx = cgx_maxi(kmx, __shfl_xor_sync(CGX_FULL_MASK, kmx, m));
        bad |= __shfl_xor_sync(CGX_FULL_MASK, bad, m);
      }
      if (lane == 0) {
        s_red[3 * warp] = kmn;
        s_red[3 * warp + 1] = kmx;
        s_red[3 * warp + 2] = bad;
      }
      __syncthreads();
      if (tid == 0) {
        for (int w = 1; w < nwarps; ++w) {
          kmn = cgx_mini(kmn, s_red[3 * w]);
          kmx = cgx_maxi(kmx, s_red[3 * w + 1]);
          bad |= s_red[3 * w + 2];
        }
        float unit, mn;
        cgx_finish_meta(kmn, kmx, bad, levels, &unit, &mn);
        s_unit[lb] = unit;
        s_min[lb] = mn;
        cgx_put_f32(meta + 8 * (b0 + lb), unit);
        cgx_put_f32(meta + 8 * (b0 + lb) + 4, mn);
      }
      __syncthreads();
    }
  }
  __syncthreads();

  // phase 2: 8 values per thread -> one 64-bit word -> `bits` bytes (tile values are hot);
  // 16-byte vector loads when the values are 16-byte aligned (i0 is a multiple of 8)
  const bool vec = ((unsigned long long)x & 15ull) == 0ull;
  const cgx_i64 ngroups = (te - ts + 7) / 8;
  for (cgx_i64 g = tid; g < ngroups; g += blockDim.x) {
    const cgx_i64 i0 = ts + 8 * g;
    const int m = (int)cgx_min64(8, te - i0);
    float v[8];
    if (vec && m == 8) {
      cgx_load8<DT>(x, i0, v);
    } else {
      for (int j = 0; j < m; ++j) v[j] = cgx_load<DT>(x, i0 + j);
    }
    int lb = (int)((i0 - ts) / bsize);
    cgx_i64 bend = ts + (cgx_i64)(lb + 1) * bsize;
    float unit = s_unit[lb], mn = s_min[lb];
    cgx_u64 word = 0;
    for (int j = 0; j < m; ++j) {
      const cgx_i64 i = i0 + j;
      while (i >= bend) {  // the group crosses into the next bucket
        ++lb;
        bend += bsize;
        unit = s_unit[lb];
        mn = s_min[lb];
      }
      cgx_u32 c = cgx_code(v[j], mn, unit, levels, stochastic, key, i);
      word |= (cgx_u64)c << (j * bits);
    }
    cgx_u8* dst = codes + (i0 / 8) * bits;
    const int nbytes = (m * bits + 7) / 8;
    for (int q = 0; q < nbytes; ++q) dst[q] = (cgx_u8)(word >> (8 * q));
  }
}

// ---------------------------------------------------------------------------------------
// decode / decode_add: each warp takes 256 consecutive values, lane l the values
// base + l + 32 j (j < 8), so loads and stores of values are coalesced; a value's code is
// read from the one or two bytes holding its bits. Grid-stride over 256-value chunks.

template <int OT, bool ADD>
__device__ void cgx_decode(const cgx_u8* buf, cgx_i64 codes_off, cgx_i64 n, int bits,
                           cgx_i64 bsize, void* out) {
  const cgx_u8* meta = buf + CGX_HEADER_NBYTES;
  const cgx_u8* codes = buf + codes_off;
  const cgx_u32 mask = (1u << bits) - 1u;
  const int lane = (int)threadIdx.x & (CGX_WARP - 1);
  const cgx_i64 warps_per_block = blockDim.x / CGX_WARP;
  const cgx_i64 nchunks = (n + 8 * CGX_WARP - 1) / (8 * CGX_WARP);
  const cgx_i64 stride = (cgx_i64)gridDim.x * warps_per_block;
  for (cgx_i64 w = (cgx_i64)blockIdx.x * warps_per_block + threadIdx.x / CGX_WARP; w < nchunks;
       w += stride) {
    const cgx_i64 base = w * (8 * CGX_WARP) + lane;
    cgx_i64 b = -1, bend = 0;
    float unit = 0.0f, mn = 0.0f;
    for (int j = 0; j < 8; ++j) {
      const cgx_i64 i = base + CGX_WARP * j;
      if (i >= n) break;
      if (i >= bend) {  // entered another bucket (bend starts at 0): one division
        b = i / bsize;
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

// ---------------------------------------------------------------------------------------
// entry points

#define CGX_ENCODE_KERNEL(NAME, DT)                                                           \
  extern "C" __global__ void __launch_bounds__(CGX_BLOCK)                                     \
      NAME(const void* x, cgx_i64 n, int bits, cgx_i64 bsize, int tile_buckets,               \
           int stochastic, cgx_u64 key, cgx_u8* buf, cgx_i64 codes_off, cgx_u64 h0,          \
           cgx_u64 h1, cgx_u64 h2) {                                                          \
    cgx_encode<DT>(x, n, bits, bsize, tile_buckets, stochastic, key, buf, codes_off, h0, h1, \
                   h2);                                                                       \
  }

CGX_ENCODE_KERNEL(cgx_encode_f32, 0)
CGX_ENCODE_KERNEL(cgx_encode_f16, 1)
CGX_ENCODE_KERNEL(cgx_encode_bf16, 2)

#define CGX_DECODE_KERNEL(NAME, OT, ADD)                                                \
  extern "C" __global__ void NAME(const cgx_u8* buf, cgx_i64 codes_off, cgx_i64 n,      \
                                  int bits, cgx_i64 bsize, void* out) {                 \
    cgx_decode<OT, ADD>(buf, codes_off, n, bits, bsize, out);                           \
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
