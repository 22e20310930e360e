// Encoding tokens into paged slots, in place (included by kv_kernels.cpp inside namespace kvk):
// the compiled form of kv_cache.integrations.vllm.codecs.write_slots, same arithmetic in the same
// order (float32, float16 rounded to nearest even, torch.round's half-to-even), one call per
// layer and step. Math: math_dictionary/kv-compression-math.md §28.2-§28.3, §28.5.
//
// cache uint8 [blocks, H, bs, sw]; key, value float32 [N, H, D] (values already rotated for the
// rotated codecs); slots int64 [N] (block * bs + offset, no padding). Keys: kPagedKeyChannel
// (every touched 32-slot group re-encoded from its stored tokens before the first new one, plus
// the new ones) or kPagedKeyInt8. Values: kPagedValueLevels (Lloyd-Max codes of x / norm, 8-bit
// log-coded RMS norm), kPagedValueInt8, kPagedValueChannelGroups (per token and 32 channels).

static inline float rne(float x) { return std::nearbyint(x); }  // default FE_TONEAREST: half to even
static inline float f16_round(float x) { return f16_to_f32(f32_to_f16(x)); }

// torch.round's half-to-even for |x| < 2**22 without a libm call: adding 1.5 * 2**23 leaves no
// fraction bits, so the float addition rounds to nearest even (the default rounding mode).
static inline float rne_small(float x) {
  const float big = 12582912.0f;
  return std::fabs(x) < 4194304.0f ? (x + big) - big : std::nearbyint(x);
}


// d codes (each < 2**bits) -> d * bits / 8 bytes (packing.py: LSB first, 3-bit in 24-bit words)
static inline void pack_codes(const uint8_t* q, int d, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, q, d);
    return;
  }
  if (bits == 3) {
    for (int c = 0; c < d; c += 8) {
      uint32_t w = 0;
      for (int j = 0; j < 8; ++j) w |= static_cast<uint32_t>(q[c + j]) << (3 * j);
      out[3 * (c / 8)] = static_cast<uint8_t>(w);
      out[3 * (c / 8) + 1] = static_cast<uint8_t>(w >> 8);
      out[3 * (c / 8) + 2] = static_cast<uint8_t>(w >> 16);
    }
    return;
  }
  const int per = 8 / bits;
  for (int c = 0; c < d; c += per) {
    uint8_t b = 0;
    for (int j = 0; j < per; ++j) b |= static_cast<uint8_t>(q[c + j] << (bits * j));
    out[c / per] = b;
  }
}

static inline void put_f16(uint8_t* p, float x) {
  const uint16_t h = f32_to_f16(x);
  std::memcpy(p, &h, 2);
}

static inline float get_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// symmetric int8 per token: codes round(x / s) + 128, then the float16 s
static void encode_int8(const float* x, int d, uint8_t* codes, uint8_t* meta) {
  float amax = 0.0f;
  for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(x[c]));
  const float s = f16_round(amax / 127.0f);
  for (int c = 0; c < d; ++c) {
    const float q = s > 0 ? rne_small(x[c] / s) : 0.0f;
    codes[c] = static_cast<uint8_t>(std::min(127.0f, std::max(-127.0f, q)) + 128.0f);
  }
  put_f16(meta, s);
}

struct WriteArgs : SlotFields {
  int D = 0;
  int64_t sw = 0;
  const float* mids = nullptr;  // Lloyd-Max midpoints, 2**v_bits - 1
  int nmids = 0;
  const float* norm_table = nullptr;  // [256]
  double lo = 0, hi = 0, min_exp = 0, step = 1;  // log-coded norms (§18.8)
  int isa = 0;                 // the per-ISA key-group loops (kv_paged_write_impl.h)
  const Lut* idl = nullptr;    // the identity table of k_bits (stored key codes as floats)
};

