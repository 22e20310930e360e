// Per-ISA kernel bodies of kv_kernels.cpp. This file is included twice, inside
// `namespace kvk::generic` (portable C++, any x86_64) and inside `namespace kvk::avx2`
// (under `#pragma GCC target("avx2,fma,f16c")`, with KVK_AVX2 defined); the dispatcher in
// kv_kernels.cpp picks one at run time from the CPU's feature bits. Everything here is
// single-threaded: one call processes one work item (a row chunk); threads are spread over
// items by kv_kernels.cpp. Math: math_dictionary/kv-compression-math.md section 15.
//
// Buffers of decoded values are padded to a multiple of kPad floats per token so the
// vector loops never need a tail; the padding is zero and stays zero.

// ----------------------------------------------------------------------------- vectors
#if KVK_AVX2
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
// out[0..4) = horizontal sums of a0..a3
static inline void vhsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
// exp for x <= 0 (Cephes expf polynomial, ~2 ulp); inputs below -87.3 give ~1e-38, not 0
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
// 8 floats holding integers in [0, 255] -> 8 bytes
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
static inline float vhsum(vf v) { return v; }
static inline float vhmax(vf v) { return v; }
static inline float vhmin(vf v) { return v; }
static inline void vhsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
  out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}
static inline vf vexp(vf x) { return std::exp(x); }
static inline void vstore_u8(uint8_t* p, vf v) { *p = static_cast<uint8_t>(v); }
#endif

// ----------------------------------------------------------------------------- rows
// dst[0..n) = x[0..n) as float32, x of dtype dt (F32, F16, BF16)
static inline void load_row(const void* x, DT dt, int n, float* dst) {
  int c = 0;
  if (dt == DT_F32) {
    std::memcpy(dst, x, sizeof(float) * n);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(x);
#if KVK_AVX2
  if (dt == DT_F16) {
    for (; c + 8 <= n; c += 8)
      _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + c))));
  } else {
    for (; c + 8 <= n; c += 8) {
      __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + c)));
      _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
#endif
  if (dt == DT_F16)
    for (; c < n; ++c) dst[c] = f16_to_f32(h[c]);
  else
    for (; c < n; ++c) dst[c] = bf16_to_f32(h[c]);
}

// out[0..n) = src[0..n) converted (round to nearest even) to dt (F32, F16, BF16)
static inline void store_row(const float* src, int n, void* out, DT dt) {
  int c = 0;
  if (dt == DT_F32) {
    std::memcpy(out, src, sizeof(float) * n);
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(out);
#if KVK_AVX2
  if (dt == DT_F16) {
    for (; c + 8 <= n; c += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + c),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    for (; c + 8 <= n; c += 8) {
      __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + c));
      __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
      __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + c), p);
    }
  }
#endif
  if (dt == DT_F16)
    for (; c < n; ++c) h[c] = f32_to_f16(src[c]);
  else
    for (; c < n; ++c) h[c] = f32_to_bf16(src[c]);
}

// dst[c] = lut[code_c], c < d, for the d codes of one token packed at p (packing.py layout).
// `lut` has at least 16 entries (zero padded past 2**bits).
static inline void decode_row(const uint8_t* p, int d, int bits, const float* lut, float* dst) {
  int c = 0;
#if KVK_AVX2
  if (bits == 4) {
    const __m256 lo = _mm256_loadu_ps(lut), hi = _mm256_loadu_ps(lut + 8);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m = _mm256_set1_epi32(15);
    for (; c + 8 <= d; c += 8) {
      uint32_t w;
      std::memcpy(&w, p + c / 2, 4);
      __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), m);
      __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
      _mm256_storeu_ps(dst + c, _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28))));
    }
  } else if (bits == 2) {
    const __m256 lo = _mm256_loadu_ps(lut);
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), m = _mm256_set1_epi32(3);
    for (; c + 8 <= d; c += 8) {
      uint16_t w;
      std::memcpy(&w, p + c / 4, 2);
      __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), m);
      _mm256_storeu_ps(dst + c, _mm256_permutevar8x32_ps(lo, idx));
    }
  } else if (bits == 3) {
    const __m256 lo = _mm256_loadu_ps(lut);
    const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), m = _mm256_set1_epi32(7);
    for (; c + 8 <= d; c += 8) {
      const uint8_t* b = p + 3 * (c / 8);
      int w = b[0] | (b[1] << 8) | (b[2] << 16);
      __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), m);
      _mm256_storeu_ps(dst + c, _mm256_permutevar8x32_ps(lo, idx));
    }
  } else {
    for (; c + 8 <= d; c += 8) {
      __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)));
      _mm256_storeu_ps(dst + c, _mm256_i32gather_ps(lut, idx, 4));
    }
  }
