// Host side of the paged attention kernel (included by kv_kernels.cpp inside namespace kvk,
// after the dispatch helpers): work items, the per-ISA item (kv_paged_impl.h), the log-sum-exp
// merge. Python side: src/kv_cache/kernels/paged.py (validation, layouts). Math §28.5.

// The slot layout, lookup tables and rotary frame of a paged read, shared by attend_paged and
// attend_paged_batch (q, out and the work items are each caller's). `rope` and `rope_tab` hold
// the frame's storage for the caller's lifetime.
static void paged_setup(PagedArgs& a, const at::Tensor& cache, const at::Tensor& table, int64_t D, int64_t k_kind,
                        int64_t k_bits, const at::Tensor& k_lut, int64_t v_kind, int64_t v_bits,
                        const at::Tensor& v_lut, const c10::optional<at::Tensor>& norm_table,
                        const std::vector<int64_t>& offsets, double scaling,
                        const c10::optional<at::Tensor>& rope_inv_freq, int64_t rope_interleaved, double rope_factor,
                        KeyRope& rope, std::vector<float>& rope_tab) {
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.is_contiguous(), "cache");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.stride(1) == 1, "table");
  TORCH_CHECK(offsets.size() == 4, "offsets");
  const int64_t R = table.size(0);
  a.H = cache.size(1);
  a.bs = cache.size(2);
  a.sw = cache.size(3);
  TORCH_CHECK(a.bs % kTile == 0, "block size must be a multiple of ", kTile);
  a.D = static_cast<int>(D);
  TORCH_CHECK(a.D <= 1024 && a.D % kPagedChannelGroup == 0, "head_dim");
  a.cache = cache.data_ptr<uint8_t>();
  a.table = table.data_ptr<int32_t>();
  a.tpitch = R > 1 ? table.stride(0) : table.size(1);
  a.set_slot(k_kind, k_bits, v_kind, v_bits, offsets);
  a.kmb = static_cast<int>(a.vo - a.kmo);
  TORCH_CHECK(a.k_kind != kPagedKeyChannel || a.kmb * kTile == 4 * a.D, "key meta bytes");
  fill_lut(a.klut, k_lut, a.k_kind == kPagedKeyInt8 ? 8 : a.k_bits);
  fill_lut(a.vlut, v_lut, a.v_kind == kPagedValueInt8 ? 8 : a.v_bits);
  if (a.v_kind == kPagedValueLevels) {
    TORCH_CHECK(norm_table.has_value() && norm_table->scalar_type() == at::kFloat && norm_table->is_contiguous() &&
                    norm_table->numel() == 256, "norm_table");
    a.norm_table = norm_table->data_ptr<float>();
  }
  a.scaling = static_cast<float>(scaling);
  // keys before RoPE: token t of a request turned to position t (math §29.9)
  if (rope_inv_freq.has_value()) {
    const at::Tensor& w = *rope_inv_freq;
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.numel() >= 1 &&
                    2 * w.numel() <= a.D, "rope inv_freq: float32 [half], 2 * half <= head_dim");
    rope_doubling_table(w, rope, rope_tab);
    rope.interleaved = rope_interleaved != 0;
    rope.factor = static_cast<float>(rope_factor);
    a.rope = &rope;
  }
}

// The block ids request r's first n tokens need, checked against the cache's NB blocks.
static void check_blocks(const PagedArgs& a, int64_t r, int64_t n, int64_t NB) {
  for (int64_t j = 0; j * a.bs < n; ++j) {
    const int32_t b = a.table[r * a.tpitch + j];
    if (b < 0 || b >= NB)
      throw pybind11::value_error("block_table: request " + std::to_string(r) + " names block " +
                                  std::to_string(b) + " outside the cache's " + std::to_string(NB) + " blocks");
  }
}

