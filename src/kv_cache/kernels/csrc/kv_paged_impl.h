// Per-ISA body of the paged attention kernel (kv_paged.h): included three times by
// kv_kernels.cpp, after kv_kernels_impl.h, inside the generic / avx2 / avx512 namespaces, so it
// uses that ISA's decode_tile, dots, accum and vexp. Math: math_dictionary/kv-compression-math.md
// §28.5.
//
// The cache is read where it lies: a tile of kTile = 32 tokens of one request and kv head is
// 32 consecutive slots of one block (block sizes are multiples of 32), found through the block
// table; nothing is gathered into a new buffer. A slot of W bytes holds
//   [ key codes | key meta | value codes | value meta ]   at byte offsets ko, kmo, vo, vmo.
// Keys: per-channel groups of 32 slots (the tile), float16 scale s_c and minimum m_c spread over
// the 32 slots' meta bytes (k = m + s * code), or per-token int8 (k = s_t * (byte - 128)).
// Values: codebook levels times a per-token 8-bit log-coded norm, per-token int8, or per token
// and 32-channel group uniform (v = m_j + s_j * code).

// One span of one request and kv head, for its M query rows: tokens [t_begin, t_end) read from
// the cache (cached tokens of the request), or, with sp.fresh, the step's own tokens
// [t_begin, t_end) of k_new / v_new in full precision, query row g seeing token t only when
// t <= its token index (causal). Writes the span's (max, sum, unnormalized output) at sp.part.
static void paged_span(const PagedArgs& a, const PagedSpan& sp, Scratch& s) {
  const int64_t r = sp.r, h = sp.h;
  const int M = sp.M, D = a.D, dp = pad_to(a.D);
  const int64_t t_begin = sp.t_begin, t_end = sp.t_end;
  constexpr int T = kTile;
  const int J = D / kPagedChannelGroup;  // KIVI value groups per token
  const size_t sizes[] = {
      static_cast<size_t>(M) * dp,  // qs: scaling * q
      static_cast<size_t>(M) * dp,  // qt: q * s (channel-grouped keys)
      static_cast<size_t>(T) * dp,  // Kb
      static_cast<size_t>(T) * dp,  // Vb
      static_cast<size_t>(M) * T,   // S
      static_cast<size_t>(M) * dp,  // acc
      2 * static_cast<size_t>(dp),  // sK mK
      static_cast<size_t>(T) * (2 * J + 1),  // per-token factors / KIVI scales and minima
      3 * static_cast<size_t>(M),   // m l bK
      2 * static_cast<size_t>(dp),  // rc rs: the angles of keys before RoPE
      static_cast<size_t>(dp) * T,  // kt: a key tile's transpose (many rows: dots_wide)
  };
  float* buf[11];
  carve(s.f0, sizes, buf);
  float *qs = buf[0], *qt = buf[1], *Kb = buf[2], *Vb = buf[3], *S = buf[4], *acc = buf[5];
  float *sK = buf[6], *mK = sK + dp, *f = buf[7], *m = buf[8];
  float* l = m + M;
  float* bK = l + M;
  float *rc = buf[9], *rs = rc + dp;
  float* kt = buf[10];
  // S = Q K^T for `rows` query rows against a tile of nt keys: transposed for many rows
  auto tile_dots = [&](const float* Qr, int rows, int nt, float* Sr) {
    if (rows >= kWideRows)
      dots_wide(Qr, dp, rows, Kb, dp, nt, D, Sr, T, kt);
    else
      dots(Qr, dp, rows, Kb, dp, nt, dp, Sr, T);
  };
  const KeyRope* rope = a.rope;
  std::fill(Kb, Kb + sizes[2], 0.0f);
  std::fill(Vb, Vb + sizes[3], 0.0f);
  std::fill(acc, acc + sizes[5], 0.0f);
  std::fill(sK, sK + sizes[6], 0.0f);
  uint16_t half[2 * 1024];  // one key group's float16 [2, D] (D <= 1024, checked by the host)
  for (int g = 0; g < M; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
    float* qrow = qs + static_cast<size_t>(g) * dp;
    const float* qin = sp.Q ? a.q + ((sp.q0 + g % sp.Q) * a.Hq + h * a.G + g / sp.Q) * static_cast<int64_t>(D)
                            : a.q + ((r * a.H + h) * M + g) * static_cast<int64_t>(D);
    for (int c = 0; c < D; ++c) qrow[c] = a.scaling * qin[c];
    std::fill(qrow + D, qrow + dp, 0.0f);
    std::fill(qt + static_cast<size_t>(g) * dp, qt + static_cast<size_t>(g + 1) * dp, 0.0f);
  }
  auto f16 = [](const uint8_t* p) {
    uint16_t u;
    std::memcpy(&u, p, 2);
    return h2f(u);
  };
  const int64_t W_ = a.sw;  // slot bytes (W is the vector width)
  if (sp.fresh) {  // the step's own tokens in full precision, causal
    const int Q = sp.Q, G = M / sp.Q;  // row g * Q + i: query head g of the kv head, step token i
    for (int64_t t0 = t_begin; t0 < t_end; t0 += T) {
      const int nt = static_cast<int>(std::min<int64_t>(T, t_end - t0));
      for (int t = 0; t < nt; ++t) {
        const int64_t src = ((sp.q0 + t0 + t) * a.H + h) * static_cast<int64_t>(D);
        std::memcpy(Kb + static_cast<size_t>(t) * dp, a.knew + src, sizeof(float) * D);
        std::memcpy(Vb + static_cast<size_t>(t) * dp, a.vnew + src, sizeof(float) * D);
      }
      // only the rows of tokens i >= t0 see any key of this tile: per query head, rows [t0, Q)
      for (int gq = 0; gq < G; ++gq) {
        const int row0 = gq * Q + static_cast<int>(t0), rows = Q - static_cast<int>(t0);
        float* Sr = S + static_cast<size_t>(row0) * T;
        tile_dots(qs + static_cast<size_t>(row0) * dp, rows, nt, Sr);
        for (int j = 0; j < rows; ++j) {  // token t0 + j sees the tile's keys t <= j
          float* srow = Sr + static_cast<size_t>(j) * T;
          for (int t = j + 1; t < nt; ++t) srow[t] = -std::numeric_limits<float>::infinity();
          const float alpha = softmax_tile(srow, nt, m[row0 + j], l[row0 + j]);
          if (alpha != 1.0f) scale_row(acc + static_cast<size_t>(row0 + j) * dp, dp, alpha);
        }
        accum(Sr, T, rows, Vb, dp, nt, dp, acc + static_cast<size_t>(row0) * dp, dp);
      }
    }
  }
  for (int64_t t0 = sp.fresh ? t_end : t_begin; t0 < t_end; t0 += T) {
    const int nt = static_cast<int>(std::min<int64_t>(T, t_end - t0));
    const int64_t blk = a.table[r * a.tpitch + t0 / a.bs];
    const uint8_t* slot = a.cache + ((blk * a.H + h) * a.bs + t0 % a.bs) * W_;
    if (t0 + T < t_end) {  // the next tile's slots, requested now (latency-bound decoding)
      const int64_t nb = a.table[r * a.tpitch + (t0 + T) / a.bs];
      prefetch_range(a.cache + ((nb * a.H + h) * a.bs + (t0 + T) % a.bs) * W_, static_cast<int64_t>(T) * W_);
    }
    // ---- keys -> scores S[g][t]
    if (rope) {  // keys before RoPE: k_t = f R(t0 + t) k_hat_t, each row turned once, then q . k
      if (a.k_kind == kPagedKeyChannel) {
        uint8_t* gm = reinterpret_cast<uint8_t*>(half);
        for (int i = 0; i < T; ++i) std::memcpy(gm + i * a.kmb, slot + i * W_ + a.kmo, a.kmb);
        for (int c = 0; c < D; ++c) {  // A = f s, C = f m (f = 1 past the pairs)
          const float fc = c < 2 * rope->half ? rope->factor : 1.0f;
          sK[c] = fc * h2f(half[c]);
          mK[c] = fc * h2f(half[D + c]);
        }
        decode_tile<kNoScale>(slot + a.ko, W_, nt, D, a.k_bits, a.klut, nullptr, 0, Kb, dp);
        for (int t = 0; t < nt; ++t) {
          float* row = Kb + static_cast<size_t>(t) * dp;
          for (int c = 0; c < dp; c += W) vstore(row + c, vfma(vload(sK + c), vload(row + c), vload(mK + c)));
        }
      } else {
        for (int t = 0; t < nt; ++t) f[t] = f16(slot + t * W_ + a.kmo);
        decode_tile<kTokenScale>(slot + a.ko, W_, nt, D, 8, a.klut, f, 1, Kb, dp);
        if (rope->factor != 1.0f)
          for (int t = 0; t < nt; ++t) scale_row(Kb + static_cast<size_t>(t) * dp, 2 * rope->half, rope->factor);
      }
      for (int t = 0; t < nt; ++t) {  // exact angles at the tile's first token, then one step each
        if (t == 0)
          rope_at(rc, rs, rope->tab, rope->half, static_cast<int32_t>(t0));
        else
          rope_advance(rc, rs, rope->tab, rope->half, 1u);
        rope_row(Kb + static_cast<size_t>(t) * dp, rc, rs, rope->half, rope->interleaved);
      }
      tile_dots(qs, M, nt, S);
    } else if (a.k_kind == kPagedKeyChannel) {
      // the group's metadata: 32 slots x kmb bytes = float16 [2, D] (scales, then minima)
      uint8_t* gm = reinterpret_cast<uint8_t*>(half);
      for (int i = 0; i < T; ++i) std::memcpy(gm + i * a.kmb, slot + i * W_ + a.kmo, a.kmb);
      for (int c = 0; c < D; ++c) {
        sK[c] = h2f(half[c]);
        mK[c] = h2f(half[D + c]);
      }
      decode_tile<kNoScale>(slot + a.ko, W_, nt, D, a.k_bits, a.klut, nullptr, 0, Kb, dp);
      for (int g = 0; g < M; ++g) {  // s_t = (q * s) . code_t + q . m
        const float* qrow = qs + static_cast<size_t>(g) * dp;
        float* trow = qt + static_cast<size_t>(g) * dp;
        vf bacc = vzero();
        for (int c = 0; c < dp; c += W) {
          const vf qv = vload(qrow + c);
          vstore(trow + c, vmul(qv, vload(sK + c)));
          bacc = vfma(qv, vload(mK + c), bacc);
        }
        bK[g] = vhsum(bacc);
      }
      tile_dots(qt, M, nt, S);
      for (int g = 0; g < M; ++g)
        for (int t = 0; t < nt; ++t) S[g * T + t] += bK[g];
    } else {  // per-token int8: s_t = scale_t * (q . (byte - 128))
      for (int t = 0; t < nt; ++t) f[t] = f16(slot + t * W_ + a.kmo);
      decode_tile<kTokenScale>(slot + a.ko, W_, nt, D, 8, a.klut, f, 1, Kb, dp);
      tile_dots(qs, M, nt, S);
    }
    // ---- online softmax: S becomes exp(s - m)
    for (int g = 0; g < M; ++g) {
      const float alpha = softmax_tile(S + g * T, nt, m[g], l[g]);
      if (alpha != 1.0f) scale_row(acc + static_cast<size_t>(g) * dp, dp, alpha);
    }
    // ---- values
    if (a.v_kind == kPagedValueLevels) {
      for (int t = 0; t < nt; ++t) f[t] = a.norm_table[slot[t * W_ + a.vmo]];
      decode_tile<kTokenScale>(slot + a.vo, W_, nt, D, a.v_bits, a.vlut, f, 1, Vb, dp);
    } else if (a.v_kind == kPagedValueInt8) {
      for (int t = 0; t < nt; ++t) f[t] = f16(slot + t * W_ + a.vmo);
      decode_tile<kTokenScale>(slot + a.vo, W_, nt, D, 8, a.vlut, f, 1, Vb, dp);
    } else {  // per token and 32-channel group: v = m_j + s_j * code
      decode_tile<kNoScale>(slot + a.vo, W_, nt, D, a.v_bits, a.vlut, nullptr, 0, Vb, dp);
      for (int t = 0; t < nt; ++t) {
        const uint8_t* meta = slot + t * W_ + a.vmo;
        float* row_v = Vb + static_cast<size_t>(t) * dp;
        for (int j = 0; j < J; ++j) {
          const vf sv = vset1(f16(meta + 2 * j)), mv = vset1(f16(meta + 2 * (J + j)));
          float* x = row_v + j * kPagedChannelGroup;
          for (int c = 0; c < kPagedChannelGroup; c += W) vstore(x + c, vfma(vload(x + c), sv, mv));
        }
      }
    }
    accum(S, T, M, Vb, dp, nt, dp, acc, dp);
  }
  for (int g = 0; g < M; ++g) {
    a.pm[sp.part + g] = m[g];
    a.pl[sp.part + g] = l[g];
    std::memcpy(a.pacc + (sp.part + g) * static_cast<int64_t>(dp), acc + static_cast<size_t>(g) * dp,
                sizeof(float) * dp);
  }
}

