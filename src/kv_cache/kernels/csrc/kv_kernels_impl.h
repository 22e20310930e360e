// Per-ISA kernel bodies of kv_kernels.cpp. This file is included three times, inside
// `namespace kvk::generic` (KVK_ISA 0: portable C++, any x86_64), `kvk::avx2` (KVK_ISA 1,
// under `#pragma GCC target("avx2,fma,f16c")`) and `kvk::avx512` (KVK_ISA 2, AVX-512
// F/BW/DQ/VL); kv_kernels.cpp picks one at run time from the CPU's feature bits. Everything
// here is single-threaded: one call processes one work item (a row chunk or a group); threads
// are spread over items by kv_kernels.cpp. Math: math_dictionary/kv-compression-math.md §15.
//
// Buffers of decoded values are padded to a multiple of kPad floats per token so the
// vector loops never need a tail; the padding is zero and stays zero.

// ============================================================================= vectors
// One set of wrappers per ISA, alike in shape: the same names over each ISA's own intrinsics
// (AVX-512, AVX2, portable loops), so that the kernels below are written once against them.
#if KVK_ISA == 2
constexpr int W = 16;
typedef __m512 vf;
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// lanes j <- x[idx[j]] (the Hadamard passes inside a vector, fwht_row)
static inline vf vperm(vf x, const int32_t* idx) {
  return _mm512_permutexvar_ps(_mm512_loadu_si512(reinterpret_cast<const void*>(idx)), x);
}
static inline __m256 fold256(vf a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
static inline float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline float vhmin(vf v) { return _mm512_reduce_min_ps(v); }
static inline void vhsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold256(a0), fold256(a1)), _mm256_hadd_ps(fold256(a2), fold256(a3)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
// exp for x <= 0 (Cephes expf polynomial, ~2 ulp); inputs below -87.3 give ~1e-38, not 0
static inline vf vexp(vf x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}
// W floats holding integers in [0, 255] -> W bytes
static inline void vstore_u8(uint8_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtusepi32_epi8(_mm512_cvttps_epi32(v)));
}
#elif KVK_ISA == 1
constexpr int W = 8;
typedef __m256 vf;
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vperm(vf x, const int32_t* idx) {
  return _mm256_permutevar8x32_ps(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)));
}
static inline float vhsum(vf v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
static inline float vhmax(vf v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
static inline float vhmin(vf v) {
  __m128 a = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_min_ps(a, _mm_movehl_ps(a, a));
  a = _mm_min_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
static inline void vhsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
static inline vf vexp(vf x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
static inline void vstore_u8(uint8_t* p, vf v) {
  __m256i i = _mm256_cvttps_epi32(v);
  __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}
#else
constexpr int W = 1;
typedef float vf;
static inline vf vload(const float* p) { return *p; }
static inline void vstore(float* p, vf v) { *p = v; }
static inline vf vset1(float x) { return x; }
static inline vf vzero() { return 0.0f; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vmin(vf a, vf b) { return b < a ? b : a; }
static inline vf vmax(vf a, vf b) { return b > a ? b : a; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vround(vf a) { return std::nearbyint(a); }
static inline vf vperm(vf x, const int32_t*) { return x; }
static inline float vhsum(vf v) { return v; }
static inline float vhmax(vf v) { return v; }
static inline float vhmin(vf v) { return v; }
static inline void vhsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
  out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}
static inline vf vexp(vf x) { return std::exp(x); }
static inline void vstore_u8(uint8_t* p, vf v) { *p = static_cast<uint8_t>(v); }
#endif

// ============================================================================= conversions
#if KVK_ISA >= 1
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else
static inline float h2f(uint16_t h) { return f16_to_f32(h); }
static inline uint16_t f2h(float f) { return f32_to_f16(f); }
#endif

// W consecutive elements of a float32 / float16 / bfloat16 array as float32
template <DT XDT>
static inline vf xload(const void* base, int64_t i) {
#if KVK_ISA == 2
  if (XDT == DT_F32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  if (XDT == DT_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif KVK_ISA == 1
  if (XDT == DT_F32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  if (XDT == DT_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  if (XDT == DT_F32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return XDT == DT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
#endif
}

template <DT XDT>
static inline float xload1(const void* base, int64_t i) {
  if (XDT == DT_F32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return XDT == DT_F16 ? h2f(h) : bf16_to_f32(h);
}

// out[i] = v rounded (to nearest even) to dt, for the W lanes of v at out + i
static inline void vstore_as(void* out, int64_t i, vf v, DT dt) {
#if KVK_ISA == 2
  if (dt == DT_F32) {
    _mm512_storeu_ps(static_cast<float*>(out) + i, v);
  } else if (dt == DT_F16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), _mm512_cvtepi32_epi16(u));
  }
#elif KVK_ISA == 1
  if (dt == DT_F32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, v);
  } else if (dt == DT_F16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
  }
#else
  if (dt == DT_F32)
    static_cast<float*>(out)[i] = v;
  else if (dt == DT_F16)
    static_cast<uint16_t*>(out)[i] = f32_to_f16(v);
  else
    static_cast<uint16_t*>(out)[i] = f32_to_bf16(v);
#endif
}

static inline void store_as1(void* out, int64_t i, float v, DT dt) {
  if (dt == DT_F32)
    static_cast<float*>(out)[i] = v;
  else if (dt == DT_F16)
    static_cast<uint16_t*>(out)[i] = f2h(v);
  else
    static_cast<uint16_t*>(out)[i] = f32_to_bf16(v);
}

// dst[0..n) = m[off .. off + n) as float32 (DT_NONE reads as zeros). Metadata is at most 1/8
// of the codes, so it is converted here, a tile or a group at a time, not in a separate pass.
static inline void meta_load(const Meta& m, int64_t off, int64_t n, float* dst) {
  int64_t i = 0;
  switch (m.dt) {
    case DT_F32: std::memcpy(dst, static_cast<const float*>(m.p) + off, sizeof(float) * n); return;
    case DT_F16:
      for (; i + W <= n; i += W) vstore(dst + i, xload<DT_F16>(m.p, off + i));
      for (; i < n; ++i) dst[i] = h2f(static_cast<const uint16_t*>(m.p)[off + i]);
      return;
    case DT_BF16:
      for (; i + W <= n; i += W) vstore(dst + i, xload<DT_BF16>(m.p, off + i));
      for (; i < n; ++i) dst[i] = bf16_to_f32(static_cast<const uint16_t*>(m.p)[off + i]);
      return;
    case DT_I16: {
      const int16_t* s = static_cast<const int16_t*>(m.p) + off;
      for (; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DT_I8: {
      const int8_t* s = static_cast<const int8_t*>(m.p) + off;
      for (; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DT_U8: {
      const uint8_t* s = static_cast<const uint8_t*>(m.p) + off;
      if (m.table) {
        for (; i < n; ++i) dst[i] = m.table[s[i]];
      } else {
        for (; i < n; ++i) dst[i] = s[i];
      }
      return;
    }
    default: std::fill(dst, dst + n, 0.0f);
  }
}

// ============================================================================= codes
// Scale applied while decoding: none, one factor for the whole token (f[0]), or one factor
// per W-channel chunk (f[c / W]; the caller guarantees it is constant over each chunk).
enum DecodeScale : int { kNoScale = 0, kTokenScale = 1, kChunkScale = 2 };

// dst[c] = lut[code_c] * factor, c < d, for the d codes of one token packed at p (packing.py
// layout). Offset tables (lut[i] = i + beta: every uniform table) are decoded by integer
// conversion instead of a table lookup where that is cheaper.
template <int MODE>
static inline __attribute__((always_inline)) void decode_row_t(const uint8_t* p, int d, int bits, const Lut& lut,
                                                               const float* f, float* dst) {
  int c = 0;
  const float* cs = f;
#if KVK_ISA == 2
  const __m512 lut16 = _mm512_loadu_ps(lut.v);
  auto put = [&](int at, __m512 v) {
    if (MODE == kTokenScale) v = _mm512_mul_ps(v, _mm512_set1_ps(f[0]));
    if (MODE == kChunkScale) v = _mm512_mul_ps(v, _mm512_set1_ps(cs[at / 16]));
    _mm512_storeu_ps(dst + at, v);
  };
  if (bits == 4) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (; c + 32 <= d; c += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c / 2));
      const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
      put(c, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut16));
      put(c + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), lut16));
    }
    for (; c + 16 <= d; c += 16) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c / 2));
      const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
      put(c, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut16));
    }
  } else if (bits == 2) {
    const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i m = _mm512_set1_epi32(3);
    for (; c + 16 <= d; c += 16) {
      uint32_t w;
      std::memcpy(&w, p + c / 4, 4);
      const __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)), sh), m);
      put(c, _mm512_permutexvar_ps(idx, lut16));
    }
  } else if (bits == 3) {  // 16 codes = 48 bits: qword lane i holds codes 2i, 2i+1 at its bottom
    const __m512i sh64 = _mm512_setr_epi64(0, 6, 12, 18, 24, 30, 36, 42);
    const __m512i sh32 = _mm512_setr_epi32(0, 3, 0, 3, 0, 3, 0, 3, 0, 3, 0, 3, 0, 3, 0, 3);
    const __m512i m = _mm512_set1_epi32(7);
    for (; c + 16 <= d; c += 16) {
      uint32_t lo;
      uint16_t hi;  // two loads combined in registers (one 6-byte copy would stall store forwarding)
      std::memcpy(&lo, p + 3 * (c / 8), 4);
      std::memcpy(&hi, p + 3 * (c / 8) + 4, 2);
      const uint64_t w = lo | (static_cast<uint64_t>(hi) << 32);
      __m512i x = _mm512_srlv_epi64(_mm512_set1_epi64(static_cast<long long>(w)), sh64);
      x = _mm512_shuffle_epi32(x, _MM_PERM_CCAA);  // low dword of each qword into both halves
      put(c, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(x, sh32), m), lut16));
    }
  } else if (lut.offset) {
    const __m512 beta = _mm512_set1_ps(lut.beta);
    for (; c + 16 <= d; c += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c)));
      put(c, _mm512_add_ps(_mm512_cvtepi32_ps(idx), beta));
    }
  } else {
    for (; c + 16 <= d; c += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c)));
      put(c, _mm512_i32gather_ps(idx, lut.v, 4));
    }
  }