// one token's value (one kv head) into its slot
static void encode_value(const WriteArgs& a, const float* x, uint8_t* slot, uint8_t* q) {
  const int D = a.D;
  if (a.v_kind == kPagedValueInt8) {
    encode_int8(x, D, slot + a.vo, slot + a.vmo);
    return;
  }
  if (a.v_kind == kPagedValueLevels) {
    float ss = 0.0f;
    for (int c = 0; c < D; ++c) ss += x[c] * x[c];
    const double r = std::min(static_cast<double>(std::sqrt(ss / static_cast<float>(D))), a.hi);
    int code = 0;
    if (r > 0) {
      const double c = std::nearbyint((std::log2(std::max(r, a.lo)) - a.min_exp) / a.step) + 1.0;
      code = static_cast<int>(std::min(255.0, std::max(1.0, c)));
    }
    KVK_DISPATCH(a.isa, level_codes, x, a.norm_table[code], D, a.mids, a.nmids, q);
    pack_codes(q, D, a.v_bits, slot + a.vo);
    slot[a.vmo] = static_cast<uint8_t>(code);
    return;
  }
  // per token, 32-channel groups: s = fp16((max - min) / top), m = fp16(min)
  const int J = D / kPagedChannelGroup;
  const float top = static_cast<float>((1 << a.v_bits) - 1);
  for (int j = 0; j < J; ++j) {
    const float* g = x + j * kPagedChannelGroup;
    float mn = g[0], mx = g[0];
    for (int c = 1; c < kPagedChannelGroup; ++c) {
      mn = std::min(mn, g[c]);
      mx = std::max(mx, g[c]);
    }
    const float s = f16_round((mx - mn) / top), m = f16_round(mn);
    for (int c = 0; c < kPagedChannelGroup; ++c) {
      const float v = s > 0 ? rne_small((g[c] - m) / s) : 0.0f;
      q[j * kPagedChannelGroup + c] = static_cast<uint8_t>(std::min(top, std::max(0.0f, v)));
    }
    put_f16(slot + a.vmo + 2 * j, s);
    put_f16(slot + a.vmo + 2 * (J + j), m);
  }
  pack_codes(q, D, a.v_bits, slot + a.vo);
}

// Scratch of encode_key_group, one per thread (no allocation per group).
struct KeyGroupScratch {
  std::vector<float> vals, s0, m0, s, m;
  std::vector<uint8_t> valid, meta, q;
  void fit(int D, int T) {
    vals.resize(static_cast<size_t>(T) * D);
    for (auto* v : {&s0, &m0, &s, &m}) v->resize(D);
    valid.resize(T);
    meta.resize(4 * D);
    q.resize(D);
  }
};

// one key group (32 slots of one block and kv head): stored tokens [0, first) decoded, the new
// ones written at their offsets, the group re-encoded on the widened grid
static void encode_key_group(const WriteArgs& a, uint8_t* g0, const float* const* news, const int* within, int n_new,
                             KeyGroupScratch& w) {
  const int D = a.D, T = kPagedChannelGroup, bits = a.k_bits;
  const int kmb = 4 * D / T;
  w.fit(D, T);
  float* vals = w.vals.data();
  float *s0 = w.s0.data(), *m0 = w.m0.data(), *s = w.s.data(), *m = w.m.data();
  uint8_t *valid = w.valid.data(), *meta = w.meta.data(), *q = w.q.data();
  int first = T;
  for (int i = 0; i < n_new; ++i) first = std::min(first, within[i]);
  std::fill(valid, valid + T, 0);
  if (first > 0) {  // the group's metadata: float16 [2, D] over the 32 slots' kmb bytes
    for (int t = 0; t < T; ++t) std::memcpy(meta + t * kmb, g0 + t * a.sw + a.kmo, kmb);
    for (int c = 0; c < D; ++c) {
      s0[c] = get_f16(meta + 2 * c);
      m0[c] = get_f16(meta + 2 * (D + c));
    }
    KVK_DISPATCH(a.isa, key_group_decode, g0, a.sw, a.ko, first, D, bits, *a.idl, s0, m0, vals);
    std::fill(valid, valid + first, 1);
  }
  for (int i = 0; i < n_new; ++i) {
    std::memcpy(vals + within[i] * D, news[i], sizeof(float) * D);
    valid[within[i]] = 1;
  }
  for (int t = 0; t < T; ++t)  // rows of no token are encoded from zeros, as before
    if (!valid[t]) std::fill(vals + t * D, vals + (t + 1) * D, 0.0f);
  const float top = static_cast<float>((1 << bits) - 1);
  KVK_DISPATCH(a.isa, key_group_range, vals, valid, T, D, s, m);  // s: the minimum, m: the maximum
  for (int c = 0; c < D; ++c) {
    const float mn = s[c], mx = m[c];
    s[c] = f16_round((mx - mn) / top);
    m[c] = f16_round(mn);
    put_f16(meta + 2 * c, s[c]);
    put_f16(meta + 2 * (D + c), m[c]);
  }
  KVK_DISPATCH(a.isa, key_group_encode, vals, T, D, bits, s, m, g0, a.sw, a.ko, q);
  for (int t = 0; t < T; ++t) std::memcpy(g0 + t * a.sw + a.kmo, meta + t * kmb, kmb);
}