// q [R * H, M, D] float32; cache uint8 [blocks, H, bs, sw] (contiguous); table int32 [R, nb];
// lengths int64 [R]; offsets (ko, kmo, vo, vmo); out [R * H, M, D], lse [R * H, M] float32;
// rope_inv_freq float32 [half] or None: keys stored before RoPE, token t turned to position t.
// Block ids a request needs are checked against the cache (ValueError).
void attend_paged(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table, const at::Tensor& lengths,
                  int64_t k_kind, int64_t k_bits, const at::Tensor& k_lut, int64_t v_kind, int64_t v_bits,
                  const at::Tensor& v_lut, const c10::optional<at::Tensor>& norm_table,
                  const std::vector<int64_t>& offsets, double scaling, at::Tensor& out, at::Tensor& lse, int64_t isa,
                  const c10::optional<at::Tensor>& rope_inv_freq, int64_t rope_interleaved, double rope_factor) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == table.size(0),
              "lengths");
  PagedArgs a;
  KeyRope rope;
  std::vector<float> rope_tab;
  paged_setup(a, cache, table, q.size(2), k_kind, k_bits, k_lut, v_kind, v_bits, v_lut, norm_table, offsets, scaling,
              rope_inv_freq, rope_interleaved, rope_factor, rope, rope_tab);
  const int64_t R = table.size(0), NB = cache.size(0);
  TORCH_CHECK(q.size(0) == R * a.H, "q rows");
  a.M = static_cast<int>(q.size(1));
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && lse.is_contiguous() && lse.numel() == R * a.H * a.M,
              "out / lse");
  a.q = q.data_ptr<float>();
  // lengths clipped to the table; the block ids they need are checked
  std::vector<int64_t> len(R);
  int64_t total = 0, longest = 0;
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    len[r] = std::min<int64_t>(std::max<int64_t>(lp[r], 0), table.size(1) * a.bs);
    check_blocks(a, r, len[r], NB);
    total += len[r];
    longest = std::max(longest, len[r]);
  }
  a.len = len.data();
  const int64_t rows = R * a.H;
  const int nt = std::max(1, at::get_num_threads());
  // split-K: about 8 items per thread in all, at least 256 tokens each
  int64_t chunk = std::max<int64_t>(256, (rows * longest + 8 * nt - 1) / (8 * nt));
  chunk = (chunk + kTile - 1) / kTile * kTile;
  a.chunk = chunk;
  a.chunks = std::max<int64_t>(1, (longest + chunk - 1) / chunk);
  const int64_t n_items = rows * a.chunks;
  const int dp = pad_to(a.D);
  std::vector<float> pm(n_items * a.M), pl(n_items * a.M), pacc(n_items * a.M * dp);
  a.pm = pm.data();
  a.pl = pl.data();
  a.pacc = pacc.data();
  const int isa_level = pick_isa(isa);
  run_items(n_items, total * a.H * a.M * a.D / 4,
            [&](int64_t i, Scratch& s) { KVK_DISPATCH(isa_level, attend_paged_item, a, i, s); });
  // merge the chunks of each row by log-sum-exp
  float* o = out.data_ptr<float>();
  float* L = lse.data_ptr<float>();
  const int M = a.M, D = a.D;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t row = 0; row < rows; ++row)
    for (int g = 0; g < M; ++g) {
      float* orow = o + (row * M + g) * D;
      std::fill(orow, orow + D, 0.0f);
      float big = ninf;
      for (int64_t c = 0; c < a.chunks; ++c) big = std::max(big, pm[(row * a.chunks + c) * M + g]);
      if (!(big > ninf)) {
        L[row * M + g] = ninf;
        continue;
      }
      double sum = 0.0;
      for (int64_t c = 0; c < a.chunks; ++c) {
        const int64_t i = row * a.chunks + c;
        const float w = std::exp(pm[i * M + g] - big);
        sum += static_cast<double>(w) * pl[i * M + g];
        const float* pa = pacc.data() + (i * M + g) * dp;
        for (int d = 0; d < D; ++d) orow[d] += w * pa[d];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int d = 0; d < D; ++d) orow[d] *= inv;
      L[row * M + g] = big + static_cast<float>(std::log(sum));
    }
}