#elif KVK_ISA == 1
  auto put = [&](int at, __m256 v) {
    if (MODE == kTokenScale) v = _mm256_mul_ps(v, _mm256_set1_ps(f[0]));
    if (MODE == kChunkScale) v = _mm256_mul_ps(v, _mm256_set1_ps(cs[at / 8]));
    _mm256_storeu_ps(dst + at, v);
  };
  auto put4 = [&](int at, __m128i bitsv) {
    __m128 v = _mm_castsi128_ps(bitsv);
    if (MODE == kTokenScale) v = _mm_mul_ps(v, _mm_set1_ps(f[0]));
    if (MODE == kChunkScale) v = _mm_mul_ps(v, _mm_set1_ps(cs[at / 8]));
    _mm_storeu_ps(dst + at, v);
  };
  // 2 and 4 bits: 16 codes -> 16 byte indices -> 4 in-lane byte shuffles of the table's byte
  // planes (Lut::planes), interleaved back into floats: exact, and several times faster than
  // two lane-crossing vpermps on cores that split 256-bit permutes (Zen 1).
  if (bits == 4 || bits == 2) {
    const __m128i P0 = _mm_load_si128(reinterpret_cast<const __m128i*>(lut.planes[0]));
    const __m128i P1 = _mm_load_si128(reinterpret_cast<const __m128i*>(lut.planes[1]));
    const __m128i P2 = _mm_load_si128(reinterpret_cast<const __m128i*>(lut.planes[2]));
    const __m128i P3 = _mm_load_si128(reinterpret_cast<const __m128i*>(lut.planes[3]));
    auto put16 = [&](int at, __m128i idx) {
      const __m128i b0 = _mm_shuffle_epi8(P0, idx), b1 = _mm_shuffle_epi8(P1, idx);
      const __m128i b2 = _mm_shuffle_epi8(P2, idx), b3 = _mm_shuffle_epi8(P3, idx);
      const __m128i lo01 = _mm_unpacklo_epi8(b0, b1), hi01 = _mm_unpackhi_epi8(b0, b1);
      const __m128i lo23 = _mm_unpacklo_epi8(b2, b3), hi23 = _mm_unpackhi_epi8(b2, b3);
      put4(at, _mm_unpacklo_epi16(lo01, lo23));
      put4(at + 4, _mm_unpackhi_epi16(lo01, lo23));
      put4(at + 8, _mm_unpacklo_epi16(hi01, hi23));
      put4(at + 12, _mm_unpackhi_epi16(hi01, hi23));
    };
    if (bits == 4) {  // byte k holds codes 2k (low nibble) and 2k + 1
      const __m128i m4 = _mm_set1_epi8(0x0F);
      for (; c + 32 <= d; c += 32) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c / 2));
        const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
        put16(c, _mm_unpacklo_epi8(lo, hi));
        put16(c + 16, _mm_unpackhi_epi8(lo, hi));
      }
      for (; c + 16 <= d; c += 16) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c / 2));
        put16(c, _mm_unpacklo_epi8(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4)));
      }
    } else if (bits == 2) {  // byte k holds codes 4k..4k+3: each byte to 4 lanes, masked, shifted
      const __m128i rep = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
      const __m128i mask = _mm_set1_epi32(static_cast<int>(0xC0300C03u)), m4 = _mm_set1_epi8(0x0F);
      for (; c + 16 <= d; c += 16) {
        int32_t w;
        std::memcpy(&w, p + c / 4, 4);
        const __m128i a = _mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128(w), rep), mask);
        // lanes 4k, 4k+1: the code at bits 0-1 / 2-3; lanes 4k+2, 4k+3: moved down from bits 4-7
        put16(c, _mm_or_si128(_mm_and_si128(a, m4), _mm_and_si128(_mm_srli_epi16(a, 4), m4)));
      }
    }
  }
  if (bits == 4) {  // 2 and 4 bits: a tail of 8 codes
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m = _mm256_set1_epi32(15);
    if (lut.offset) {
      const __m256 beta = _mm256_set1_ps(lut.beta);
      for (; c + 8 <= d; c += 8) {
        uint32_t w;
        std::memcpy(&w, p + c / 2, 4);
        const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), m);
        put(c, _mm256_add_ps(_mm256_cvtepi32_ps(idx), beta));
      }
    } else {
      const __m256 lo = _mm256_loadu_ps(lut.v), hi = _mm256_loadu_ps(lut.v + 8);
      for (; c + 8 <= d; c += 8) {
        uint32_t w;
        std::memcpy(&w, p + c / 2, 4);
        const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), m);
        const __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
        put(c, _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28))));
      }
    }
  } else if (bits == 2) {
    const __m256 lo = _mm256_loadu_ps(lut.v);
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), m = _mm256_set1_epi32(3);
    for (; c + 8 <= d; c += 8) {
      uint16_t w;
      std::memcpy(&w, p + c / 4, 2);
      const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), m);
      put(c, _mm256_permutevar8x32_ps(lo, idx));
    }
  } else if (bits == 3) {
    const __m256 lo = _mm256_loadu_ps(lut.v);
    const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), m = _mm256_set1_epi32(7);
    for (; c + 8 <= d; c += 8) {
      const uint8_t* b = p + 3 * (c / 8);
      const int w = b[0] | (b[1] << 8) | (b[2] << 16);
      put(c, _mm256_permutevar8x32_ps(lo, _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), m)));
    }
  } else if (lut.offset) {
    const __m256 beta = _mm256_set1_ps(lut.beta);
    for (; c + 8 <= d; c += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)));
      put(c, _mm256_add_ps(_mm256_cvtepi32_ps(idx), beta));
    }
  } else {
    for (; c + 8 <= d; c += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)));
      put(c, _mm256_i32gather_ps(lut.v, idx, 4));
    }
  }
#endif
  auto factor = [&](int at) { return MODE == kTokenScale ? f[0] : MODE == kChunkScale ? cs[at / W] : 1.0f; };
  if (bits == 4) {  // generic path and tails: one byte = two codes
    for (; c + 2 <= d; c += 2) {
      const uint8_t b = p[c / 2];
      dst[c] = MODE == kNoScale ? lut.v[b & 15] : lut.v[b & 15] * factor(c);
      dst[c + 1] = MODE == kNoScale ? lut.v[b >> 4] : lut.v[b >> 4] * factor(c + 1);
    }
  }
  for (; c < d; ++c) dst[c] = MODE == kNoScale ? lut.v[code_at(p, c, bits)] : lut.v[code_at(p, c, bits)] * factor(c);
}

static inline void decode_row(const uint8_t* p, int d, int bits, const Lut& lut, float* dst) {
  decode_row_t<kNoScale>(p, d, bits, lut, nullptr, dst);
}

// Rows t < nt of a tile (stride ldt) from the tokens packed at codes (stride P bytes):
// dst[t][c] = lut[code] * factor, the factor of token t being f + t * fstride (see MODE).
template <int MODE>
static void decode_tile(const uint8_t* codes, int64_t P, int nt, int d, int bits, const Lut& lut, const float* f,
                        int fstride, float* dst, int ldt) {
  for (int t = 0; t < nt; ++t)
    decode_row_t<MODE>(codes + t * P, d, bits, lut, MODE == kNoScale ? nullptr : f + t * fstride,
                       dst + static_cast<int64_t>(t) * ldt);
}

// Pack d code bytes (values < 2**bits) into the token's bytes (packing.py layout).
static inline void pack_row(const uint8_t* q, int d, int bits, uint8_t* out) {
  int c = 0;
  if (bits == 8) {
    std::memcpy(out, q, d);
    return;
  }
#if KVK_ISA == 2
  if (bits == 3) {  // 8 codes -> 24 bits: q0 + 8 q1 + 64 q2 + 512 q3 per dword, two dwords per qword
    const __m512i k1 = _mm512_set1_epi16(0x0801), k2 = _mm512_set1_epi32(0x00400001);
    const __m512i lo12 = _mm512_set1_epi64(0xFFF), hi12 = _mm512_set1_epi64(0xFFF000);
    const __m256i pick = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                          0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    for (; c + 64 <= d; c += 64) {
      const __m512i w = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_loadu_si512(q + c), k1), k2);
      const __m512i x = _mm512_or_si512(_mm512_and_si512(w, lo12), _mm512_and_si512(_mm512_srli_epi64(w, 20), hi12));
      const __m256i y = _mm256_shuffle_epi8(_mm512_cvtepi64_epi32(x), pick);  // 12 bytes per lane
      uint8_t* o = out + 3 * (c / 8);
      _mm_mask_storeu_epi8(o, 0x0FFF, _mm256_castsi256_si128(y));
      _mm_mask_storeu_epi8(o + 12, 0x0FFF, _mm256_extracti128_si256(y, 1));
    }
  }