#endif
  for (; c < d; ++c) dst[c] = lut[code_at(p, c, bits)];
}

// q[c] = clamp(round(x[c] / s[c]) + z[c], lo, hi) + add as bytes (the quantizer's rounding:
// true division, round half to even). S_ARR: s and z are per-element arrays, else scalars s[0], z[0].
template <bool S_ARR>
static inline void quant_row(const float* x, const float* s, const float* z, int n, float lo, float hi,
                             float add, uint8_t* q) {
  int c = 0;
#if KVK_AVX2
  const vf vlo = vset1(lo), vhi = vset1(hi), vadd_ = vset1(add);
  const vf vs = vset1(s[0]), vz = vset1(z[0]);
  for (; c + 8 <= n; c += 8) {
    vf v = vround(vdiv(vload(x + c), S_ARR ? vload(s + c) : vs));
    v = vmin(vmax(vadd(v, S_ARR ? vload(z + c) : vz), vlo), vhi);
    vstore_u8(q + c, vadd(v, vadd_));
  }
#endif
  for (; c < n; ++c) {
    float v = std::nearbyint(x[c] / s[S_ARR ? c : 0]) + z[S_ARR ? c : 0];
    v = std::min(std::max(v, lo), hi);
    q[c] = static_cast<uint8_t>(v + add);
  }
}

// mn/mx/fin over x[0..n): fin is 0 when every value is finite, NaN otherwise (x * 0 summed)
static inline void minmax_range(const float* x, int n, float& mn, float& mx, float& fin) {
  int c = 0;
  vf vmn = vset1(std::numeric_limits<float>::infinity()), vmx = vset1(-std::numeric_limits<float>::infinity());
  vf vfin = vzero(), zero = vzero();
  for (; c + W <= n; c += W) {
    vf v = vload(x + c);
    vmn = vmin(vmn, v);
    vmx = vmax(vmx, v);
    vfin = vadd(vfin, vmul(v, zero));
  }
  float a = vhmin(vmn), b = vhmax(vmx), f = vhsum(vfin);
  for (; c < n; ++c) {
    a = std::min(a, x[c]);
    b = std::max(b, x[c]);
    f += x[c] * 0.0f;
  }
  mn = a;
  mx = b;
  fin = f;
}

