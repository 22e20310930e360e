// Host side of the paged attention kernel (included by kv_kernels.cpp inside namespace kvk,
// after the dispatch helpers): work items, the per-ISA item (kv_paged_impl.h), the log-sum-exp
// merge. Python side: src/kv_cache/kernels/paged.py (validation, layouts). Math §28.5.

// q [R * H, M, D] float32; cache uint8 [blocks, H, bs, sw] (contiguous); table int32 [R, nb];
// lengths int64 [R]; offsets (ko, kmo, vo, vmo); out [R * H, M, D], lse [R * H, M] float32;
// rope_inv_freq float32 [half] or None: keys stored before RoPE, token t turned to position t.
// Block ids a request needs are checked against the cache (ValueError).
void attend_paged(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table, const at::Tensor& lengths,
                  int64_t k_kind, int64_t k_bits, const at::Tensor& k_lut, int64_t v_kind, int64_t v_bits,
                  const at::Tensor& v_lut, const c10::optional<at::Tensor>& norm_table,
                  const std::vector<int64_t>& offsets, double scaling, at::Tensor& out, at::Tensor& lse, int64_t isa,
                  const c10::optional<at::Tensor>& rope_inv_freq, int64_t rope_interleaved, double rope_factor) {
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.is_contiguous(), "cache");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.stride(1) == 1, "table");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == table.size(0),
              "lengths");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q");
  TORCH_CHECK(offsets.size() == 4, "offsets");
  PagedArgs a;
  const int64_t R = table.size(0), NB = cache.size(0);
  a.H = cache.size(1);
  a.bs = cache.size(2);
  a.sw = cache.size(3);
  TORCH_CHECK(a.bs % kTile == 0, "block size must be a multiple of ", kTile);
  TORCH_CHECK(q.size(0) == R * a.H, "q rows");
  a.M = static_cast<int>(q.size(1));
  a.D = static_cast<int>(q.size(2));
  TORCH_CHECK(a.D <= 1024 && a.D % kPagedChannelGroup == 0, "head_dim");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && lse.is_contiguous() && lse.numel() == R * a.H * a.M,
              "out / lse");
  a.q = q.data_ptr<float>();
  a.cache = cache.data_ptr<uint8_t>();
  a.table = table.data_ptr<int32_t>();
  a.tpitch = R > 1 ? table.stride(0) : table.size(1);
  a.k_kind = static_cast<int>(k_kind);
  a.k_bits = static_cast<int>(k_bits);
  a.v_kind = static_cast<int>(v_kind);
  a.v_bits = static_cast<int>(v_bits);
  a.ko = offsets[0];
  a.kmo = offsets[1];
  a.vo = offsets[2];
  a.vmo = offsets[3];
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
  KeyRope rope;
  std::vector<float> rope_tab;
  if (rope_inv_freq.has_value()) {
    const at::Tensor& w = *rope_inv_freq;
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.numel() >= 1 &&
                    2 * w.numel() <= a.D, "rope inv_freq: float32 [half], 2 * half <= head_dim");
    rope_doubling_table(w, rope, rope_tab);
    rope.interleaved = rope_interleaved != 0;
    rope.factor = static_cast<float>(rope_factor);
    a.rope = &rope;
  }
  // lengths clipped to the table; the block ids they need are checked
  std::vector<int64_t> len(R);
  int64_t total = 0, longest = 0;
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    len[r] = std::min<int64_t>(std::max<int64_t>(lp[r], 0), table.size(1) * a.bs);
    for (int64_t j = 0; j * a.bs < len[r]; ++j) {
      const int32_t b = a.table[r * a.tpitch + j];
      if (b < 0 || b >= NB)
        throw pybind11::value_error("block_table: request " + std::to_string(r) + " names block " +
                                    std::to_string(b) + " outside the cache's " + std::to_string(NB) + " blocks");
    }
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