#endif
#if KVK_ISA >= 1
  if (bits == 4) {  // pairs (q0 + 16 q1) by a multiply-add of bytes, then narrow
    const __m256i k = _mm256_set1_epi16(0x1001);
    for (; c + 32 <= d; c += 32) {
      const __m256i w = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c)), k);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c / 2),
                       _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
    }
  } else if (bits == 2) {  // (q0 + 4 q1) + 16 (q2 + 4 q3)
    const __m256i k1 = _mm256_set1_epi16(0x0401), k2 = _mm256_set1_epi32(0x00100001);
    for (; c + 32 <= d; c += 32) {
      const __m256i w = _mm256_madd_epi16(
          _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c)), k1), k2);
      const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c / 4), _mm_packus_epi16(h, h));
    }
  }
#endif
  pack_tail(q, c, d, bits, out);
}

// ============================================================================= quantize
// Stored-scale conversion of the quantizer: store in sdt, read back as float32.
static inline float store_scale(const QuantArgs& a, int64_t off, float s) {
  switch (a.sdt) {
    case DT_F16: {
      const uint16_t h = f2h(s);
      static_cast<uint16_t*>(a.scale)[off] = h;
      return h2f(h);
    }
    case DT_BF16: {
      const uint16_t h = f32_to_bf16(s);
      static_cast<uint16_t*>(a.scale)[off] = h;
      return bf16_to_f32(h);
    }
    default:
      static_cast<float*>(a.scale)[off] = s;
      return s;
  }
}

// Uniform scale and zero point of one group, exactly as kv_cache.compression.quantizer.quantize
// computes them (float32 statistics, SCALE_FLOOR, zero-point guard, constant groups). The
// zero point returned includes the symmetric code offset 2**(b-1), so every code is
// clamp(round(x / s) + zp, qlo, qhi). Returns false (status set) when sdt cannot hold the scale.
static inline bool uniform_scale(const QuantArgs& a, float mn, float mx, int64_t off, float& s_used, float& zp) {
  const float amax = std::max(std::fabs(mn), std::fabs(mx));
  const bool constant = (mn == mx) && (amax > 0.0f);
  float s;
  if (a.symmetric) {
    s = std::max(amax, 1e-8f) / a.qmax;
  } else {
    s = std::max(mx - mn, 1e-8f) / a.qmax;  // qmax - qmin with qmin = 0
    s = std::max(s, amax * 0x1p-14f);
  }
  if (constant) s = amax;
  if (amax == 0.0f) s = 1.0f;  // an all-zero group: any scale codes it exactly; 1 fits every scale dtype
  if (a.sdt == DT_F16) s = std::max(s, 0x1p-24f);  // float16's smallest: a tiny group's scale stays nonzero
  const float back = store_scale(a, off, s);
  if (a.sdt != DT_F32 && (!std::isfinite(back) || back == 0.0f)) {
    a.status->store(kScaleUnrepresentable);
    return false;
  }
  s_used = back;
  if (a.symmetric) {
    zp = a.sym_offset;
  } else {
    zp = std::nearbyint(0.0f - mn / s_used);
    a.zero[off] = static_cast<int16_t>(zp);
  }
  return true;
}

// Codebook scale: RMS of the group (sum of squares in float64), stored in sdt. A zero stored
// scale is allowed (the group dequantizes to 0); a non-finite one is an error.
// The passes of fwht_row inside a vector: for h = 1, 2, ..., W/2, lane j takes
// x[j ^ h] + sign * x[j] (sign -1 where bit h of j is set): one permute and one FMA each.
struct HadamardLanes {
  int32_t idx[5][16];
  float sgn[5][16];
  int passes = 0;
  HadamardLanes() {
    for (int h = 1; h < W && passes < 5; h <<= 1, ++passes)
      for (int j = 0; j < W; ++j) {
        idx[passes][j] = j ^ h;
        sgn[passes][j] = (j & h) ? -1.0f : 1.0f;
      }
  }
};

// x[0..d) <- x H (unnormalized Sylvester order, d a power of two): log2(d) butterfly passes,
// those inside a W-lane vector as permutes (HadamardLanes).
static inline void fwht_row(float* x, int d, const HadamardLanes& hl) {
  int h0 = 1;
  if (W > 1 && d >= W) {
    for (int c = 0; c < d; c += W) {
      vf v = vload(x + c);
      for (int p = 0; p < hl.passes; ++p) v = vfma(v, vload(hl.sgn[p]), vperm(v, hl.idx[p]));
      vstore(x + c, v);
    }
    h0 = W;
  }
  for (int h = h0; h < d; h <<= 1) {
    if (W > 1 && h >= W) {
      for (int i = 0; i < d; i += 2 * h)
        for (int j = i; j < i + h; j += W) {
          const vf u = vload(x + j), v = vload(x + j + h);
          vstore(x + j, vadd(u, v));
          vstore(x + j + h, vsub(u, v));
        }
    } else {
      for (int i = 0; i < d; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float u = x[j], v = x[j + h];
          x[j] = u + v;
          x[j + h] = u - v;
        }
    }
  }
}

static inline bool rms_scale(const QuantArgs& a, double sumsq, int n, int64_t off, float& s_used) {
  if (!std::isfinite(sumsq)) {
    a.status->store(kNonFinite);
    return false;
  }
  if (a.log_norm) {  // 8-bit log code of the exact norm (math dictionary §18.8); codes use the exact norm
    const float s = static_cast<float>(std::sqrt(sumsq / n));
    if (s > a.log_top) {
      a.status->store(kNormTooLarge);
      return false;
    }
    uint8_t code = 0;
    if (s > 0.0f) {
      const double c = std::nearbyint((std::log2(std::max(static_cast<double>(s), a.log_lo)) - a.log_min_exp) /
                                      a.log_step) + 1.0;
      code = static_cast<uint8_t>(std::min(255.0, std::max(1.0, c)));
    }
    static_cast<uint8_t*>(a.scale)[off] = code;
    s_used = s;
    return true;
  }
  const float back = store_scale(a, off, static_cast<float>(std::sqrt(sumsq / n)));
  if (!std::isfinite(back)) {
    a.status->store(kScaleUnrepresentable);
    return false;
  }
  s_used = back;
  return true;
}

// q[c] = clamp(round(x[c] / s) + z, lo, hi) as bytes (the quantizer's rounding: true
// division, round half to even); S_ARR: s and z are per-channel arrays, else scalars.
template <DT XDT, bool S_ARR>
static inline void quant_row(const void* x, int64_t off, const float* s, const float* z, int n, float lo, float hi,
                             uint8_t* q) {
  int c = 0;
  const vf vlo = vset1(lo), vhi = vset1(hi), vs = vset1(s[0]), vz = vset1(z[0]);
  for (; c + W <= n; c += W) {
    const vf v = vround(vdiv(xload<XDT>(x, off + c), S_ARR ? vload(s + c) : vs));
    vstore_u8(q + c, vmin(vmax(vadd(v, S_ARR ? vload(z + c) : vz), vlo), vhi));
  }
  for (; c < n; ++c) {
    const float v = std::nearbyint(xload1<XDT>(x, off + c) / s[S_ARR ? c : 0]) + z[S_ARR ? c : 0];
    q[c] = static_cast<uint8_t>(std::min(std::max(v, lo), hi));
  }
}

// exact check used when a running sum went non-finite (NaN/Inf, or a huge but finite sum)
template <DT XDT>
static inline bool all_finite(const void* x, int64_t off, int64_t stride, int rows, int cols) {
  for (int t = 0; t < rows; ++t)
    for (int c = 0; c < cols; ++c)
      if (!std::isfinite(xload1<XDT>(x, off + t * stride + c))) return false;
  return true;
}