// ----------------------------------------------------------------------------- quantize
// One work item of quantize: "channel" grouping = one group of g tokens of one row;
// "token" grouping = up to kTokChunk tokens of one row.
static void quantize_item(const QuantArgs& a, int64_t item, Scratch& s) {
  const int d = a.d, bits = a.bits;
  const bool book = a.codebook;
  const float lo = a.qlo, hi = a.qhi, add = a.qadd;
  s.f0.resize(d + kPad);  // scale as used (float32)
  s.f1.resize(d + kPad);  // zero point (uniform) as float
  s.u8.resize(d + kPad);
  float* sc = s.f0.data();
  float* zp = s.f1.data();
  uint8_t* qb = s.u8.data();
  const size_t xsz = dt_size(a.xdt);
  if (a.grouping == kChannel) {
    const int g = a.gs;
    const int64_t ng = a.N / g, r = item / ng, grp = item % ng;
    const int64_t t0 = grp * g;
    s.f2.resize(static_cast<size_t>(g) * d + kPad);
    s.f3.resize(3 * (d + kPad));
    float* xb = s.f2.data();
    float* mn = s.f3.data();
    float* mx = mn + d + kPad;
    float* fin = mx + d + kPad;
    const char* x = static_cast<const char*>(a.x) + ((r * a.N + t0) * d) * xsz;
    for (int t = 0; t < g; ++t) load_row(x + t * d * xsz, a.xdt, d, xb + static_cast<int64_t>(t) * d);
    const int64_t meta_off = (r * ng + grp) * d;
    if (!book) {
      std::copy(xb, xb + d, mn);
      std::copy(xb, xb + d, mx);
      std::fill(fin, fin + d, 0.0f);
      for (int t = 1; t < g; ++t) {
        const float* row = xb + static_cast<int64_t>(t) * d;
        int c = 0;
        const vf zero = vzero();
        for (; c + W <= d; c += W) {
          vf v = vload(row + c);
          vstore(mn + c, vmin(vload(mn + c), v));
          vstore(mx + c, vmax(vload(mx + c), v));
          vstore(fin + c, vadd(vload(fin + c), vmul(v, zero)));
        }
        for (; c < d; ++c) {
          mn[c] = std::min(mn[c], row[c]);
          mx[c] = std::max(mx[c], row[c]);
          fin[c] += row[c] * 0.0f;
        }
      }
      for (int c = 0; c < d; ++c) {
        fin[c] += xb[c] * 0.0f;
        if (fin[c] != 0.0f) {
          a.status->store(kNonFinite);
          return;
        }
        if (!uniform_scale(a, mn[c], mx[c], meta_off + c, sc[c], zp[c])) return;
      }
      for (int t = 0; t < g; ++t) {
        quant_row<true>(xb + static_cast<int64_t>(t) * d, sc, zp, d, lo, hi, add, qb);
        pack_row(qb, d, bits, a.codes + (r * a.N + t0 + t) * a.P);
      }
    } else {
      double* ss = s.d0.data();
      s.d0.assign(d, 0.0);
      ss = s.d0.data();
      for (int t = 0; t < g; ++t) {
        const float* row = xb + static_cast<int64_t>(t) * d;
        for (int c = 0; c < d; ++c) ss[c] += static_cast<double>(row[c]) * row[c];
      }
      for (int c = 0; c < d; ++c)
        if (!rms_scale(a, ss[c], g, meta_off + c, sc[c])) return;
      for (int t = 0; t < g; ++t) {
        book_row(xb + static_cast<int64_t>(t) * d, sc, true, d, a.mids, a.nmids, qb);
        pack_row(qb, d, bits, a.codes + (r * a.N + t0 + t) * a.P);
      }
    }
  } else {
    const int gs = a.gs, J = d / gs;
    const int64_t chunks = (a.N + kTokChunk - 1) / kTokChunk, r = item / chunks;
    const int64_t t0 = (item % chunks) * kTokChunk, t1 = std::min<int64_t>(a.N, t0 + kTokChunk);
    s.f2.resize(d + kPad);
    float* xb = s.f2.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = r * a.N + t;
      load_row(static_cast<const char*>(a.x) + row * d * xsz, a.xdt, d, xb);
      for (int j = 0; j < J; ++j) {
        const float* xg = xb + j * gs;
        float s1, z1;
        if (!book) {
          float mn, mx, fin;
          minmax_range(xg, gs, mn, mx, fin);
          if (fin != 0.0f) {
            a.status->store(kNonFinite);
            return;
          }
          if (!uniform_scale(a, mn, mx, row * J + j, s1, z1)) return;
          quant_row<false>(xg, &s1, &z1, gs, lo, hi, add, qb + j * gs);
        } else {
          double ss = 0.0;
          for (int c = 0; c < gs; ++c) ss += static_cast<double>(xg[c]) * xg[c];
          if (!rms_scale(a, ss, gs, row * J + j, s1)) return;
          book_row(xg, &s1, false, gs, a.mids, a.nmids, qb + j * gs);
        }
      }
      pack_row(qb, d, bits, a.codes + row * a.P);
    }
  }
}