// One work item of attend_paged: tokens [ci * chunk, min(n_r, (ci + 1) * chunk)) of row (r, h)
// for all M queries of the row.
static void attend_paged_item(const PagedArgs& a, int64_t item, Scratch& s) {
  const int64_t row = item / a.chunks, ci = item % a.chunks;
  PagedSpan sp;
  sp.r = row / a.H;
  sp.h = row % a.H;
  sp.t_begin = ci * a.chunk;
  sp.t_end = std::min<int64_t>(a.len[sp.r], sp.t_begin + a.chunk);
  sp.M = a.M;
  sp.part = item * a.M;
  paged_span(a, sp, s);
}

// One span of attend_paged_batch (its items, listed by the host).
static void attend_paged_batch_item(const PagedArgs& a, int64_t item, Scratch& s) {
  paged_span(a, a.spans[item], s);
}

// Rows [g0, g1) of one (request, kv head) of attend_paged_batch: its spans' (max, sum, output)
// merged by log-sum-exp into out, the cached share rotated back (x @ vinv[h], one vectorized
// row-times-matrix product per query row) before the step's own share joins (math §28.5).
static void paged_merge_item(const PagedMerge& a, int64_t item, Scratch& s) {
  const int64_t rh = a.items[3 * item], g0 = a.items[3 * item + 1], g1 = a.items[3 * item + 2];
  const int64_t r = rh / a.H, h = rh % a.H;
  const int64_t b = a.first[rh], e = a.first[rh + 1];
  const int D = a.D, dp = pad_to(D), Q = a.spans[b].Q;
  if (s.f1.size() < 3 * static_cast<size_t>(dp)) s.f1.resize(3 * static_cast<size_t>(dp));
  float *share = s.f1.data(), *fresh = share + dp, *y = fresh + dp;
  const float* M = a.vinv ? a.vinv + h * static_cast<int64_t>(D) * D : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
    float* orow = a.out + ((a.qs[r] + g % Q) * a.Hq + h * a.G + g / Q) * D;
    float big = -std::numeric_limits<float>::infinity();
    for (int64_t i = b; i < e; ++i) big = std::max(big, a.pm[a.spans[i].part + g]);
    std::fill(share, share + 2 * static_cast<size_t>(dp), 0.0f);
    double sum = 0.0;
    for (int64_t i = b; i < e; ++i) {
      const int64_t p = a.spans[i].part + g;
      const float w = std::exp(a.pm[p] - big);
      sum += static_cast<double>(w) * a.pl[p];
      const float* pa = a.pacc + p * dp;
      float* dst = a.spans[i].fresh ? fresh : share;
      const vf wv = vset1(w);
      for (int c = 0; c < dp; c += W) vstore(dst + c, vfma(wv, vload(pa + c), vload(dst + c)));
    }
    const float* sh = share;
    if (M) {
      int c0 = 0;
      for (; c0 + 4 * W <= D; c0 += 4 * W) {  // four output vectors held in registers over j
        vf y0 = vzero(), y1 = vzero(), y2 = vzero(), y3 = vzero();
        for (int j = 0; j < D; ++j) {
          const vf xj = vset1(share[j]);
          const float* mr = M + static_cast<int64_t>(j) * D + c0;
          y0 = vfma(xj, vload(mr), y0);
          y1 = vfma(xj, vload(mr + W), y1);
          y2 = vfma(xj, vload(mr + 2 * W), y2);
          y3 = vfma(xj, vload(mr + 3 * W), y3);
        }
        vstore(y + c0, y0);
        vstore(y + c0 + W, y1);
        vstore(y + c0 + 2 * W, y2);
        vstore(y + c0 + 3 * W, y3);
      }
      for (; c0 < D; c0 += W) {
        vf y0 = vzero();
        for (int j = 0; j < D; ++j) y0 = vfma(vset1(share[j]), vload(M + static_cast<int64_t>(j) * D + c0), y0);
        vstore(y + c0, y0);
      }
      sh = y;
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int c = 0; c < D; ++c) orow[c] = (fresh[c] + sh[c]) * inv;
  }
}