// "channel" grouping: one group of g tokens of one row. Pass 1 keeps per-channel min / max /
// sum (for the finiteness check) in registers; pass 2 re-reads the group (L1/L2-resident).
template <DT XDT>
static void quantize_channel_item(const QuantArgs& a, int64_t item, Scratch& s) {
  const int d = a.d, g = a.gs, bits = a.bits;
  const int64_t ng = a.N / g, r = item / ng, grp = item % ng, t0 = grp * g;
  const int64_t base = (r * a.N + t0) * d;  // element offset of the group's first token
  const int64_t meta_off = (r * ng + grp) * d;
  s.f0.resize(4 * (d + kPad));
  float* mn = s.f0.data();
  float* mx = mn + d + kPad;
  float* sc = mx + d + kPad;
  float* zp = sc + d + kPad;
  s.u8.resize(d + kPad);
  uint8_t* qb = s.u8.data();
  uint8_t* codes = a.codes + (r * a.N + t0) * a.P;
  if (a.codebook) {
    s.d0.assign(d, 0.0);
    double* ss = s.d0.data();
    for (int t = 0; t < g; ++t)
      for (int c = 0; c < d; ++c) {
        const double v = xload1<XDT>(a.x, base + static_cast<int64_t>(t) * d + c);
        ss[c] += v * v;
      }
    for (int c = 0; c < d; ++c)
      if (!rms_scale(a, ss[c], g, meta_off + c, sc[c])) return;
    for (int t = 0; t < g; ++t) {
      float* row = mn;  // reuse as a float row buffer
      for (int c = 0; c < d; ++c) row[c] = xload1<XDT>(a.x, base + static_cast<int64_t>(t) * d + c);
      book_row(row, sc, true, d, a.mids, a.nmids, qb);
      pack_row(qb, d, bits, codes + t * a.P);
    }
    return;
  }
  int c = 0;
  const float inf = std::numeric_limits<float>::infinity();
  for (; c + W <= d; c += W) {
    vf vmn = vset1(inf), vmx = vset1(-inf), vsum = vzero();
    for (int t = 0; t < g; ++t) {
      const vf v = xload<XDT>(a.x, base + static_cast<int64_t>(t) * d + c);
      vmn = vmin(vmn, v);
      vmx = vmax(vmx, v);
      vsum = vadd(vsum, v);
    }
    vstore(mn + c, vmn);
    vstore(mx + c, vmx);
    if (!std::isfinite(vhsum(vsum)) && !all_finite<XDT>(a.x, base + c, d, g, W)) {
      a.status->store(kNonFinite);
      return;
    }
  }
  for (; c < d; ++c) {
    float lo = inf, hi = -inf, sum = 0.0f;
    for (int t = 0; t < g; ++t) {
      const float v = xload1<XDT>(a.x, base + static_cast<int64_t>(t) * d + c);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      sum += v;
    }
    mn[c] = lo;
    mx[c] = hi;
    if (!std::isfinite(sum) && !all_finite<XDT>(a.x, base + c, d, g, 1)) {
      a.status->store(kNonFinite);
      return;
    }
  }
  for (int c2 = 0; c2 < d; ++c2)
    if (!uniform_scale(a, mn[c2], mx[c2], meta_off + c2, sc[c2], zp[c2])) return;
  for (int t = 0; t < g; ++t) {
    quant_row<XDT, true>(a.x, base + static_cast<int64_t>(t) * d, sc, zp, d, a.qlo, a.qhi, qb);
    pack_row(qb, d, bits, codes + t * a.P);
  }
}

// "token" grouping: up to kTokChunk tokens of one row, each in groups of gs channels.
template <DT XDT>
static void quantize_token_item(const QuantArgs& a, int64_t item, Scratch& s) {
  const int d = a.d, gs = a.gs, J = d / gs, bits = a.bits;
  const int64_t chunks = (a.N + kTokChunk - 1) / kTokChunk, r = item / chunks;
  const int64_t t0 = (item % chunks) * kTokChunk, t1 = std::min<int64_t>(a.N, t0 + kTokChunk);
  s.u8.resize(d + kPad);
  s.f0.resize(d + kPad);
  s.f1.resize(pad_to(d) + kPad);
  uint8_t* qb = s.u8.data();
  float* rot = s.f1.data();  // the token rotated into the Hadamard space (signs), x R = (x * s) H / sqrt(d)
  static const HadamardLanes hl;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = r * a.N + t;
    if (a.signs) {
      const int8_t* sg = a.signs + (r % a.signs_heads) * d;
      for (int c = 0; c < d; ++c) rot[c] = xload1<XDT>(a.x, row * d + c) * static_cast<float>(sg[c]);
      fwht_row(rot, d, hl);
      for (int c = 0; c < d; ++c) rot[c] *= inv_sqrt_d;
    }
    for (int j = 0; j < J; ++j) {
      const int64_t off = row * d + j * gs;
      float s1, z1;
      if (a.codebook) {
        double ss = 0.0;
        float* buf = s.f0.data();
        for (int c = 0; c < gs; ++c) {
          buf[c] = a.signs ? rot[j * gs + c] : xload1<XDT>(a.x, off + c);
          ss += static_cast<double>(buf[c]) * buf[c];
        }
        if (!rms_scale(a, ss, gs, row * J + j, s1)) return;
        book_row(buf, &s1, false, gs, a.mids, a.nmids, qb + j * gs);
        continue;
      }
      int c = 0;
      vf vmn = vset1(inf), vmx = vset1(-inf), vsum = vzero();
      for (; c + W <= gs; c += W) {
        const vf v = xload<XDT>(a.x, off + c);
        vmn = vmin(vmn, v);
        vmx = vmax(vmx, v);
        vsum = vadd(vsum, v);
      }
      float mn = vhmin(vmn), mx = vhmax(vmx), sum = vhsum(vsum);
      for (; c < gs; ++c) {
        const float v = xload1<XDT>(a.x, off + c);
        mn = std::min(mn, v);
        mx = std::max(mx, v);
        sum += v;
      }
      if (!std::isfinite(sum) && !all_finite<XDT>(a.x, off, 0, 1, gs)) {
        a.status->store(kNonFinite);
        return;
      }
      if (!uniform_scale(a, mn, mx, row * J + j, s1, z1)) return;
      quant_row<XDT, false>(a.x, off, &s1, &z1, gs, a.qlo, a.qhi, qb + j * gs);
    }
    pack_row(qb, d, bits, a.codes + row * a.P);
  }
}

static void quantize_item(const QuantArgs& a, int64_t item, Scratch& s) {
  const bool ch = a.grouping == kChannel;
  switch (a.xdt) {
    case DT_F16: return ch ? quantize_channel_item<DT_F16>(a, item, s) : quantize_token_item<DT_F16>(a, item, s);
    case DT_BF16: return ch ? quantize_channel_item<DT_BF16>(a, item, s) : quantize_token_item<DT_BF16>(a, item, s);
    default: return ch ? quantize_channel_item<DT_F32>(a, item, s) : quantize_token_item<DT_F32>(a, item, s);
  }
}

// ============================================================================= dequantize
// out[i] = (v[i] - z[i]) * s[i] (arrays) or (v[i] - z) * s (scalars), rounded to odt
template <bool ARR>
static inline void store_affine(const float* v, const float* z, const float* s, int n, void* out, int64_t off,
                                DT odt) {
  int c = 0;
  const vf vz = vset1(z[0]), vs = vset1(s[0]);
  for (; c + W <= n; c += W)
    vstore_as(out, off + c, vmul(vsub(vload(v + c), ARR ? vload(z + c) : vz), ARR ? vload(s + c) : vs), odt);
  for (; c < n; ++c) store_as1(out, off + c, (v[c] - z[ARR ? c : 0]) * s[ARR ? c : 0], odt);
}

// One work item: up to kTokChunk tokens of one row.
static void dequantize_item(const DequantArgs& a, int64_t item, Scratch& s) {
  const BlockView& b = a.blk;
  const int d = b.d;
  const int64_t chunks = (b.N + kTokChunk - 1) / kTokChunk, r = item / chunks;
  const int64_t t0 = (item % chunks) * kTokChunk, t1 = std::min<int64_t>(b.N, t0 + kTokChunk);
  s.f0.resize(d + kPad);
  float* vb = s.f0.data();
  if (b.grouping == kChannel) {
    s.f1.resize(2 * (d + kPad));
    float* sb = s.f1.data();
    float* zb = sb + d + kPad;
    int64_t cur = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = r * b.N + t;
      const int64_t grp = b.gid ? b.gid[row] : t / b.gs;
      if (grp < 0 || grp >= b.NG) {
        a.status->store(kBadGroup);
        return;
      }
      if (grp != cur) {
        meta_load(b.scale, (r * b.NG + grp) * d, d, sb);
        meta_load(b.zero, (r * b.NG + grp) * d, d, zb);
        cur = grp;
      }
      decode_row(b.codes + row * b.P, d, b.bits, b.lut, vb);
      store_affine<true>(vb, zb, sb, d, a.out, row * d, a.odt);
    }
  } else {
    const int gs = b.gs, J = d / gs;
    const int64_t nt = t1 - t0;
    s.f1.resize(2 * (nt * J + kPad));
    float* sb = s.f1.data();
    float* zb = sb + nt * J + kPad;
    meta_load(b.scale, (r * b.N + t0) * J, nt * J, sb);
    meta_load(b.zero, (r * b.N + t0) * J, nt * J, zb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = r * b.N + t;
      decode_row(b.codes + row * b.P, d, b.bits, b.lut, vb);
      const float* st = sb + (t - t0) * J;
      const float* zt = zb + (t - t0) * J;
      for (int j = 0; j < J; ++j) store_affine<false>(vb + j * gs, zt + j, st + j, gs, a.out, row * d + j * gs, a.odt);
    }
  }
}

// ============================================================================= attention
// S[g*lds + t] = sum_c Q[g*ldq + c] * K[t*ldk + c] for g < GB, t < T; c < dp (dp % kPad == 0)
template <int GB>
static inline void dots_block(const float* Q, int ldq, const float* K, int ldk, int T, int dp, float* S, int lds) {
  int t = 0;
  for (; t + 4 <= T; t += 4) {
    vf acc[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < 4; ++i) acc[g][i] = vzero();
    const float* k = K + static_cast<int64_t>(t) * ldk;
    for (int c = 0; c < dp; c += W) {
      const vf k0 = vload(k + c), k1 = vload(k + ldk + c), k2 = vload(k + 2 * ldk + c), k3 = vload(k + 3 * ldk + c);
      for (int g = 0; g < GB; ++g) {
        const vf q = vload(Q + g * ldq + c);
        acc[g][0] = vfma(q, k0, acc[g][0]);
        acc[g][1] = vfma(q, k1, acc[g][1]);
        acc[g][2] = vfma(q, k2, acc[g][2]);
        acc[g][3] = vfma(q, k3, acc[g][3]);
      }
    }
    for (int g = 0; g < GB; ++g) vhsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], S + g * lds + t);
  }
  for (; t < T; ++t) {
    vf acc[GB];
    for (int g = 0; g < GB; ++g) acc[g] = vzero();
    const float* k = K + static_cast<int64_t>(t) * ldk;
    for (int c = 0; c < dp; c += W) {
      const vf kv = vload(k + c);
      for (int g = 0; g < GB; ++g) acc[g] = vfma(vload(Q + g * ldq + c), kv, acc[g]);
    }
    for (int g = 0; g < GB; ++g) S[g * lds + t] = vhsum(acc[g]);
  }
}