// ----------------------------------------------------------------------------- dequantize
// One work item: up to kTokChunk tokens of one row.
static void dequantize_item(const DequantArgs& a, int64_t item, Scratch& s) {
  const BlockView& b = a.blk;
  const int d = b.d;
  const int64_t chunks = (b.N + kTokChunk - 1) / kTokChunk, r = item / chunks;
  const int64_t t0 = (item % chunks) * kTokChunk, t1 = std::min<int64_t>(b.N, t0 + kTokChunk);
  s.f0.resize(d + kPad);
  s.f1.resize(d + kPad);
  s.f2.resize(d + kPad);
  float* vb = s.f0.data();
  float* sb = s.f1.data();
  float* zb = s.f2.data();
  const size_t osz = dt_size(a.odt);
  char* out = static_cast<char*>(a.out);
  if (b.grouping == kChannel) {
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
      int c = 0;
      for (; c + W <= d; c += W) vstore(vb + c, vmul(vsub(vload(vb + c), vload(zb + c)), vload(sb + c)));
      for (; c < d; ++c) vb[c] = (vb[c] - zb[c]) * sb[c];
      store_row(vb, d, out + row * d * osz, a.odt);
    }
  } else {
    const int gs = b.gs, J = d / gs;
    const int64_t nt = t1 - t0;
    s.f1.resize(nt * J + kPad);
    s.f2.resize(nt * J + kPad);
    sb = s.f1.data();
    zb = s.f2.data();
    meta_load(b.scale, (r * b.N + t0) * J, nt * J, sb);
    meta_load(b.zero, (r * b.N + t0) * J, nt * J, zb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = r * b.N + t;
      decode_row(b.codes + row * b.P, d, b.bits, b.lut, vb);
      const float* st = sb + (t - t0) * J;
      const float* zt = zb + (t - t0) * J;
      for (int j = 0; j < J; ++j) {
        float* v = vb + j * gs;
        const vf vs = vset1(st[j]), vz = vset1(zt[j]);
        int c = 0;
        for (; c + W <= gs; c += W) vstore(v + c, vmul(vsub(vload(v + c), vz), vs));
        for (; c < gs; ++c) v[c] = (v[c] - zt[j]) * st[j];
      }
      store_row(vb, d, out + row * d * osz, a.odt);
    }
  }
}