void write_paged(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
                 int64_t k_kind, int64_t k_bits, int64_t v_kind, int64_t v_bits, const std::vector<int64_t>& offsets,
                 const c10::optional<at::Tensor>& mids, const c10::optional<at::Tensor>& norm_table,
                 const std::vector<double>& log_norm, int64_t isa) {
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.is_contiguous(), "cache");
  TORCH_CHECK(key.scalar_type() == at::kFloat && key.is_contiguous() && key.dim() == 3 &&
                  value.scalar_type() == at::kFloat && value.is_contiguous() && value.sizes() == key.sizes(),
              "key / value: float32 [N, H, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == key.size(0), "slots");
  TORCH_CHECK(offsets.size() == 4 && log_norm.size() == 4, "offsets / log_norm");
  const int64_t N = key.size(0), H = cache.size(1), bs = cache.size(2), NB = cache.size(0);
  TORCH_CHECK(key.size(1) == H && bs % kPagedChannelGroup == 0, "heads / block size");
  WriteArgs a;
  a.D = static_cast<int>(key.size(2));
  a.set_slot(k_kind, k_bits, v_kind, v_bits, offsets);
  a.sw = cache.size(3);
  if (a.v_kind == kPagedValueLevels) {
    TORCH_CHECK(mids.has_value() && mids->scalar_type() == at::kFloat && mids->is_contiguous() &&
                    mids->numel() == (1 << v_bits) - 1 && norm_table.has_value() &&
                    norm_table->scalar_type() == at::kFloat && norm_table->numel() == 256, "mids / norm_table");
    a.mids = mids->data_ptr<float>();
    a.nmids = static_cast<int>(mids->numel());
    a.norm_table = norm_table->data_ptr<float>();
    a.lo = log_norm[0];
    a.hi = log_norm[1];
    a.min_exp = log_norm[2];
    a.step = log_norm[3];
  }
  a.isa = pick_isa(isa);
  Lut idl;
  if (a.k_kind == kPagedKeyChannel) {
    TORCH_CHECK(a.k_bits == 2 || a.k_bits == 3 || a.k_bits == 4, "key bits of a channel-grouped key: 2, 3 or 4");
    fill_lut(idl, at::arange(1 << a.k_bits, at::kFloat), a.k_bits);
  }
  a.idl = &idl;
  uint8_t* base = cache.data_ptr<uint8_t>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    if (sp[i] < 0 || sp[i] >= NB * bs)
      throw pybind11::value_error("slot_mapping: slot " + std::to_string(sp[i]) + " is outside the cache's " +
                                  std::to_string(NB * bs) + " slots");
  const int D = a.D;
  auto slot_of = [&](int64_t s, int64_t h) { return base + (((s / bs) * H + h) * bs + s % bs) * a.sw; };
  // values and int8 keys: per token and head
#pragma omp parallel if (N * H > 64)
  {
    std::vector<uint8_t> q(D);
#pragma omp for
    for (int64_t i = 0; i < N * H; ++i) {
      const int64_t n = i / H, h = i % H;
      uint8_t* slot = slot_of(sp[n], h);
      encode_value(a, vp + i * D, slot, q.data());
      if (a.k_kind == kPagedKeyInt8) encode_int8(kp + i * D, D, slot + a.ko, slot + a.kmo);
    }
  }
  if (a.k_kind != kPagedKeyChannel) return;
  // keys: the touched groups, each with its new tokens (in order)
  std::vector<std::pair<int64_t, int64_t>> order(N);  // (group id, token)
  for (int64_t i = 0; i < N; ++i) order[i] = {sp[i] / kPagedChannelGroup, i};
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < N; ++i)
    if (i == 0 || order[i].first != order[i - 1].first) starts.push_back(i);
  starts.push_back(N);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
#pragma omp parallel if (groups * H > 4)
  {
    KeyGroupScratch w;
    std::vector<const float*> news;
    std::vector<int> within;
#pragma omp for
    for (int64_t gi = 0; gi < groups * H; ++gi) {
      const int64_t u = gi / H, h = gi % H;
      const int64_t b0 = starts[u], b1 = starts[u + 1];
      const int64_t gid = order[b0].first;
      const int64_t first_slot = gid * kPagedChannelGroup;
      news.resize(b1 - b0);
      within.resize(b1 - b0);
      for (int64_t j = b0; j < b1; ++j) {
        const int64_t n = order[j].second;
        news[j - b0] = kp + (n * H + h) * D;
        within[j - b0] = static_cast<int>(sp[n] - first_slot);
      }
      encode_key_group(a, slot_of(first_slot, h), news.data(), within.data(), static_cast<int>(b1 - b0), w);
    }
  }
}