static void dots(const float* Q, int ldq, int G, const float* K, int ldk, int T, int dp, float* S, int lds) {
  constexpr int GB = W == 16 ? 4 : 3;  // accumulators: GB * 4 vectors (32 / 16 registers)
  int g = 0;
  for (; g + GB <= G; g += GB) dots_block<GB>(Q + g * ldq, ldq, K, ldk, T, dp, S + g * lds, lds);
  switch (G - g) {
    case 3: dots_block<3>(Q + g * ldq, ldq, K, ldk, T, dp, S + g * lds, lds); break;
    case 2: dots_block<2>(Q + g * ldq, ldq, K, ldk, T, dp, S + g * lds, lds); break;
    case 1: dots_block<1>(Q + g * ldq, ldq, K, ldk, T, dp, S + g * lds, lds); break;
    default: break;
  }
}

// Many query rows against one tile of up to kTile keys: S[g*lds + t] = Q[g] . K[t] for g < G,
// t < kTile (columns past nt are 0), from the tile's transpose kt [D, kTile] (scratch, written
// here): each query channel is broadcast against every key of the tile at once, no horizontal
// sums. For many rows (a prefill chunk's queries) this beats dots, which transposes nothing.
template <int RB>
static inline void dots_wide_block(const float* Q, int ldq, const float* kt, int D, float* S, int lds) {
  constexpr int NV = kTile / W;
  vf acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vzero();
  for (int c = 0; c < D; ++c) {
    vf k[NV];
    for (int j = 0; j < NV; ++j) k[j] = vload(kt + c * kTile + j * W);
    for (int r = 0; r < RB; ++r) {
      const vf q = vset1(Q[r * ldq + c]);
      for (int j = 0; j < NV; ++j) acc[r][j] = vfma(q, k[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) vstore(S + r * lds + j * W, acc[r][j]);
}

static void dots_wide(const float* Q, int ldq, int G, const float* K, int ldk, int nt, int D, float* S, int lds,
                      float* kt) {
  for (int c = 0; c < D; ++c)
    for (int t = 0; t < kTile; ++t) kt[c * kTile + t] = t < nt ? K[static_cast<int64_t>(t) * ldk + c] : 0.0f;
  constexpr int RB = W == 16 ? 8 : (W == 8 ? 2 : 1);  // accumulators RB * kTile / W: 16 (avx512), 8 (avx2)
  int g = 0;
  for (; g + RB <= G; g += RB) dots_wide_block<RB>(Q + static_cast<int64_t>(g) * ldq, ldq, kt, D, S + g * lds, lds);
  for (; g < G; ++g) dots_wide_block<1>(Q + static_cast<int64_t>(g) * ldq, ldq, kt, D, S + g * lds, lds);
}

// A[g*lda + c] += sum_t P[g*ldp + t] * V[t*ldv + c] for g < GB, c in [c0, c0 + NV*W)
template <int GB, int NV>
static inline void accum_block(const float* P, int ldp, const float* V, int ldv, int T, int c0, float* A, int lda) {
  vf acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = vload(A + g * lda + c0 + j * W);
  for (int t = 0; t < T; ++t) {
    const float* v = V + static_cast<int64_t>(t) * ldv + c0;
    vf vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = vload(v + j * W);
    for (int g = 0; g < GB; ++g) {
      const vf p = vset1(P[g * ldp + t]);
      for (int j = 0; j < NV; ++j) acc[g][j] = vfma(p, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) vstore(A + g * lda + c0 + j * W, acc[g][j]);
}

template <int GB>
static inline void accum_rows(const float* P, int ldp, const float* V, int ldv, int T, int dp, float* A, int lda) {
  int c = 0;
  for (; c + 4 * W <= dp; c += 4 * W) accum_block<GB, 4>(P, ldp, V, ldv, T, c, A, lda);
  for (; c + W <= dp; c += W) accum_block<GB, 1>(P, ldp, V, ldv, T, c, A, lda);
}

static void accum(const float* P, int ldp, int G, const float* V, int ldv, int T, int dp, float* A, int lda) {
  constexpr int GB = W == 16 ? 4 : 2;  // accumulators: GB * 4 vectors
  int g = 0;
  for (; g + GB <= G; g += GB) accum_rows<GB>(P + g * ldp, ldp, V, ldv, T, dp, A + g * lda, lda);
  switch (G - g) {
    case 3: accum_rows<3>(P + g * ldp, ldp, V, ldv, T, dp, A + g * lda, lda); break;
    case 2: accum_rows<2>(P + g * ldp, ldp, V, ldv, T, dp, A + g * lda, lda); break;
    case 1: accum_rows<1>(P + g * ldp, ldp, V, ldv, T, dp, A + g * lda, lda); break;
    default: break;
  }
}

static inline void scale_row(float* x, int n, float f) {
  const vf vf_ = vset1(f);
  int c = 0;
  for (; c + W <= n; c += W) vstore(x + c, vmul(vload(x + c), vf_));
  for (; c < n; ++c) x[c] *= f;
}

// One tile of the online softmax (math dictionary §15.5), for one query row:
// the running max m and sum l take the tile's scores S[0, nt), S becomes exp(S - m), and the
// return value is alpha = exp(m_old - m_new), the factor the caller rescales its accumulators
// by (1 when the max did not move; 0 on the first tile, where m_old is -inf). Every attention
// kernel here (packed, dense, paged) streams its keys through this one function.
static inline float softmax_tile(float* S, int nt, float& m, float& l) {
  int t = 0;
  vf vm = vset1(-std::numeric_limits<float>::infinity());
  for (; t + W <= nt; t += W) vm = vmax(vm, vload(S + t));
  float mt = vhmax(vm);
  for (; t < nt; ++t) mt = std::max(mt, S[t]);
  float alpha = 1.0f;
  if (mt > m) {
    alpha = std::exp(m - mt);
    m = mt;
    l *= alpha;
  }
  const vf mv = vset1(m);
  vf lsum = vzero();
  for (t = 0; t + W <= nt; t += W) {
    const vf e = vexp(vsub(vload(S + t), mv));
    vstore(S + t, e);
    lsum = vadd(lsum, e);
  }
  float ls = vhsum(lsum);
  for (; t < nt; ++t) {
    S[t] = std::exp(S[t] - m);
    ls += S[t];
  }
  l += ls;
  return alpha;
}

static inline float dot_n(const float* a, const float* b, int n) {
  vf acc = vzero();
  int i = 0;
  for (; i + W <= n; i += W) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vhsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Decode the tokens [t0, t0 + nt) of a token-grouped block into rows of `tile` (stride ldt)
// with each token's scales applied: tile[t][c] = scale[t][c / gs] * lut[code]. Also returns
// zsT[j][t] = scale[t][j] * zero[t][j] (transposed, stride kTile) for the zero-point terms.
// cs: scratch of kTile * ceil(d / W) floats.
static inline void decode_token_tile(const BlockView& B, int64_t r, int64_t t0, int nt, float* tile, int ldt,
                                     float* sc, float* zs, float* zsT, float* cs) {
  const int J = B.d / B.gs, gs = B.gs;
  meta_load(B.scale, (mrow(B.scale, r) + t0) * J, static_cast<int64_t>(nt) * J, sc);
  meta_load(B.zero, (mrow(B.zero, r) + t0) * J, static_cast<int64_t>(nt) * J, zs);
  const uint8_t* codes = B.codes + (crow(B, r) + t0) * B.P;
  if (J == 1) {
    decode_tile<kTokenScale>(codes, B.P, nt, B.d, B.bits, B.lut, sc, 1, tile, ldt);
  } else if (W > 1 && gs % W == 0) {  // the scale is constant over each W-chunk
    const int nch = (B.d + W - 1) / W, per = gs / W;
    for (int t = 0; t < nt; ++t)
      for (int i = 0; i < nch; ++i) cs[t * nch + i] = sc[t * J + i / per];
    decode_tile<kChunkScale>(codes, B.P, nt, B.d, B.bits, B.lut, cs, nch, tile, ldt);
  } else {
    decode_tile<kNoScale>(codes, B.P, nt, B.d, B.bits, B.lut, nullptr, 0, tile, ldt);
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < J; ++j) scale_row(tile + static_cast<size_t>(t) * ldt + j * gs, gs, sc[t * J + j]);
  }
  for (int t = 0; t < nt; ++t)
    for (int j = 0; j < J; ++j) zsT[j * kTile + t] = sc[t * J + j] * zs[t * J + j];
}

// Consecutive float buffers of sizes[i] floats (each followed by kPad floats of slack) carved
// out of a thread's scratch vector, grown as needed: out[i] is buffer i.
template <size_t K>
static inline void carve(std::vector<float>& scratch, const size_t (&sizes)[K], float* (&out)[K]) {
  size_t total = 0;
  for (size_t n : sizes) total += n + kPad;
  if (scratch.size() < total) scratch.resize(total);
  float* p = scratch.data();
  for (size_t i = 0; i < K; ++i) {
    out[i] = p;
    p += sizes[i] + kPad;
  }
}

// Software prefetch of [p, p + n) bytes, one request per 64-byte line.
static inline void prefetch_range(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// The token-grouped metadata of tokens [t, t + n) of row r (J entries per token).
static inline void prefetch_meta(const Meta& s, const Meta& z, int64_t r, int64_t t, int J, int n) {
  if (s.p) prefetch_range(static_cast<const char*>(s.p) + (mrow(s, r) + t) * J * dt_size(s.dt), int64_t(n) * J * dt_size(s.dt));
  if (z.p) prefetch_range(static_cast<const char*>(z.p) + (mrow(z, r) + t) * J * dt_size(z.dt), int64_t(n) * J * dt_size(z.dt));
}

// ============================================================================= keys before RoPE
// a[i] + i b[i] <- (a[i] + i b[i]) (c[i] + i s[i]) for i < n: each pair (a, b) turned by the
// angle whose cosine and sine are (c, s) (a key's channel pair, or an angle stepped by another).
static inline void turn_pairs(float* a, float* b, const float* c, const float* s, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    const vf u = vload(a + i), v = vload(b + i), cv = vload(c + i), sv = vload(s + i);
    vstore(a + i, vsub(vmul(u, cv), vmul(v, sv)));
    vstore(b + i, vfma(u, sv, vmul(v, cv)));
  }
  for (; i < n; ++i) {
    const float u = a[i], v = b[i];
    a[i] = u * c[i] - v * s[i];
    b[i] = u * s[i] + v * c[i];
  }
}

// (c, s)[i] <- (c, s)[i] turned by delta * w_i: one complex product per set bit j of delta with
// the doubling table's (cos, sin)(2^j w_i) (KeyRope; math dictionary §29.8).
static inline void rope_advance(float* c, float* s, const float* tab, int half, uint32_t delta) {
  for (int j = 0; delta; ++j, delta >>= 1)
    if (delta & 1u) {
      const float* C = tab + static_cast<size_t>(2 * j) * half;
      turn_pairs(c, s, C, C + half, half);
    }
}

// (c, s) = (cos, sin)(p * w_i) for every pair i.
static inline void rope_at(float* c, float* s, const float* tab, int half, int32_t p) {
  std::fill(c, c + half, 1.0f);
  std::fill(s, s + half, 0.0f);
  const uint32_t m = p < 0 ? static_cast<uint32_t>(-static_cast<int64_t>(p)) : static_cast<uint32_t>(p);
  rope_advance(c, s, tab, half, m);
  if (p < 0)
    for (int i = 0; i < half; ++i) s[i] = -s[i];
}

// Turn the channel pairs of one key row x by the angles (c, s).
static inline void rope_row(float* x, const float* c, const float* s, int half, bool interleaved) {
  if (!interleaved) {
    turn_pairs(x, x + half, c, s, half);
    return;
  }
  for (int i = 0; i < half; ++i) {
    const float u = x[2 * i], v = x[2 * i + 1];
    x[2 * i] = u * c[i] - v * s[i];
    x[2 * i + 1] = u * s[i] + v * c[i];
  }
}

// Keys before RoPE coded per token in a randomized Hadamard space (the default layout, §29.8,
// §29.10), a tile of nt decoded rows turned in registers, one row at a time: the Hadamard passes
// (fwht_row's), k = A u + C (the offset, scale, signs and 1/sqrt(d) folded in A and C), then R(p)
// on the pairs (c, c + d/2), which lie in vectors j and j + NV/2; the angles stay in registers,
// advanced by one complex product per token where positions step by one (rope_advance's), and
// recomputed from the doubling table otherwise. The same operations in the same order as the
// general path (fwht_row, the affine pass, rope_at / rope_advance, rope_row): the same floats.
template <int NV>
static inline void turn_token_rows(float* Kb, int ldk, int nt, const float* rA, const float* rC,
                                   const int32_t* pos, const KeyRope& rope, const HadamardLanes& hl,
                                   float* rc, float* rs) {
  constexpr int H2 = NV / 2;
  vf A[NV], C[NV], c[H2], sn[H2], cw[H2], sw[H2];
  for (int j = 0; j < NV; ++j) {
    A[j] = vload(rA + j * W);
    C[j] = vload(rC + j * W);
  }
  for (int j = 0; j < H2; ++j) {  // (cos, sin)(w_i): the doubling table's first row, a step of one
    cw[j] = vload(rope.tab + j * W);
    sw[j] = vload(rope.tab + rope.half + j * W);
  }
  for (int t = 0; t < nt; ++t) {
    const int64_t step = t ? static_cast<int64_t>(pos[t]) - pos[t - 1] : 0;
    if (t == 0 || step != 1) {  // exact angles (first token of the tile, a gap, a step back)
      if (t == 0 || step < 0) {
        rope_at(rc, rs, rope.tab, rope.half, pos[t]);
      } else {
        for (int j = 0; j < H2; ++j) {
          vstore(rc + j * W, c[j]);
          vstore(rs + j * W, sn[j]);
        }
        rope_advance(rc, rs, rope.tab, rope.half, static_cast<uint32_t>(step));
      }
      for (int j = 0; j < H2; ++j) {
        c[j] = vload(rc + j * W);
        sn[j] = vload(rs + j * W);
      }
    } else {  // one step: (c, s) <- (c, s) (cos w, sin w), as turn_pairs computes it
      for (int j = 0; j < H2; ++j) {
        const vf u = c[j], v = sn[j];
        c[j] = vsub(vmul(u, cw[j]), vmul(v, sw[j]));
        sn[j] = vfma(u, sw[j], vmul(v, cw[j]));
      }
    }
    float* row = Kb + static_cast<size_t>(t) * ldk;
    vf x[NV];
    for (int j = 0; j < NV; ++j) x[j] = vload(row + j * W);
    for (int p = 0; p < hl.passes; ++p) {
      const vf sg = vload(hl.sgn[p]);
      for (int j = 0; j < NV; ++j) x[j] = vfma(x[j], sg, vperm(x[j], hl.idx[p]));
    }
    for (int h = 1; h < NV; h <<= 1)
      for (int i = 0; i < NV; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const vf u = x[j], v = x[j + h];
          x[j] = vadd(u, v);
          x[j + h] = vsub(u, v);
        }
    for (int j = 0; j < NV; ++j) x[j] = vfma(A[j], x[j], C[j]);
    for (int j = 0; j < H2; ++j) {
      const vf u = x[j], v = x[j + H2];
      vstore(row + j * W, vsub(vmul(u, c[j]), vmul(v, sn[j])));
      vstore(row + (j + H2) * W, vfma(u, sn[j], vmul(v, c[j])));
    }
  }
}

// One work item: tokens [t0, t1) of row r; writes the chunk's (max, sum, unnormalized output).
static void attend_item(const AttendArgs& a, int64_t item, Scratch& s) {
  const AttendItem& it = a.items[item];
  const BlockView& K = it.packed ? a.xk[it.packed - 1] : a.k;  // the call's packed block, or an extra one
  const BlockView& V = it.packed ? a.xv[it.packed - 1] : a.v;
  const int64_t r = it.r, N = K.N;
  const int G = a.G, dk = K.d, dv = V.d;
  const int dkp = pad_to(dk), dvp = pad_to(dv);
  const int Jk = K.grouping == kToken ? dk / K.gs : 1;
  const int Jv = V.grouping == kToken ? dv / V.gs : 1;
  constexpr int T = kTile;
  // scratch layout (floats)
  const size_t sizes[] = {
      static_cast<size_t>(G) * dkp,                // qs: scaling * q
      static_cast<size_t>(G) * dkp,                // qt: channel keys, q * scale_G
      static_cast<size_t>(G) * Jk,                 // qsum: per key channel group
      static_cast<size_t>(T) * dkp,                // Kb
      static_cast<size_t>(T) * dvp,                // Vb
      static_cast<size_t>(G) * T,                  // S
      static_cast<size_t>(G) * dvp,                // acc
      static_cast<size_t>(G) * dvp,                // accG
      static_cast<size_t>(G) * Jv,                 // corr
      static_cast<size_t>(T) * Jk * 3 + kPad,      // ksc, kzs, kzsT
      static_cast<size_t>(T) * Jv * 3 + kPad,      // vsc, vzs, vzsT
      4 * static_cast<size_t>(dkp + dvp),          // sK zK sV zV
      static_cast<size_t>(T) * (std::max(dkp, dvp) / W + 1),  // chunk scales of a tile
      4 * static_cast<size_t>(G) + kPad,           // m l psum bK
      4 * static_cast<size_t>(dkp),                // keys before RoPE: A C cos sin
  };
  float* buf[15];
  carve(s.f0, sizes, buf);
  float *qs = buf[0], *qt = buf[1], *qsum = buf[2], *Kb = buf[3], *Vb = buf[4], *S = buf[5], *acc = buf[6];
  float *accG = buf[7], *corr = buf[8];
  float* ksc = buf[9];
  float* kzs = ksc + T * Jk;
  float* kzsT = kzs + T * Jk;
  float* vsc = buf[10];
  float* vzs = vsc + T * Jv;
  float* vzsT = vzs + T * Jv;
  float* sK = buf[11];
  float* zK = sK + dkp;
  float* sV = zK + dkp;
  float* zV = sV + dvp;
  float* cs = buf[12];
  float* m = buf[13];
  float* l = m + G;
  float* psum = l + G;
  float* bK = psum + G;
  const KeyRope* rope = it.packed == 0 ? a.rope : (a.xrope ? a.xrope[it.packed - 1] : nullptr);
  float* rA = buf[14];
  float* rC = rA + dkp;
  float* rc = rC + dkp;
  float* rs = rc + dkp;
  const float* rsg = nullptr;  // this row's Hadamard signs, times 1 / sqrt(d)
  static const HadamardLanes hl;  // the Hadamard passes inside a vector (fwht_row): built once
  if (rope) {
    std::fill(rA, rA + 2 * static_cast<size_t>(dkp), 0.0f);
    if (K.grouping == kToken) {  // A = f sigma, C = f mu: the same for every token of the row
      const float* mu = rope->mean ? rope->mean + r * rope->mean_pitch : nullptr;
      const float* sg = rope->scale ? rope->scale + r * rope->scale_pitch : nullptr;
      const float norm = rope->signs ? 1.0f / std::sqrt(static_cast<float>(dk)) : 1.0f;
      for (int c = 0; c < dk; ++c) {
        const float f = c < 2 * rope->half ? rope->factor : 1.0f;
        rA[c] = f * (sg ? sg[c] : 1.0f) * norm * (rope->signs ? rope->signs[(r % rope->signs_heads) * dk + c] : 1.0f);
        rC[c] = f * (mu ? mu[c] : 0.0f);
      }
      rsg = rope->signs;
    }
  }
  // zero what is read before being written (pads of the tiles, accumulators)
  std::fill(Kb, Kb + sizes[3], 0.0f);
  std::fill(Vb, Vb + sizes[4], 0.0f);
  std::fill(acc, acc + sizes[6], 0.0f);
  std::fill(accG, accG + sizes[7], 0.0f);
  std::fill(corr, corr + sizes[8], 0.0f);
  std::fill(qt, qt + sizes[1], 0.0f);
  std::fill(sK, sK + 4 * (dkp + dvp), 0.0f);
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
    psum[g] = 0.0f;
    float* qrow = qs + static_cast<size_t>(g) * dkp;
    const float* qin = (it.packed ? a.xq[it.packed - 1] : a.q) + (r * G + g) * dk;
    for (int c = 0; c < dk; ++c) qrow[c] = a.scaling * qin[c];
    std::fill(qrow + dk, qrow + dkp, 0.0f);
    if (K.grouping == kToken)
      for (int j = 0; j < Jk; ++j) {
        float sum = 0.0f;
        for (int c = j * K.gs; c < (j + 1) * K.gs; ++c) sum += qrow[c];
        qsum[g * Jk + j] = sum;
      }
  }
  int64_t curK = -1, curV = -1;
  auto flushV = [&]() {  // fold the running channel-group sums into acc
    if (curV < 0) return;
    for (int g = 0; g < G; ++g) {
      float* A = acc + static_cast<size_t>(g) * dvp;
      float* AG = accG + static_cast<size_t>(g) * dvp;
      const vf ps = vset1(psum[g]);
      for (int c = 0; c < dvp; c += W)
        vstore(A + c, vfma(vload(sV + c), vsub(vload(AG + c), vmul(vload(zV + c), ps)), vload(A + c)));
      std::fill(AG, AG + dvp, 0.0f);
      psum[g] = 0.0f;
    }
  };
  // [a0, b0): the run of tokens from a0 that share a channel group (no division per token)
  auto run_of = [&](const BlockView& B, int64_t t0, int a0, int nt, int64_t& grp) {
    if (B.gid) {
      const int32_t* gr = B.gid + gidrow(B, r) + t0;
      grp = gr[a0];
      int b0 = a0 + 1;
      while (b0 < nt && gr[b0] == grp) ++b0;
      return b0;
    }
    grp = (t0 + a0) / B.gs;
    return static_cast<int>(std::min<int64_t>(nt, (grp + 1) * B.gs - t0));
  };
  // The tile's runs [a0, b0) of tokens sharing a channel group of B (the keys' and the values'
  // walk): on_group(grp) when the group changes from `cur` (load_group and the group's constants),
  // then on_run(a0, b0) for every run. False on a group outside the scale table (kBadGroup).
  auto group_runs = [&](const BlockView& B, int64_t t0, int nt, int64_t& cur, auto&& on_group, auto&& on_run) {
    for (int a0 = 0; a0 < nt;) {
      int64_t grp;
      const int b0 = run_of(B, t0, a0, nt, grp);
      if (grp < 0 || grp >= B.NG) return false;
      if (grp != cur) {
        on_group(grp);
        cur = grp;
      }
      on_run(a0, b0);
      a0 = b0;
    }
    return true;
  };
  // B's scale and zero of channel group grp into s and z ([B.d] each)
  auto load_group = [&](const BlockView& B, int64_t grp, float* s, float* z) {
    meta_load(B.scale, (mrow(B.scale, r) + grp) * B.d, B.d, s);
    meta_load(B.zero, (mrow(B.zero, r) + grp) * B.d, B.d, z);
  };
  for (int64_t t0 = it.t0; t0 < it.t1; t0 += T) {
    const int nt = static_cast<int>(std::min<int64_t>(T, it.t1 - t0));
    // the tiles after this one, requested now: decoding is latency-bound on cold caches
    for (int64_t ahead = t0 == it.t0 ? t0 + T : t0 + kPrefetchTiles * T;
         ahead < std::min<int64_t>(it.t1, t0 + (kPrefetchTiles + 1) * T); ahead += T) {
      const int na = static_cast<int>(std::min<int64_t>(T, it.t1 - ahead));
      prefetch_range(K.codes + (crow(K, r) + ahead) * K.P, static_cast<int64_t>(na) * K.P);
      prefetch_range(V.codes + (crow(V, r) + ahead) * V.P, static_cast<int64_t>(na) * V.P);
      if (V.grouping == kToken) prefetch_meta(V.scale, V.zero, r, ahead, Jv, na);
      if (K.grouping == kToken) prefetch_meta(K.scale, K.zero, r, ahead, Jk, na);
      if (K.gid) prefetch_range(K.gid + gidrow(K, r) + ahead, sizeof(int32_t) * na);
      if (V.gid) prefetch_range(V.gid + gidrow(V, r) + ahead, sizeof(int32_t) * na);
    }
    // ---- keys -> scores S[g][t]
    bool turned = false;  // the tile's keys already turned to their positions (turn_token_rows)
    if (rope && K.grouping == kToken && rsg && !K.zero.p && !rope->interleaved && 2 * rope->half == dk &&
        dkp == dk && W >= 8 && (dk == 4 * W || dk == 8 * W || dk == 16 * W)) {  // the default layout, in registers
      decode_token_tile(K, r, t0, nt, Kb, dkp, ksc, kzs, kzsT, cs);
      const int32_t* pos = rope->pos + (K.off ? crow(K, r) : r * rope->pitch) + t0;
      if (dk == 4 * W)
        turn_token_rows<4>(Kb, dkp, nt, rA, rC, pos, *rope, hl, rc, rs);
      else if (dk == 8 * W)
        turn_token_rows<8>(Kb, dkp, nt, rA, rC, pos, *rope, hl, rc, rs);
      else
        turn_token_rows<16>(Kb, dkp, nt, rA, rC, pos, *rope, hl, rc, rs);
      turned = true;
    } else if (rope && K.grouping == kToken) {  // per-token keys: k_hat, back from the Hadamard space, A k + C
      decode_token_tile(K, r, t0, nt, Kb, dkp, ksc, kzs, kzsT, cs);
      for (int t = 0; t < nt; ++t) {
        float* row = Kb + static_cast<size_t>(t) * dkp;
        if (K.zero.p)
          for (int j = 0; j < Jk; ++j) {
            const float z = kzsT[j * T + t];
            for (int c = j * K.gs; c < (j + 1) * K.gs; ++c) row[c] -= z;
          }
        if (rsg) fwht_row(row, dk, hl);
        for (int c = 0; c < dkp; c += W) vstore(row + c, vfma(vload(rA + c), vload(row + c), vload(rC + c)));
      }
    } else if (rope) {  // keys before RoPE: k = f R(p) (sigma * k_hat + mu), each row turned once, then q . k
      decode_tile<kNoScale>(K.codes + (crow(K, r) + t0) * K.P, K.P, nt, dk, K.bits, K.lut, nullptr, 0, Kb, dkp);
      const float* mu = rope->mean ? rope->mean + r * rope->mean_pitch : nullptr;
      const float* sg = rope->scale ? rope->scale + r * rope->scale_pitch : nullptr;
      const bool ok = group_runs(
          K, t0, nt, curK,
          [&](int64_t grp) {  // A = f sigma scale_G, C = f (mu - sigma scale_G zero_G); f = 1 past the pairs
            load_group(K, grp, sK, zK);
            for (int c = 0; c < dk; ++c) {
              const float sc = (sg ? sg[c] : 1.0f) * sK[c];
              const float f = c < 2 * rope->half ? rope->factor : 1.0f;
              rA[c] = f * sc;
              rC[c] = f * ((mu ? mu[c] : 0.0f) - sc * zK[c]);
            }
          },
          [&](int a0, int b0) {
            for (int t = a0; t < b0; ++t) {
              float* row = Kb + static_cast<size_t>(t) * dkp;
              for (int c = 0; c < dkp; c += W) vstore(row + c, vfma(vload(rA + c), vload(row + c), vload(rC + c)));
            }
          });
      if (!ok) {
        a.status->store(kBadGroup);
        return;
      }
    }
    if (turned) {
      dots(qs, dkp, G, Kb, dkp, nt, dkp, S, T);
    } else if (rope) {
      const int32_t* pos = rope->pos + (K.off ? crow(K, r) : r * rope->pitch) + t0;
      for (int t = 0; t < nt; ++t) {  // exact angles at the tile's first token, then steps
        const int64_t step = t ? static_cast<int64_t>(pos[t]) - pos[t - 1] : 0;
        if (t == 0 || step < 0)
          rope_at(rc, rs, rope->tab, rope->half, pos[t]);
        else
          rope_advance(rc, rs, rope->tab, rope->half, static_cast<uint32_t>(step));
        rope_row(Kb + static_cast<size_t>(t) * dkp, rc, rs, rope->half, rope->interleaved);
      }
      dots(qs, dkp, G, Kb, dkp, nt, dkp, S, T);
    } else if (K.grouping == kChannel) {
      decode_tile<kNoScale>(K.codes + (crow(K, r) + t0) * K.P, K.P, nt, dk, K.bits, K.lut, nullptr, 0, Kb, dkp);
      const bool ok = group_runs(
          K, t0, nt, curK,
          [&](int64_t grp) {  // q~_G = scaling * q * scale_G, b_G = q~_G . zero_G
            load_group(K, grp, sK, zK);
            for (int g = 0; g < G; ++g) {
              const float* qrow = qs + static_cast<size_t>(g) * dkp;
              float* trow = qt + static_cast<size_t>(g) * dkp;
              vf bacc = vzero();
              for (int c = 0; c < dkp; c += W) {
                const vf v = vmul(vload(qrow + c), vload(sK + c));
                vstore(trow + c, v);
                bacc = vfma(v, vload(zK + c), bacc);
              }
              bK[g] = vhsum(bacc);
            }
          },
          [&](int a0, int b0) {
            dots(qt, dkp, G, Kb + static_cast<size_t>(a0) * dkp, dkp, b0 - a0, dkp, S + a0, T);
            for (int g = 0; g < G; ++g)
              for (int t = a0; t < b0; ++t) S[g * T + t] -= bK[g];
          });
      if (!ok) {
        a.status->store(kBadGroup);
        return;
      }
    } else {  // s_t = sum_j scale_tj (q_j . lut[code] - zero_tj sum(q_j))
      decode_token_tile(K, r, t0, nt, Kb, dkp, ksc, kzs, kzsT, cs);
      dots(qs, dkp, G, Kb, dkp, nt, dkp, S, T);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < Jk; ++j) {
          const float qj = qsum[g * Jk + j];
          const float* z = kzsT + j * T;
          float* Sg = S + g * T;
          for (int t = 0; t < nt; ++t) Sg[t] -= qj * z[t];
        }
    }
    if (a.logits && it.packed == 0)
      for (int g = 0; g < G; ++g) std::memcpy(a.logits + (r * G + g) * N + t0, S + g * T, sizeof(float) * nt);
    // ---- online softmax: S becomes exp(s - m)
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_tile(S + g * T, nt, m[g], l[g]);
      if (alpha != 1.0f) {
        scale_row(acc + static_cast<size_t>(g) * dvp, dvp, alpha);
        if (V.grouping == kChannel) {
          scale_row(accG + static_cast<size_t>(g) * dvp, dvp, alpha);
          psum[g] *= alpha;
        } else {
          scale_row(corr + static_cast<size_t>(g) * Jv, Jv, alpha);
        }
      }
    }
    // ---- values
    if (V.grouping == kChannel) {
      decode_tile<kNoScale>(V.codes + (crow(V, r) + t0) * V.P, V.P, nt, dv, V.bits, V.lut, nullptr, 0, Vb, dvp);
      const bool ok = group_runs(
          V, t0, nt, curV,
          [&](int64_t grp) {
            flushV();  // the previous group's sums, with its scale and zero
            load_group(V, grp, sV, zV);
          },
          [&](int a0, int b0) {
            accum(S + a0, T, G, Vb + static_cast<size_t>(a0) * dvp, dvp, b0 - a0, dvp, accG, dvp);
            for (int g = 0; g < G; ++g) {
              float ps = 0.0f;
              for (int t = a0; t < b0; ++t) ps += S[g * T + t];
              psum[g] += ps;
            }
          });
      if (!ok) {
        a.status->store(kBadGroup);
        return;
      }
    } else {  // acc += sum_t p_t scale_tj lut[code]; corr += sum_t p_t scale_tj zero_tj
      decode_token_tile(V, r, t0, nt, Vb, dvp, vsc, vzs, vzsT, cs);
      accum(S, T, G, Vb, dvp, nt, dvp, acc, dvp);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < Jv; ++j) corr[g * Jv + j] += dot_n(S + g * T, vzsT + j * T, nt);
    }
  }
  if (V.grouping == kChannel) {
    flushV();
  } else {
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < Jv; ++j) {
        float* A = acc + static_cast<size_t>(g) * dvp + j * V.gs;
        const float cj = corr[g * Jv + j];
        for (int c = 0; c < V.gs; ++c) A[c] -= cj;
      }
  }
  for (int g = 0; g < G; ++g) {
    a.pm[item * G + g] = m[g];
    a.pl[item * G + g] = l[g];
    std::memcpy(a.pacc + (item * G + g) * static_cast<int64_t>(dvp), acc + static_cast<size_t>(g) * dvp,
                sizeof(float) * dvp);
  }
}