// A step's attention for every request of a batch in one call (math §28.6): request r's Q_r
// tokens (rows qstart[r] .. qstart[r + 1] of q [N, Hq, D], k_new and v_new [N, H, D], float32)
// attend its first n_r = seqlens[r] - Q_r tokens read from the paged codes, and the step's own
// tokens causally in full precision; the parts merge by log-sum-exp, the cached share rotated
// back by vinv[h] ([H, D, D], x @ vinv[h]) when the cache holds rotated values. out [N, Hq, D]
// float32. Work items: chunks of each (request, kv head)'s cached tokens, one item for its fresh
// tokens; all G Q_r query rows of a (request, kv head) ride in each of its items.
void attend_paged_batch(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table,
                        const at::Tensor& qstart, const at::Tensor& seqlens, const at::Tensor& knew,
                        const at::Tensor& vnew, int64_t k_kind, int64_t k_bits, const at::Tensor& k_lut,
                        int64_t v_kind, int64_t v_bits, const at::Tensor& v_lut,
                        const c10::optional<at::Tensor>& norm_table, const std::vector<int64_t>& offsets,
                        double scaling, at::Tensor& out, int64_t isa, const c10::optional<at::Tensor>& rope_inv_freq,
                        int64_t rope_interleaved, double rope_factor, const c10::optional<at::Tensor>& vinv) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q");
  PagedArgs a;
  KeyRope rope;
  std::vector<float> rope_tab;
  paged_setup(a, cache, table, q.size(2), k_kind, k_bits, k_lut, v_kind, v_bits, v_lut, norm_table, offsets, scaling,
              rope_inv_freq, rope_interleaved, rope_factor, rope, rope_tab);
  const int64_t R = table.size(0), NB = cache.size(0), N = q.size(0), H = a.H, D = a.D;
  TORCH_CHECK(q.size(1) % H == 0, "q heads must be a multiple of the cache's kv heads");
  a.Hq = q.size(1);
  a.G = static_cast<int>(a.Hq / H);
  TORCH_CHECK(qstart.scalar_type() == at::kLong && qstart.is_contiguous() && qstart.numel() == R + 1, "qstart");
  TORCH_CHECK(seqlens.scalar_type() == at::kLong && seqlens.is_contiguous() && seqlens.numel() == R, "seqlens");
  for (const at::Tensor* t : {&knew, &vnew})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == N &&
                    t->size(1) == H && t->size(2) == D, "k_new / v_new: float32 [N, H, D]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(), "out");
  const float* vi = nullptr;
  if (vinv.has_value()) {
    TORCH_CHECK(vinv->scalar_type() == at::kFloat && vinv->is_contiguous() && vinv->dim() == 3 &&
                    vinv->size(0) == H && vinv->size(1) == D && vinv->size(2) == D, "vinv: float32 [H, D, D]");
    vi = vinv->data_ptr<float>();
  }
  a.q = q.data_ptr<float>();
  a.knew = knew.data_ptr<float>();
  a.vnew = vnew.data_ptr<float>();
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t* sl = seqlens.data_ptr<int64_t>();
  std::vector<int64_t> len(R), nq(R);
  int64_t cached_total = 0;
  for (int64_t r = 0; r < R; ++r) {
    nq[r] = qs[r + 1] - qs[r];
    if (nq[r] < 0 || qs[r] < 0 || qs[r + 1] > N)
      throw pybind11::value_error("query_start_loc must rise from 0 to at most N = " + std::to_string(N) +
                                  "; request " + std::to_string(r) + " has [" + std::to_string(qs[r]) + ", " +
                                  std::to_string(qs[r + 1]) + ")");
    if (sl[r] < nq[r])
      throw pybind11::value_error("seq_lens[" + std::to_string(r) + "] = " + std::to_string(sl[r]) +
                                  " is below the request's " + std::to_string(nq[r]) + " scheduled tokens");
    len[r] = sl[r] - nq[r];
    if (len[r] > table.size(1) * a.bs)
      throw pybind11::value_error("request " + std::to_string(r) + " has " + std::to_string(len[r]) +
                                  " cached tokens but its block table holds " + std::to_string(table.size(1) * a.bs));
    check_blocks(a, r, len[r], NB);
    cached_total += len[r] * nq[r];
  }
  a.len = len.data();
  // split-K over each (request, kv head)'s cached tokens: about 8 items per thread, each of
  // about the same work (query rows x tokens), so a prefill chunk's many rows spread over the
  // threads too; at least 256 tokens an item (each item adds a partial result to merge and
  // scales its queries again; 64-token items measured no faster)
  const int nt = std::max(1, at::get_num_threads());
  const int64_t target = (static_cast<int64_t>(a.G) * H * cached_total + 8 * nt - 1) / (8 * nt);
  auto chunk_of = [&](int64_t r) {
    const int64_t M = a.G * nq[r];
    int64_t c = std::max<int64_t>(256, (target + M - 1) / std::max<int64_t>(M, 1));
    c = std::min<int64_t>(c, std::max<int64_t>(len[r], 1));
    return (c + kTile - 1) / kTile * kTile;
  };
  std::vector<PagedSpan> spans;
  std::vector<int64_t> first(R * H + 1);
  int64_t part = 0, work = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      first[r * H + h] = static_cast<int64_t>(spans.size());
      const int M = static_cast<int>(a.G * nq[r]);
      if (M == 0) continue;
      PagedSpan sp;
      sp.r = r;
      sp.h = h;
      sp.M = M;
      sp.Q = static_cast<int>(nq[r]);
      sp.q0 = qs[r];
      const int64_t chunk = chunk_of(r);
      for (int64_t t = 0; t < len[r]; t += chunk) {
        sp.t_begin = t;
        sp.t_end = std::min(len[r], t + chunk);
        sp.part = part;
        part += M;
        spans.push_back(sp);
      }
      sp.fresh = true;
      sp.t_begin = 0;
      sp.t_end = nq[r];
      sp.part = part;
      part += M;
      spans.push_back(sp);
      work += M * (len[r] + nq[r]) * D;
    }
  first[R * H] = static_cast<int64_t>(spans.size());
  const int dp = pad_to(a.D);
  std::vector<float> pm(part), pl(part), pacc(part * dp);
  a.pm = pm.data();
  a.pl = pl.data();
  a.pacc = pacc.data();
  a.spans = spans.data();
  const int isa_level = pick_isa(isa);
  const int64_t n_items = static_cast<int64_t>(spans.size());
  if (n_items > 0)
    run_items(n_items, work / 4,
              [&](int64_t i, Scratch& s) { KVK_DISPATCH(isa_level, attend_paged_batch_item, a, i, s); });
  // merge each row's spans by log-sum-exp, the cached share rotated back before the fresh one
  // joins: items of up to kMergeRows query rows of one (request, kv head), over the threads
  std::vector<int64_t> mitems;
  int64_t mwork = 0;
  for (int64_t rh = 0; rh < R * H; ++rh) {
    const int64_t b = first[rh], e = first[rh + 1];
    if (b == e) continue;
    const int M = spans[b].M;
    for (int64_t g = 0; g < M; g += kMergeRows) {
      mitems.insert(mitems.end(), {rh, g, std::min<int64_t>(M, g + kMergeRows)});
    }
    mwork += M * (e - b + (vi ? D : 0)) * D;
  }
  PagedMerge mg;
  mg.pm = pm.data();
  mg.pl = pl.data();
  mg.pacc = pacc.data();
  mg.spans = spans.data();
  mg.first = first.data();
  mg.qs = qs;
  mg.items = mitems.data();
  mg.vinv = vi;
  mg.out = out.data_ptr<float>();
  mg.H = H;
  mg.Hq = a.Hq;
  mg.G = a.G;
  mg.D = a.D;
  const int64_t n_merge = static_cast<int64_t>(mitems.size() / 3);
  if (n_merge > 0)
    run_items(n_merge, mwork / 4, [&](int64_t i, Scratch& s) { KVK_DISPATCH(isa_level, paged_merge_item, mg, i, s); });
}