// ----------------------------------------------------------------------------- attention
// S[g*lds + t] = sum_c Q[g*ldq + c] * K[t*ldk + c] for g < GB, t < T; c < dp (dp % kPad == 0)
template <int GB>
static inline void dots_block(const float* Q, int ldq, const float* K, int ldk, int T, int dp, float* S,
                              int lds) {
  int t = 0;
  for (; t + 4 <= T; t += 4) {
    vf acc[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < 4; ++i) acc[g][i] = vzero();
    const float* k = K + static_cast<int64_t>(t) * ldk;
    for (int c = 0; c < dp; c += W) {
      vf k0 = vload(k + c), k1 = vload(k + ldk + c), k2 = vload(k + 2 * ldk + c), k3 = vload(k + 3 * ldk + c);
      for (int g = 0; g < GB; ++g) {
        vf q = vload(Q + g * ldq + c);
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
      vf kv = vload(k + c);
      for (int g = 0; g < GB; ++g) acc[g] = vfma(vload(Q + g * ldq + c), kv, acc[g]);
    }
    for (int g = 0; g < GB; ++g) S[g * lds + t] = vhsum(acc[g]);
  }
}

static void dots(const float* Q, int ldq, int G, const float* K, int ldk, int T, int dp, float* S, int lds) {
  int g = 0;
  for (; g + 3 <= G; g += 3) dots_block<3>(Q + g * ldq, ldq, K, ldk, T, dp, S + g * lds, lds);
  if (G - g == 2) dots_block<2>(Q + g * ldq, ldq, K, ldk, T, dp, S + g * lds, lds);
  if (G - g == 1) dots_block<1>(Q + g * ldq, ldq, K, ldk, T, dp, S + g * lds, lds);
}

// A[g*lda + c] += sum_t P[g*ldp + t] * V[t*ldv + c] for g < GB, c in [c0, c0 + NV*W)
template <int GB, int NV>
static inline void accum_block(const float* P, int ldp, const float* V, int ldv, int T, int c0, float* A,
                               int lda) {
  vf acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = vload(A + g * lda + c0 + j * W);
  for (int t = 0; t < T; ++t) {
    const float* v = V + static_cast<int64_t>(t) * ldv + c0;
    vf vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = vload(v + j * W);
    for (int g = 0; g < GB; ++g) {
      vf p = vset1(P[g * ldp + t]);
      for (int j = 0; j < NV; ++j) acc[g][j] = vfma(p, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) vstore(A + g * lda + c0 + j * W, acc[g][j]);
}

template <int GB>
static inline void accum_rows(const float* P, int ldp, const float* V, int ldv, int T, int dp, float* A,
                              int lda) {
  int c = 0;
  for (; c + 4 * W <= dp; c += 4 * W) accum_block<GB, 4>(P, ldp, V, ldv, T, c, A, lda);
  for (; c + W <= dp; c += W) accum_block<GB, 1>(P, ldp, V, ldv, T, c, A, lda);
}

static void accum(const float* P, int ldp, int G, const float* V, int ldv, int T, int dp, float* A, int lda) {
  int g = 0;
  for (; g + 2 <= G; g += 2) accum_rows<2>(P + g * ldp, ldp, V, ldv, T, dp, A + g * lda, lda);
  if (g < G) accum_rows<1>(P + g * ldp, ldp, V, ldv, T, dp, A + g * lda, lda);
}

static inline void scale_row(float* x, int n, float f) {
  const vf vf_ = vset1(f);
  int c = 0;
  for (; c + W <= n; c += W) vstore(x + c, vmul(vload(x + c), vf_));
  for (; c < n; ++c) x[c] *= f;
}

// One work item: tokens [t0, t1) of row r; writes the chunk's (max, sum, unnormalized output).
static void attend_item(const AttendArgs& a, int64_t item, Scratch& s) {
  const AttendItem& it = a.items[item];
  const BlockView& K = a.k;
  const BlockView& V = a.v;
  const int64_t r = it.r, N = K.N;
  const int G = a.G, dk = K.d, dv = V.d;
  const int dkp = pad_to(dk), dvp = pad_to(dv);
  const int Jk = K.grouping == kToken ? dk / K.gs : 0;
  const int Jv = V.grouping == kToken ? dv / V.gs : 0;
  constexpr int T = kTile;
  // scratch layout (floats)
  const size_t n_qs = static_cast<size_t>(G) * dkp;  // scaling * q, padded
  const size_t n_qt = n_qs;                          // channel keys: q * scale_G
  const size_t n_bias = static_cast<size_t>(G) * T;
  const size_t n_qsum = static_cast<size_t>(G) * std::max(Jk, 1);
  const size_t n_kb = static_cast<size_t>(T) * dkp, n_vb = static_cast<size_t>(T) * dvp;
  const size_t n_S = static_cast<size_t>(G) * T;
  const size_t n_acc = static_cast<size_t>(G) * dvp;
  const size_t n_corr = static_cast<size_t>(G) * std::max(Jv, 1);
  const size_t n_meta = static_cast<size_t>(T) * (std::max(Jk, 1) + std::max(Jv, 1)) * 2 + 4 * (dkp + dvp);
  const size_t total = n_qs + n_qt + n_bias + n_qsum + n_kb + n_vb + n_S + 2 * n_acc + n_corr + n_meta +
                       5 * static_cast<size_t>(G) + 16;
  if (s.f0.size() < total) s.f0.resize(total);
  float* p = s.f0.data();
  auto take = [&p](size_t n) { float* q = p; p += n; return q; };
  float* qs = take(n_qs);
  float* qt = take(n_qt);
  float* bias = take(n_bias);
  float* qsum = take(n_qsum);
  float* Kb = take(n_kb);
  float* Vb = take(n_vb);
  float* S = take(n_S);
  float* acc = take(n_acc);
  float* accG = take(n_acc);
  float* corr = take(n_corr);
  float* ksc = take(static_cast<size_t>(T) * std::max(Jk, 1));
  float* kzs = take(static_cast<size_t>(T) * std::max(Jk, 1));
  float* vsc = take(static_cast<size_t>(T) * std::max(Jv, 1));
  float* vzs = take(static_cast<size_t>(T) * std::max(Jv, 1));
  float* sK = take(dkp);
  float* zK = take(dkp);
  float* sV = take(dvp);
  float* zV = take(dvp);
  float* m = take(G);
  float* l = take(G);
  float* psum = take(G);
  float* bK = take(G);
  // zero what is read before being written (pads of the tiles, accumulators)
  std::fill(Kb, Kb + n_kb, 0.0f);
  std::fill(Vb, Vb + n_vb, 0.0f);
  std::fill(acc, acc + n_acc, 0.0f);
  std::fill(accG, accG + n_acc, 0.0f);
  std::fill(corr, corr + n_corr, 0.0f);
  std::fill(qt, qt + n_qt, 0.0f);
  std::fill(sK + dk, sK + dkp, 0.0f);
  std::fill(zK + dk, zK + dkp, 0.0f);
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
    psum[g] = 0.0f;
    float* qrow = qs + static_cast<size_t>(g) * dkp;
    const float* qin = a.q + (r * G + g) * dk;
    for (int c = 0; c < dk; ++c) qrow[c] = a.scaling * qin[c];
    std::fill(qrow + dk, qrow + dkp, 0.0f);
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
  for (int64_t t0 = it.t0; t0 < it.t1; t0 += T) {
    const int nt = static_cast<int>(std::min<int64_t>(T, it.t1 - t0));
    // ---- keys -> scores S[g][t]
    for (int t = 0; t < nt; ++t)
      decode_row(K.codes + (r * N + t0 + t) * K.P, dk, K.bits, K.lut, Kb + static_cast<size_t>(t) * dkp);
    if (K.grouping == kChannel) {
      int a0 = 0;
      while (a0 < nt) {
        const int64_t grp = K.gid ? K.gid[r * N + t0 + a0] : (t0 + a0) / K.gs;
        int b0 = a0 + 1;
        while (b0 < nt && (K.gid ? K.gid[r * N + t0 + b0] : (t0 + b0) / K.gs) == grp) ++b0;
        if (grp < 0 || grp >= K.NG) {
          a.status->store(kBadGroup);
          return;
        }
        if (grp != curK) {  // q~_G = scaling * q * scale_G, b_G = q~_G . zero_G
          meta_load(K.scale, (r * K.NG + grp) * dk, dk, sK);
          meta_load(K.zero, (r * K.NG + grp) * dk, dk, zK);
          for (int g = 0; g < G; ++g) {
            const float* qrow = qs + static_cast<size_t>(g) * dkp;
            float* trow = qt + static_cast<size_t>(g) * dkp;
            vf bacc = vzero();
            for (int c = 0; c < dkp; c += W) {
              vf v = vmul(vload(qrow + c), vload(sK + c));
              vstore(trow + c, v);
              bacc = vfma(v, vload(zK + c), bacc);
            }
            bK[g] = vhsum(bacc);
          }
          curK = grp;
        }
        dots(qt, dkp, G, Kb + static_cast<size_t>(a0) * dkp, dkp, b0 - a0, dkp, S + a0, T);
        for (int g = 0; g < G; ++g)
          for (int t = a0; t < b0; ++t) S[g * T + t] -= bK[g];
        a0 = b0;
      }
    } else {
      const int gs = K.gs;
      meta_load(K.scale, (r * N + t0) * Jk, static_cast<int64_t>(nt) * Jk, ksc);
      meta_load(K.zero, (r * N + t0) * Jk, static_cast<int64_t>(nt) * Jk, kzs);
      for (int t = 0; t < nt; ++t) {  // scale the tile in L1; keep zero * scale for the bias
        float* row = Kb + static_cast<size_t>(t) * dkp;
        for (int j = 0; j < Jk; ++j) {
          const float sj = ksc[t * Jk + j];
          kzs[t * Jk + j] *= sj;
          scale_row(row + j * gs, gs, sj);
        }
      }
      dots(qs, dkp, G, Kb, dkp, nt, dkp, S, T);
      for (int g = 0; g < G; ++g)
        for (int t = 0; t < nt; ++t) {
          float bsum = 0.0f;
          for (int j = 0; j < Jk; ++j) bsum += kzs[t * Jk + j] * qsum[g * Jk + j];
          S[g * T + t] -= bsum;
        }
    }
    if (a.logits)
      for (int g = 0; g < G; ++g)
        std::memcpy(a.logits + (r * G + g) * N + t0, S + g * T, sizeof(float) * nt);
    // ---- online softmax: S becomes exp(s - m)
    for (int g = 0; g < G; ++g) {
      float* Sg = S + g * T;
      float mt = Sg[0];
      for (int t = 1; t < nt; ++t) mt = std::max(mt, Sg[t]);
      if (mt > m[g]) {
        const float alpha = std::exp(m[g] - mt);  // 0 on the first tile
        m[g] = mt;
        l[g] *= alpha;
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
      const vf mv = vset1(m[g]);
      int t = 0;
      vf lsum = vzero();
      for (; t + W <= nt; t += W) {
        vf e = vexp(vsub(vload(Sg + t), mv));
        vstore(Sg + t, e);
        lsum = vadd(lsum, e);
      }
      float ls = vhsum(lsum);
      for (; t < nt; ++t) {
        Sg[t] = std::exp(Sg[t] - m[g]);
        ls += Sg[t];
      }
      l[g] += ls;
    }
    // ---- values
    for (int t = 0; t < nt; ++t)
      decode_row(V.codes + (r * N + t0 + t) * V.P, dv, V.bits, V.lut, Vb + static_cast<size_t>(t) * dvp);
    if (V.grouping == kChannel) {
      int a0 = 0;
      while (a0 < nt) {
        const int64_t grp = V.gid ? V.gid[r * N + t0 + a0] : (t0 + a0) / V.gs;
        int b0 = a0 + 1;
        while (b0 < nt && (V.gid ? V.gid[r * N + t0 + b0] : (t0 + b0) / V.gs) == grp) ++b0;
        if (grp < 0 || grp >= V.NG) {
          a.status->store(kBadGroup);
          return;
        }
        if (grp != curV) {
          flushV();
          meta_load(V.scale, (r * V.NG + grp) * dv, dv, sV);
          meta_load(V.zero, (r * V.NG + grp) * dv, dv, zV);
          std::fill(sV + dv, sV + dvp, 0.0f);
          std::fill(zV + dv, zV + dvp, 0.0f);
          curV = grp;
        }
        accum(S + a0, T, G, Vb + static_cast<size_t>(a0) * dvp, dvp, b0 - a0, dvp, accG, dvp);
        for (int g = 0; g < G; ++g) {
          float ps = 0.0f;
          for (int t = a0; t < b0; ++t) ps += S[g * T + t];
          psum[g] += ps;
        }
        a0 = b0;
      }
    } else {
      const int gs = V.gs;
      meta_load(V.scale, (r * N + t0) * Jv, static_cast<int64_t>(nt) * Jv, vsc);
      meta_load(V.zero, (r * N + t0) * Jv, static_cast<int64_t>(nt) * Jv, vzs);
      for (int t = 0; t < nt; ++t) {
        float* row = Vb + static_cast<size_t>(t) * dvp;
        for (int j = 0; j < Jv; ++j) {
          const float sj = vsc[t * Jv + j];
          vzs[t * Jv + j] *= sj;
          scale_row(row + j * gs, gs, sj);
        }
      }
      accum(S, T, G, Vb, dvp, nt, dvp, acc, dvp);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < Jv; ++j) {
          float cs = 0.0f;
          for (int t = 0; t < nt; ++t) cs += S[g * T + t] * vzs[t * Jv + j];
          corr[g * Jv + j] += cs;
        }
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