// Rows t < nt of a full-precision tile: dst[t][c] = x[off + t * d + c] as float32.
template <DT XDT>
static inline void dense_tile_t(const void* x, int64_t off, int nt, int d, float* dst, int ldt) {
  for (int t = 0; t < nt; ++t) {
    const int64_t o = off + static_cast<int64_t>(t) * d;
    float* row = dst + static_cast<int64_t>(t) * ldt;
    int c = 0;
    for (; c + W <= d; c += W) vstore(row + c, xload<XDT>(x, o + c));
    for (; c < d; ++c) row[c] = xload1<XDT>(x, o + c);
  }
}

static inline void dense_tile(const void* x, DT dt, int64_t off, int nt, int d, float* dst, int ldt) {
  if (dt == DT_F16)
    dense_tile_t<DT_F16>(x, off, nt, d, dst, ldt);
  else if (dt == DT_BF16)
    dense_tile_t<DT_BF16>(x, off, nt, d, dst, ldt);
  else
    dense_tile_t<DT_F32>(x, off, nt, d, dst, ldt);
}

// One work item over a full-precision block: tokens [t0, t1) of row r of a.dense[it.dense],
// the same online softmax as attend_item; writes the chunk's (max, sum, unnormalized output).
static void attend_dense_item(const AttendArgs& a, int64_t item, Scratch& s) {
  const AttendItem& it = a.items[item];
  const DenseView& D = a.dense[it.dense];
  const int64_t r = it.r, b = r / a.H, h = r % a.H;
  const int G = a.G, dk = D.dk, dv = D.dv;
  const int dkp = pad_to(dk), dvp = pad_to(dv);
  constexpr int T = kTile;
  const size_t sizes[] = {static_cast<size_t>(G) * dkp, static_cast<size_t>(T) * dkp, static_cast<size_t>(T) * dvp,
                          static_cast<size_t>(G) * T, static_cast<size_t>(G) * dvp, 2 * static_cast<size_t>(G)};
  float* buf[6];
  carve(s.f0, sizes, buf);
  float *qs = buf[0], *Kb = buf[1], *Vb = buf[2], *S = buf[3], *acc = buf[4], *m = buf[5];
  float* l = m + G;
  std::fill(Kb, Kb + sizes[1], 0.0f);
  std::fill(Vb, Vb + sizes[2], 0.0f);
  std::fill(acc, acc + sizes[4], 0.0f);
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
    float* qrow = qs + static_cast<size_t>(g) * dkp;
    const float* qin = a.qd + (r * G + g) * dk;
    for (int c = 0; c < dk; ++c) qrow[c] = a.scaling * qin[c];
    std::fill(qrow + dk, qrow + dkp, 0.0f);
  }
  const int64_t koff = D.off ? D.off[r] * dk : b * D.kb + h * D.kh;
  const int64_t voff = D.off ? D.off[r] * dv : b * D.vb + h * D.vh;
  for (int64_t t0 = it.t0; t0 < it.t1; t0 += T) {
    const int nt = static_cast<int>(std::min<int64_t>(T, it.t1 - t0));
    dense_tile(D.k, D.dt, koff + t0 * dk, nt, dk, Kb, dkp);
    dots(qs, dkp, G, Kb, dkp, nt, dkp, S, T);
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_tile(S + g * T, nt, m[g], l[g]);
      if (alpha != 1.0f) scale_row(acc + static_cast<size_t>(g) * dvp, dvp, alpha);
    }
    dense_tile(D.v, D.dt, voff + t0 * dv, nt, dv, Vb, dvp);
    accum(S, T, G, Vb, dvp, nt, dvp, acc, dvp);
  }
  for (int g = 0; g < G; ++g) {
    a.pm[item * G + g] = m[g];
    a.pl[item * G + g] = l[g];
    std::memcpy(a.pacc + (item * G + g) * static_cast<int64_t>(dvp), acc + static_cast<size_t>(g) * dvp,
                sizeof(float) * dvp);
  }
}
