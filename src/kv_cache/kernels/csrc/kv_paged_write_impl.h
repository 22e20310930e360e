// Per-ISA loops of the paged slot writer's key groups (kv_paged_write.h, encode_key_group):
// included three times by kv_kernels.cpp, after kv_kernels_impl.h, inside the generic / avx2 /
// avx512 namespaces. The arithmetic is the torch encoder's, element for element (a product then a
// sum, true division, round half to even, the same comparisons), so every path stores the same
// bytes (tests/test_vllm_codecs.py: test_compiled_writer_stores_the_torch_bytes). The build's
// -ffp-contract=off keeps a product and a sum from fusing. Math §28.2.

// rows t < n of vals [n, D]: the stored tokens of a key group, x = m0 + code * s0, from the codes
// at g0 + t * sw + ko. idl: the identity table (lut[i] = i) of `bits`.
static void key_group_decode(const uint8_t* g0, int64_t sw, int64_t ko, int n, int D, int bits, const Lut& idl,
                             const float* s0, const float* m0, float* vals) {
  for (int t = 0; t < n; ++t) {
    float* row = vals + static_cast<int64_t>(t) * D;
    decode_row(g0 + t * sw + ko, D, bits, idl, row);  // the codes as floats
    int c = 0;
    for (; c + W <= D; c += W) vstore(row + c, vadd(vload(m0 + c), vmul(vload(row + c), vload(s0 + c))));
    for (; c < D; ++c) row[c] = m0[c] + row[c] * s0[c];
  }
}

// lo[c] = min, hi[c] = max over the rows t < T with valid[t], with std::min / std::max's handling
// of NaN (a NaN entry leaves the running value as it is); lo, hi start at +inf / -inf.
static void key_group_range(const float* vals, const uint8_t* valid, int T, int D, float* lo, float* hi) {
  std::fill(lo, lo + D, std::numeric_limits<float>::infinity());
  std::fill(hi, hi + D, -std::numeric_limits<float>::infinity());
  for (int t = 0; t < T; ++t) {
    if (!valid[t]) continue;
    const float* row = vals + static_cast<int64_t>(t) * D;
    int c = 0;
#if KVK_ISA >= 1
    // min_ps(x, y) = x < y ? x : y and max_ps(x, y) = x > y ? x : y, so (row, running) is
    // std::min(running, row) = row < running ? row : running, and the same for the maximum
    for (; c + W <= D; c += W) {
      vstore(lo + c, vmin(vload(row + c), vload(lo + c)));
      vstore(hi + c, vmax(vload(row + c), vload(hi + c)));
    }
#endif
    for (; c < D; ++c) {
      lo[c] = std::min(lo[c], row[c]);
      hi[c] = std::max(hi[c], row[c]);
    }
  }
}

// Every row t < T of vals on the grid (s, m): q = min(top, max(0, round((x - m) / s))), 0 where
// s <= 0 (or NaN), packed into the slot's key codes at g0 + t * sw + ko. q: D bytes of scratch.
static void key_group_encode(const float* vals, int T, int D, int bits, const float* s, const float* m,
                             uint8_t* g0, int64_t sw, int64_t ko, uint8_t* q) {
  const float top = static_cast<float>((1 << bits) - 1);
  for (int t = 0; t < T; ++t) {
    const float* row = vals + static_cast<int64_t>(t) * D;
    int c = 0;
#if KVK_ISA >= 1
    const vf vtop = vset1(top), zero = vzero();
    for (; c + W <= D; c += W) {
      const vf sc = vload(s + c);
      vf v = vround(vdiv(vsub(vload(row + c), vload(m + c)), sc));
      v = vmin(vmax(v, zero), vtop);  // max_ps(NaN, 0) = 0, as std::max(0, NaN)
#if KVK_ISA == 2
      v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sc, zero, _CMP_GT_OQ), v);
#else
      v = _mm256_and_ps(_mm256_cmp_ps(sc, zero, _CMP_GT_OQ), v);
#endif
      vstore_u8(q + c, v);
    }
#endif
    for (; c < D; ++c) {
      const float v = s[c] > 0 ? std::nearbyint((row[c] - m[c]) / s[c]) : 0.0f;
      q[c] = static_cast<uint8_t>(std::min(top, std::max(0.0f, v)));
    }
    pack_row(q, D, bits, g0 + t * sw + ko);
  }
}

// Lloyd-Max codes of one value: q[c] = the number of midpoints strictly below x[c] / s (0 where
// s <= 0), torch.bucketize's count over the ascending midpoints, the while loop's answer
// (a NaN ratio is below no midpoint: code 0).
static void level_codes(const float* x, float s, int D, const float* mids, int nmids, uint8_t* q) {
  int c = 0;
#if KVK_ISA >= 1
  if (s > 0) {
    const vf sv = vset1(s), one = vset1(1.0f);
    for (; c + W <= D; c += W) {
      const vf v = vdiv(vload(x + c), sv);
      vf k = vzero();
      for (int j = 0; j < nmids; ++j) {
#if KVK_ISA == 2
        k = _mm512_mask_add_ps(k, _mm512_cmp_ps_mask(vset1(mids[j]), v, _CMP_LT_OQ), k, one);
#else
        k = vadd(k, _mm256_and_ps(_mm256_cmp_ps(vset1(mids[j]), v, _CMP_LT_OQ), one));
#endif
      }
      vstore_u8(q + c, k);
    }
  }
#endif
  for (; c < D; ++c) {
    const float v = s > 0 ? x[c] / s : 0.0f;
    int k = 0;  // midpoints strictly below v (torch.bucketize, right=False)
    while (k < nmids && mids[k] < v) ++k;
    q[c] = static_cast<uint8_t>(k);
  }
}
