// Compiled CPU kernels of kv_cache.kernels: fused quantize+pack, unpack+dequantize, and
// attention computed from packed codes (split-K online softmax). Python side:
// src/kv_cache/kernels/ops.py (dispatch, validation) and reference.py (the torch oracle).
//
// Layout of a quantized block (rows r = batch * kv_heads):
//   codes uint8 [R, N, P], P = d * bits / 8 bytes per token, packed as
//   kv_cache.compression.packing.pack_bits packs a C-order [R, N, d] code tensor;
//   x_hat[r, t, c] = scale * (lut[code] - zero), scale/zero per "channel" group
//   ([R, NG, d], token t uses group gid[r, t] or t / gs) or per "token" group
//   ([R, N, d / gs]). Math: math_dictionary/kv-compression-math.md section 15.
//
// Portability: the file is compiled with plain -O3 (any x86_64). The AVX2 (+FMA, F16C) and
// AVX-512 (F, BW, DQ, VL) bodies are compiled under function-level target pragmas and only
// called when the CPU reports those features (__builtin_cpu_supports), so the extension loads
// and runs everywhere; the portable body is the fallback.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvk {

enum DT : int { DT_F32 = 0, DT_F16, DT_BF16, DT_I16, DT_I8, DT_U8, DT_NONE };
enum Grouping : int { kChannel = 0, kToken = 1 };
enum Status : int { kOk = 0, kNonFinite = 1, kScaleUnrepresentable = 2, kBadGroup = 3, kNormTooLarge = 4 };

constexpr int kPad = 16;        // decoded rows are padded to a multiple of this many floats
constexpr int kTile = 32;       // attention: tokens decoded per tile (L1-resident)
constexpr int kTokChunk = 64;   // (de)quantize: tokens per work item
constexpr int kPrefetchTiles = 1;  // attention: tiles requested ahead of the one being decoded
constexpr int kWideRows = 16;  // query rows from which a key tile is transposed for the dots (dots_wide)

static inline int pad_to(int n) { return (n + kPad - 1) / kPad * kPad; }

static inline size_t dt_size(DT dt) {
  switch (dt) {
    case DT_F32: return 4;
    case DT_F16: case DT_BF16: case DT_I16: return 2;
    default: return 1;
  }
}

static DT dt_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DT_F32;
    case at::kHalf: return DT_F16;
    case at::kBFloat16: return DT_BF16;
    case at::kShort: return DT_I16;
    case at::kChar: return DT_I8;
    case at::kByte: return DT_U8;
    default: TORCH_CHECK(false, "kv_kernels: unsupported dtype ", t.scalar_type());
  }
}

static inline float f16_to_f32(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
static inline uint16_t f32_to_f16(float f) { return c10::detail::fp16_ieee_from_fp32_value(f); }
static inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// A metadata array (scale or zero point) of any supported dtype; DT_NONE reads as zeros.
struct Meta {
  const void* p = nullptr;
  DT dt = DT_NONE;
  const float* table = nullptr;  // uint8 codes: the value is table[code] (e.g. log-coded scales)
  int64_t pitch = 0;             // entries (tokens or groups) from one row to the next
  const int64_t* off = nullptr;  // per-token entries of a flat ragged block: row r starts at entry off[r]
};

// A code -> level table: 2**bits entries, zero padded to 256. `offset`: lut[i] == i + beta
// exactly in float32 (every uniform table), decoded by integer conversion instead of lookup.
struct Lut {
  alignas(64) float v[256];
  bool offset = false;
  float beta = 0.0f;
  // 2- and 4-bit tables as 4 byte planes (plane j: byte j of each entry, as a 16-entry byte
  // shuffle table), indexed as decode_row_t's AVX2 path builds its indices: entry i for 4 bits;
  // for 2 bits entries i and 4i both hold level i (code i sits at bits 0-1 or 2-3 of the index).
  alignas(16) uint8_t planes[4][16];
};

// Code c of one token's packed bytes p (little-endian words of lcm(8, bits) bits).
static inline int code_at(const uint8_t* p, int c, int bits) {
  switch (bits) {
    case 2: return (p[c >> 2] >> ((c & 3) * 2)) & 3;
    case 4: return (p[c >> 1] >> ((c & 1) * 4)) & 15;
    case 8: return p[c];
    default: {  // 3: 8 codes per 3 bytes, code j at bits 3j..3j+2 of the 24-bit word
      const uint8_t* w = p + 3 * (c >> 3);
      const uint32_t v = w[0] | (w[1] << 8) | (w[2] << 16);
      return (v >> (3 * (c & 7))) & 7;
    }
  }
}

// Pack code bytes q[c..d) (values < 2**bits) into the token's bytes, from code c (a multiple
// of 8): the shift-and-mask folds of packing.py, eight codes (one 64-bit word) at a time.
static inline void pack_tail(const uint8_t* q, int c, int d, int bits, uint8_t* out) {
  for (; c + 8 <= d; c += 8) {
    uint64_t x;
    std::memcpy(&x, q + c, 8);
    if (bits == 4) {
      x = (x | (x >> 4)) & 0x00FF00FF00FF00FFull;
      x = (x | (x >> 8)) & 0x0000FFFF0000FFFFull;
      x = (x | (x >> 16)) & 0xFFFFFFFFull;
      const uint32_t w = static_cast<uint32_t>(x);
      std::memcpy(out + c / 2, &w, 4);
    } else if (bits == 2) {
      x = (x | (x >> 6)) & 0x000F000F000F000Full;
      x = (x | (x >> 12)) & 0x000000FF000000FFull;
      x = (x | (x >> 24)) & 0xFFFFull;
      const uint16_t w = static_cast<uint16_t>(x);
      std::memcpy(out + c / 4, &w, 2);
    } else {  // 3
      x = (x | (x >> 5)) & 0x003F003F003F003Full;
      x = (x | (x >> 10)) & 0x00000FFF00000FFFull;
      x = (x | (x >> 20)) & 0xFFFFFFull;
      uint8_t* o = out + 3 * (c / 8);
      o[0] = static_cast<uint8_t>(x);
      o[1] = static_cast<uint8_t>(x >> 8);
      o[2] = static_cast<uint8_t>(x >> 16);
    }
  }
  // tails: 4-bit d is even, 2-bit d is a multiple of 4, 3-bit d a multiple of 8
  if (bits == 4) {
    for (; c < d; c += 2) out[c / 2] = static_cast<uint8_t>(q[c] | (q[c + 1] << 4));
  } else if (bits == 2) {
    for (; c < d; c += 4)
      out[c / 4] = static_cast<uint8_t>(q[c] | (q[c + 1] << 2) | (q[c + 2] << 4) | (q[c + 3] << 6));
  }
}

// Per-thread scratch buffers, reused across the items a thread processes.
struct Scratch {
  std::vector<float> f0, f1, f2, f3;
  std::vector<double> d0;
  std::vector<uint8_t> u8;
};

struct BlockView {
  const uint8_t* codes = nullptr;
  int64_t R = 0, N = 0;
  int d = 0, P = 0, bits = 0;
  Lut lut;
  int grouping = kChannel;
  Meta scale, zero;
  const int32_t* gid = nullptr;
  int64_t NG = 0;  // channel: groups in the scale table
  int gs = 1;      // channel: tokens per group (gid is None); token: channels per group
  // Row pitches (tokens from row r to row r + 1): N for contiguous tensors, more for the
  // leading part of a buffer with room (attention reads such views in place).
  int64_t cpitch = 0, gpitch = 0;
  // A flat ragged block (one buffer per layer, rows of different lengths): row r's tokens are
  // tokens off[r] .. off[r] + length[r] of the buffer (codes, gid and token-grouped metadata);
  // a channel-grouped scale table is then shared by every row (pitch 0, gid global).
  const int64_t* off = nullptr;
};

// First entry of row r: a flat ragged block's offset, else r rows of `pitch`.
static inline int64_t mrow(const Meta& m, int64_t r) { return m.off ? m.off[r] : r * m.pitch; }
static inline int64_t crow(const BlockView& b, int64_t r) { return b.off ? b.off[r] : r * b.cpitch; }
static inline int64_t gidrow(const BlockView& b, int64_t r) { return b.off ? b.off[r] : r * b.gpitch; }

// Row pitch of a [R, n, w] tensor whose rows hold n entries of w contiguous elements each,
// possibly the leading part of rows of a longer buffer; -1 if the layout is not that.
static int64_t row_pitch(const at::Tensor& t) {
  const int64_t R = t.size(0), n = t.size(1), w = t.size(2);
  if (w > 1 && t.stride(2) != 1) return -1;
  if (n > 1 && t.stride(1) != w) return -1;
  if (R <= 1) return n;
  if (t.stride(0) == 0) return 0;  // one buffer shared by every row (flat ragged, or a shared table)
  if (w == 0 || t.stride(0) % w || t.stride(0) / w < n) return -1;
  return t.stride(0) / w;
}

struct QuantArgs {
  const void* x;
  DT xdt;
  int64_t R, N;
  int d, P, bits, grouping, gs;
  bool symmetric, codebook;
  float qlo, qhi;         // uniform: codes are clamp(round(x / s) + zp, qlo, qhi)
  float qmax;             // the scale's divisor: 2**(b-1) - 1 (symmetric) or 2**b - 1
  float sym_offset;       // symmetric: the implicit code offset 2**(b-1)
  const float* mids;      // codebook: sorted midpoints between levels
  int nmids;
  uint8_t* codes;
  void* scale;
  DT sdt;
  int16_t* zero;          // asymmetric uniform only
  std::atomic<int>* status;
  // codebook only: tokens rotated first, x R = (x * signs[r % signs_heads]) H / sqrt(d) (a power-of-two d)
  const int8_t* signs = nullptr;
  int64_t signs_heads = 1;
  // codebook only: norms stored as 8-bit log codes (uint8 scale, math dictionary §18.8)
  bool log_norm = false;
  double log_lo = 0.0, log_min_exp = 0.0, log_step = 1.0;
  float log_top = 0.0f;   // the largest norm a code holds (above: kNormTooLarge)
};

struct DequantArgs {
  BlockView blk;
  void* out;
  DT odt;
  std::atomic<int>* status;
};

struct AttendItem {
  int64_t r, t0, t1;
  int dense = -1;  // -1: tokens of a packed block; i >= 0: of full-precision block i
  int packed = 0;  // packed items: 0 = the call's block, i >= 1 = extra packed block i - 1
};

// A full-precision block of [B, H, n, d] keys and values (float32/16, bfloat16), element
// strides per batch (kb, vb) and per head (kh, vh); tokens are d elements apart.
struct DenseView {
  const void* k = nullptr;
  const void* v = nullptr;
  DT dt = DT_F32;
  int64_t n = 0, kb = 0, kh = 0, vb = 0, vh = 0;
  int dk = 0, dv = 0;
  const int32_t* start = nullptr;  // [R] first valid token per row, or null (0)
  const int64_t* off = nullptr;    // flat ragged block: row r's tokens start at token off[r] of the buffer
  const int32_t* len = nullptr;    // flat ragged block: row r holds len[r] tokens (else n)
};

// Keys stored before RoPE (math dictionary §29.8): the call's packed keys are read as
//   k_t = f * R(pos[t]) (sigma * k_hat_t + mu)
// with R(p) turning channel pair i by the angle p * w_i ("half": channels i and i + half,
// "interleaved": 2i and 2i + 1; channels past 2 * half pass through). cos/sin of p * w_i come
// from products of the doubling table cs[j] = (cos, sin)(2^j w_i) over the set bits of p (and
// of the step p - p_prev inside a tile): no sincos per element, angles exact up to float32
// rounding of the products. Per-token keys stored in a randomized Hadamard space (signs) are
// first mapped back, y R^T = (y H) * s, by a fast Walsh-Hadamard transform of each row.
struct KeyRope {
  const int32_t* pos = nullptr;  // [R, N] arrival index of every slot
  int64_t pitch = 0;             // row r's positions start at r * pitch (0: a flat ragged block's offset)
  const float* tab = nullptr;    // [kRopeBits, 2, half]: cos, sin of 2^j * w_i
  const float* mean = nullptr;   // [R, d] or null (row r at r * mean_pitch)
  const float* scale = nullptr;  // [R, d] or null (row r at r * scale_pitch)
  int64_t mean_pitch = 0, scale_pitch = 0;
  const float* signs = nullptr;  // [Hs, d] or null: keys stored as x R, R = diag(s) H / sqrt(d)
  int64_t signs_heads = 1;       // row r uses signs[r % Hs]
  int half = 0;
  bool interleaved = false;
  float factor = 1.0f;
};
constexpr int kRopeBits = 31;  // positions below 2**31

struct AttendArgs {
  const float* q;  // [R, G, dk]
  int G;
  BlockView k, v;
  float scaling;
  const AttendItem* items;
  float* logits;   // [R, G, N] or null
  float* pm;       // [items, G] chunk max
  float* pl;       // [items, G] chunk sum of exp(s - max)
  float* pacc;     // [items, G, pad(dv)] chunk sum of exp(s - max) * v
  std::atomic<int>* status;
  // mixed calls (attend_mixed): full-precision blocks in the same softmax
  const float* qd = nullptr;  // [R, G, dk] queries of the full-precision blocks
  const DenseView* dense = nullptr;
  int H = 1;                  // KV heads: row r is (r / H, r % H)
  const BlockView* xk = nullptr;  // extra packed blocks, each with its own queries
  const BlockView* xv = nullptr;
  const float* const* xq = nullptr;
  const KeyRope* rope = nullptr;  // the call's packed keys are stored before RoPE
  const KeyRope* const* xrope = nullptr;  // per extra packed block, or null
};

// Paged attention (kv_paged.h, kv_paged_impl.h): a cache [blocks, H, bs, sw] of uint8 slots
// read through a block table. Kinds of keys and values a slot may hold:
enum PagedKey : int { kPagedKeyChannel = 0, kPagedKeyInt8 = 1 };
enum PagedValue : int { kPagedValueLevels = 0, kPagedValueInt8 = 1, kPagedValueChannelGroups = 2 };
constexpr int kPagedChannelGroup = 32;  // channels per scale of per-token channel-grouped values

// One span of attend_paged_batch's work (see paged_span in kv_paged_impl.h).
struct PagedSpan {
  int64_t r = 0, h = 0;              // request and kv head
  int64_t t_begin = 0, t_end = 0;    // cached tokens of the request, or (fresh) the step's tokens
  int M = 0;                         // query rows
  int Q = 0;                         // batch mode: the request's step tokens (row g: query head h G + g / Q,
                                     // token q0 + g % Q); 0: attend_paged's [R * H, M, D] rows
  int64_t q0 = 0;                    // the request's first row of q, k_new, v_new (batch mode)
  bool fresh = false;                // the step's own tokens from k_new / v_new, causal
  int64_t part = 0;                  // the span's first partial row in pm / pl / pacc
};

// The log-sum-exp merge of attend_paged_batch (paged_merge_item in kv_paged_impl.h): one item is
// up to kMergeRows query rows of one (request, kv head), rows [g0, g1) of its spans.
struct PagedMerge {
  const float *pm = nullptr, *pl = nullptr, *pacc = nullptr;  // the spans' partial results
  const PagedSpan* spans = nullptr;
  const int64_t* first = nullptr;  // [R * H + 1]: the spans of (r, h) are first[r H + h] .. first[r H + h + 1]
  const int64_t* qs = nullptr;     // [R + 1] query_start
  const int64_t* items = nullptr;  // [n, 3]: (r H + h, g0, g1)
  const float* vinv = nullptr;     // [H, D, D] or None: the cached share's x @ vinv[h]
  float* out = nullptr;            // [N, Hq, D]
  int64_t H = 0, Hq = 0;
  int G = 0, D = 0;
};
constexpr int kMergeRows = 64;

// A paged slot's layout as kernels/paged.py's SlotLayout passes it: the key and value kinds and
// bit widths, and the byte offsets in a slot of the key codes, key meta, value codes and value
// meta. One for a read (PagedArgs) and a write (WriteArgs, kv_paged_write.h).
struct SlotFields {
  int k_kind = 0, k_bits = 0, v_kind = 0, v_bits = 0;
  int64_t ko = 0, kmo = 0, vo = 0, vmo = 0;  // byte offsets in a slot
  void set_slot(int64_t key_kind, int64_t key_bits, int64_t value_kind, int64_t value_bits,
                const std::vector<int64_t>& offsets) {  // offsets: 4 entries (checked by the caller)
    k_kind = static_cast<int>(key_kind);
    k_bits = static_cast<int>(key_bits);
    v_kind = static_cast<int>(value_kind);
    v_bits = static_cast<int>(value_bits);
    ko = offsets[0];
    kmo = offsets[1];
    vo = offsets[2];
    vmo = offsets[3];
  }
};

struct PagedArgs : SlotFields {
  const float* q;        // [R * H, M, D]; batch mode: [N, Hq, D]
  int M = 0, D = 0;
  int64_t H = 0;
  const uint8_t* cache;  // [blocks, H, bs, sw]
  int64_t bs = 0, sw = 0;
  const int32_t* table;  // [R, tpitch] block ids
  int64_t tpitch = 0;
  const int64_t* len;    // [R] cached tokens of each request (clipped by the host)
  int kmb = 0;           // key meta bytes per slot (channel groups: 4 D / 32)
  Lut klut, vlut;
  const float* norm_table = nullptr;  // [256] for kPagedValueLevels
  float scaling = 1.0f;
  int64_t chunk = 0, chunks = 0;      // tokens per item, items per row
  float *pm, *pl, *pacc;              // [items, M], [items, M], [items, M, pad(D)]
  const KeyRope* rope = nullptr;      // keys stored before RoPE: token t turned to position t (tab, half,
                                      // interleaved, factor; no positions array)
  // batch mode (attend_paged_batch)
  int64_t Hq = 0;
  int G = 0;
  const float *knew = nullptr, *vnew = nullptr;  // [N, H, D] the step's keys and values
  const PagedSpan* spans = nullptr;
};

// q[c] = number of midpoints strictly below x[c] / s (the nearest level; ties go down);
// s == 0 maps to x / s = 0.
static inline void book_row(const float* x, const float* s, bool s_arr, int n, const float* mids, int nmids,
                            uint8_t* q) {
  for (int c = 0; c < n; ++c) {
    const float sc = s[s_arr ? c : 0];
    const float v = sc != 0.0f ? x[c] / sc : 0.0f;
    // branchless lower bound over nmids + 1 (a power of two) slots; slot nmids is +inf
    int pos = 0;
    for (int step = (nmids + 1) >> 1; step > 0; step >>= 1)
      if (pos + step - 1 < nmids && mids[pos + step - 1] < v) pos += step;
    q[c] = static_cast<uint8_t>(pos);
  }
}

namespace generic {
#define KVK_ISA 0
#include "kv_kernels_impl.h"
#include "kv_paged_impl.h"
#include "kv_paged_write_impl.h"
#undef KVK_ISA
}  // namespace generic

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define KVK_ISA 1
#include "kv_kernels_impl.h"
#include "kv_paged_impl.h"
#include "kv_paged_write_impl.h"
#undef KVK_ISA
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")
namespace avx512 {
#define KVK_ISA 2
#include "kv_kernels_impl.h"
#include "kv_paged_impl.h"
#include "kv_paged_write_impl.h"
#undef KVK_ISA
}  // namespace avx512
#pragma GCC pop_options

// ----------------------------------------------------------------------------- dispatch
enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

static int cpu_isa() {
  static const int level = [] {
    __builtin_cpu_init();
    const bool avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    return avx512 ? kAvx512 : avx2 ? kAvx2 : kGeneric;
  }();
  return level;
}

// flag: 0 = the best the CPU supports, 1 = portable C++ only, 2 = at most AVX2
static int pick_isa(int64_t flag) {
  const int cpu = cpu_isa();
  if (flag == 1) return kGeneric;
  if (flag == 2) return std::min(cpu, static_cast<int>(kAvx2));
  return cpu;
}

static std::string isa_name(int64_t flag) {
  static const char* names[] = {"generic", "avx2", "avx512"};
  return names[pick_isa(flag)];
}

#define KVK_DISPATCH(isa, fn, ...) \
  do {                             \
    if ((isa) == kAvx512)          \
      avx512::fn(__VA_ARGS__);     \
    else if ((isa) == kAvx2)       \
      avx2::fn(__VA_ARGS__);       \
    else                           \
      generic::fn(__VA_ARGS__);    \
  } while (0)

// Run fn(item, scratch) for item in [0, n) on at::get_num_threads() OpenMP threads
// (serially when there is little work or when already inside a parallel region).
template <typename F>
static void run_items(int64_t n, int64_t work, F fn) {
  const int nt = std::max(1, at::get_num_threads());
  if (nt == 1 || n == 1 || work < (1 << 15) || omp_in_parallel()) {
    Scratch s;
    for (int64_t i = 0; i < n; ++i) fn(i, s);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) fn(i, s);
  }
}

// lut: float32 [2**bits] code -> level table, zero padded to 256; `offset` where lut[i] == i + beta
static void fill_lut(Lut& lut, const at::Tensor& t, int bits) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == (1 << bits), "lut");
  std::fill(lut.v, lut.v + 256, 0.0f);
  std::memcpy(lut.v, t.data_ptr<float>(), sizeof(float) * t.numel());
  lut.beta = lut.v[0];
  lut.offset = true;
  for (int i = 0; i < (1 << bits); ++i) lut.offset = lut.offset && (static_cast<float>(i) + lut.beta == lut.v[i]);
  for (int i = 0; i < 16; ++i) {
    const int level = bits == 2 ? ((i & 3) ? (i & 3) : (i >> 2)) : i;
    uint32_t u;
    std::memcpy(&u, lut.v + level, 4);
    for (int j = 0; j < 4; ++j) lut.planes[j][i] = static_cast<uint8_t>(u >> (8 * j));
  }
}

static BlockView make_block(const at::Tensor& codes, int64_t bits, const at::Tensor& lut, int64_t grouping,
                            const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                            const c10::optional<at::Tensor>& gid, int64_t group_size,
                            const c10::optional<at::Tensor>& scale_table,
                            const c10::optional<at::Tensor>& offsets = c10::nullopt) {
  BlockView b;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte, "codes");
  b.codes = codes.data_ptr<uint8_t>();
  b.R = codes.size(0);
  b.N = codes.size(1);
  b.cpitch = row_pitch(codes);
  TORCH_CHECK(b.cpitch >= 0, "codes: rows of tokens of contiguous bytes");
  b.P = static_cast<int>(codes.size(2));
  b.bits = static_cast<int>(bits);
  b.d = b.P * 8 / b.bits;
  fill_lut(b.lut, lut, static_cast<int>(bits));
  b.grouping = static_cast<int>(grouping);
  TORCH_CHECK(scale.dim() == 3, "scale");
  b.scale.p = scale.data_ptr();
  b.scale.dt = dt_of(scale);
  b.scale.pitch = row_pitch(scale);
  TORCH_CHECK(b.scale.pitch >= 0, "scale: rows of contiguous entries");
  if (scale_table.has_value()) {
    TORCH_CHECK(b.scale.dt == DT_U8 && scale_table->scalar_type() == at::kFloat && scale_table->is_contiguous() &&
                    scale_table->numel() == 256, "scale_table: float32 [256] for uint8 scale codes");
    b.scale.table = scale_table->data_ptr<float>();
  } else {
    TORCH_CHECK(b.scale.dt != DT_U8, "uint8 scale codes need a scale_table");
  }
  if (zero.has_value()) {
    TORCH_CHECK(zero->sizes() == scale.sizes(), "zero");
    b.zero.p = zero->data_ptr();
    b.zero.dt = dt_of(*zero);
    b.zero.pitch = row_pitch(*zero);
    TORCH_CHECK(b.zero.pitch >= 0, "zero: rows of contiguous entries");
  }
  if (gid.has_value()) {
    TORCH_CHECK(gid->scalar_type() == at::kInt && gid->dim() == 2 && gid->size(0) == b.R && gid->size(1) == b.N &&
                    (b.N <= 1 || gid->stride(1) == 1), "gid");
    b.gid = gid->data_ptr<int32_t>();
    b.gpitch = b.R > 1 ? gid->stride(0) : b.N;
    TORCH_CHECK(b.gpitch >= b.N || (offsets.has_value() && b.gpitch == 0), "gid: rows of contiguous entries");
  }
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->scalar_type() == at::kLong && offsets->is_contiguous() && offsets->numel() == b.R,
                "offsets: int64 [R]");
    b.off = offsets->data_ptr<int64_t>();
    if (grouping == kToken) b.scale.off = b.zero.off = b.off;
  }
  b.gs = static_cast<int>(group_size);
  b.NG = grouping == kChannel ? scale.size(1) : 0;
  return b;
}

// A rotated packed block's values back to the model's space, x <- x R^T (R^T of KV head r % heads):
// either a dense row-major [d, d] matrix m, or the Hadamard signs s (int8 +-1, [heads, d]) of
// R = diag(s) blockdiag(H_b / sqrt(b)), so x R^T = (x blockdiag(H_b / sqrt(b))) * s, the blocks b
// the powers of two that tile d, largest first (compression.rotation.pow2_blocks): log2(b)
// butterfly passes per block instead of a d x d product.
struct ValueInverse {
  const float* m = nullptr;
  const int8_t* s = nullptr;
  int64_t heads = 1;
};

static ValueInverse make_inverse(const c10::optional<at::Tensor>& t, int64_t dv, int64_t R, const char* what) {
  ValueInverse out;
  if (!t.has_value()) return out;
  const at::Tensor& m = *t;
  TORCH_CHECK(m.is_contiguous() && m.dim() >= 1 && m.size(0) > 0 && R % m.size(0) == 0, what);
  if (m.scalar_type() == at::kChar) {
    TORCH_CHECK(m.dim() == 2 && m.size(1) == dv && dv >= 2 && dv % 2 == 0, what, " (signs)");
    out.s = m.data_ptr<int8_t>();
  } else {
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.dim() == 3 && m.size(1) == dv && m.size(2) == dv, what);
    out.m = m.data_ptr<float>();
  }
  out.heads = m.size(0);
  return out;
}

// x[0..d) = x @ M for a row-major [d, d] matrix (a rotated block's output back to its space)
static void rotate_back(float* x, const float* M, int d) {
  std::vector<float> y(d, 0.0f);
  for (int j = 0; j < d; ++j) {
    const float xj = x[j];
    const float* mr = M + static_cast<int64_t>(j) * d;
    for (int c = 0; c < d; ++c) y[c] += xj * mr[c];
  }
  std::copy(y.begin(), y.end(), x);
}

static void rotate_back(float* x, const ValueInverse& vi, int64_t r, int d) {
  if (vi.m) {
    rotate_back(x, vi.m + (r % vi.heads) * d * d, d);
    return;
  }
  if (!vi.s) return;
  const int8_t* s = vi.s + (r % vi.heads) * d;
  for (int at = 0; at < d;) {
    int b = 1;
    while (2 * b <= d - at) b *= 2;  // the largest power of two that fits
    float* xb = x + at;
    for (int h = 1; h < b; h <<= 1)
      for (int i = 0; i < b; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float u = xb[j], v = xb[j + h];
          xb[j] = u + v;
          xb[j + h] = u - v;
        }
    const float norm = 1.0f / std::sqrt(static_cast<float>(b));
    for (int c = 0; c < b; ++c) xb[c] *= norm * static_cast<float>(s[at + c]);
    at += b;
  }
}

static void raise_bad_group() {
  throw pybind11::value_error(
      "a group index in gid is outside [0, scale.shape[1]) (or gid is None and N exceeds "
      "scale.shape[1] * group_size)");
}

// ----------------------------------------------------------------------------- ops
// A few keys between the stored frame and the model's (math dictionary §29.2, §29.7): the sinks a
// decoding step reads, the token it stores. x, out: float32 [R, n, d]; pos: int64 [n], shared by
// every row; w: float32 [half] frequencies; offset: float32 [R, 1 or 2, d] (mean, scale) or none.
//   forward: out = f R(p) (scale * x + mean)         inverse: out = (R(p)^T x / f - mean) / scale
// Angles are float32 products p * w_i, as transformers computes them; pairs (i, i + half) or, with
// `interleaved`, (2i, 2i + 1); channels past 2 * half pass through (not scaled by f).
void turn_keys(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& w, double factor, bool interleaved,
               bool inverse, const c10::optional<at::Tensor>& offset, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3 && out.sizes() == x.sizes() &&
                  out.scalar_type() == at::kFloat && out.is_contiguous(), "turn_keys: float32 [R, n, d] contiguous");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.dim() == 1 && pos.size(0) == x.size(1),
              "turn_keys: positions int64 [n]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && 2 * w.size(0) <= x.size(2),
              "turn_keys: inv_freq float32 [half], 2 * half <= d");
  const int64_t R = x.size(0), n = x.size(1), d = x.size(2), half = w.size(0);
  const float* mu = nullptr;
  const float* sg = nullptr;
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == at::kFloat && offset->is_contiguous() && offset->dim() == 3 &&
                    offset->size(0) == R && (offset->size(1) == 1 || offset->size(1) == 2) && offset->size(2) == d,
                "turn_keys: offset float32 [R, 1 or 2, d] contiguous");
    mu = offset->data_ptr<float>();
    if (offset->size(1) == 2) sg = mu + d;
  }
  const int64_t orow = offset.has_value() ? offset->size(1) * d : 0;
  const float* px = x.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* pw = w.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float f = static_cast<float>(factor);
  std::vector<float> cs(2 * half), y(d);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(pp[t]) * pw[i];
      cs[i] = std::cos(a);
      cs[half + i] = std::sin(a);
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = px + (r * n + t) * d;
      float* o = po + (r * n + t) * d;
      const float* m = mu ? mu + r * orow : nullptr;
      const float* sc = sg ? sg + r * orow : nullptr;
      for (int64_t c = 0; c < d; ++c) y[c] = inverse ? xr[c] : (sc ? xr[c] * sc[c] : xr[c]) + (m ? m[c] : 0.0f);
      for (int64_t i = 0; i < half; ++i) {
        const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
        const float a = y[ia], b = y[ib], c = cs[i], sn = cs[half + i];
        if (inverse) {
          y[ia] = (a * c + b * sn) / f;
          y[ib] = (b * c - a * sn) / f;
        } else {
          y[ia] = (a * c - b * sn) * f;
          y[ib] = (a * sn + b * c) * f;
        }
      }
      for (int64_t c = 0; c < d; ++c) {
        const float v = inverse ? (y[c] - (m ? m[c] : 0.0f)) : y[c];
        o[c] = inverse && sc ? v / sc[c] : v;
      }
    }
  }
}

// Returns a Status: kOk, kNonFinite or kScaleUnrepresentable (Python raises the message).
int64_t quantize(const at::Tensor& x, int64_t bits, int64_t grouping, int64_t group_size, bool symmetric,
                 const c10::optional<at::Tensor>& mids, at::Tensor& codes, at::Tensor& scale,
                 const c10::optional<at::Tensor>& zero, int64_t isa, const c10::optional<at::Tensor>& signs,
                 const std::vector<double>& log_norm) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && codes.is_contiguous() && scale.is_contiguous(), "layout");
  TORCH_CHECK(!signs.has_value() || (mids.has_value() && grouping == kToken && signs->scalar_type() == at::kChar &&
                                     signs->is_contiguous() && signs->dim() == 2 && signs->size(1) == x.size(2) &&
                                     x.size(0) % signs->size(0) == 0 && (x.size(2) & (x.size(2) - 1)) == 0),
              "quantize signs: int8 [H, d] with d a power of two, codebook token grouping");
  TORCH_CHECK(log_norm.empty() || (log_norm.size() == 4 && mids.has_value() && scale.scalar_type() == at::kByte),
              "quantize log_norm: (smallest, E_min, step, largest) with a codebook and uint8 scale codes");
  std::atomic<int> status{kOk};
  QuantArgs a;
  a.x = x.data_ptr();
  a.xdt = dt_of(x);
  a.R = x.size(0);
  a.N = x.size(1);
  a.d = static_cast<int>(x.size(2));
  a.P = static_cast<int>(codes.size(2));
  a.bits = static_cast<int>(bits);
  a.grouping = static_cast<int>(grouping);
  a.gs = static_cast<int>(group_size);
  a.symmetric = symmetric;
  a.codebook = mids.has_value();
  // symmetric: clamp(round(x/s), -qmax, qmax) + 2**(b-1) == clamp(round(x/s) + 2**(b-1), 1, 2**b - 1)
  a.qlo = symmetric ? 1.0f : 0.0f;
  a.qhi = static_cast<float>((1 << bits) - 1);
  a.qmax = symmetric ? static_cast<float>((1 << (bits - 1)) - 1) : a.qhi;
  a.sym_offset = static_cast<float>(1 << (bits - 1));
  a.mids = a.codebook ? mids->data_ptr<float>() : nullptr;
  a.nmids = a.codebook ? static_cast<int>(mids->numel()) : 0;
  a.codes = codes.data_ptr<uint8_t>();
  a.scale = scale.data_ptr();
  a.sdt = dt_of(scale);
  a.zero = zero.has_value() ? zero->data_ptr<int16_t>() : nullptr;
  a.status = &status;
  if (signs.has_value()) {
    a.signs = signs->data_ptr<int8_t>();
    a.signs_heads = signs->size(0);
  }
  if (!log_norm.empty()) {
    a.log_norm = true;
    a.log_lo = log_norm[0];
    a.log_min_exp = log_norm[1];
    a.log_step = log_norm[2];
    a.log_top = static_cast<float>(log_norm[3]);
  }
  const int64_t items = grouping == kChannel ? a.R * (a.N / a.gs) : a.R * ((a.N + kTokChunk - 1) / kTokChunk);
  const int isa_level = pick_isa(isa);
  run_items(items, a.R * a.N * a.d, [&](int64_t i, Scratch& s) {
    if (status.load(std::memory_order_relaxed) != kOk) return;
    KVK_DISPATCH(isa_level, quantize_item, a, i, s);
  });
  return status.load();
}

void dequantize(const at::Tensor& codes, int64_t bits, const at::Tensor& lut, int64_t grouping,
                const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                const c10::optional<at::Tensor>& gid, int64_t group_size, at::Tensor& out, int64_t isa,
                const c10::optional<at::Tensor>& scale_table) {
  std::atomic<int> status{kOk};
  DequantArgs a;
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous() && (!zero.has_value() || zero->is_contiguous()) &&
                  (!gid.has_value() || gid->is_contiguous()), "dequantize: contiguous tensors");
  a.blk = make_block(codes, bits, lut, grouping, scale, zero, gid, group_size, scale_table);
  TORCH_CHECK(out.is_contiguous() && out.numel() == a.blk.R * a.blk.N * a.blk.d, "out");
  a.out = out.data_ptr();
  a.odt = dt_of(out);
  a.status = &status;
  const int64_t items = a.blk.R * ((a.blk.N + kTokChunk - 1) / kTokChunk);
  const int isa_level = pick_isa(isa);
  run_items(items, a.blk.R * a.blk.N * a.blk.d, [&](int64_t i, Scratch& s) {
    KVK_DISPATCH(isa_level, dequantize_item, a, i, s);
  });
  if (status.load() == kBadGroup) raise_bad_group();
}

// A packed key block's KeyRope from tensors [positions, inv_freq, mean, scale, signs]: positions
// int32 [R, N] contiguous, or, for a flat ragged block, [R, N] with row stride 0 (the buffer's
// tokens, read at the row's offset); inv_freq float32 [half]; mean, scale float32 [R, d] or None;
// signs float32 [H, d] or None. `tab` receives the doubling table.
// rope.tab <- (cos, sin)(2^j w_i) for j < kRopeBits (in tab): one sincos per pair, then doubled
// in float64; rope.half <- the pairs.
static void rope_doubling_table(const at::Tensor& w, KeyRope& rope, std::vector<float>& tab) {
  rope.half = static_cast<int>(w.numel());
  tab.resize(static_cast<size_t>(kRopeBits) * 2 * rope.half);
  const float* wp = w.data_ptr<float>();
  for (int i = 0; i < rope.half; ++i) {
    double c = std::cos(static_cast<double>(wp[i])), sn = std::sin(static_cast<double>(wp[i]));
    for (int j = 0; j < kRopeBits; ++j) {
      tab[(2 * j) * rope.half + i] = static_cast<float>(c);
      tab[(2 * j + 1) * rope.half + i] = static_cast<float>(sn);
      const double c2 = c * c - sn * sn, s2 = 2.0 * sn * c;
      const double norm = 1.0 / std::sqrt(c2 * c2 + s2 * s2);  // stay on the unit circle
      c = c2 * norm;
      sn = s2 * norm;
    }
  }
  rope.tab = tab.data();
}

static void make_rope(const std::vector<c10::optional<at::Tensor>>& k_rope, int64_t interleaved, double factor,
                      const BlockView& K, KeyRope& rope, std::vector<float>& tab) {
  TORCH_CHECK(k_rope.size() == 5 && k_rope[0].has_value() && k_rope[1].has_value(), "k_rope");
  const at::Tensor& pos = *k_rope[0];
  const at::Tensor& w = *k_rope[1];
  TORCH_CHECK(pos.scalar_type() == at::kInt && pos.dim() == 2 && pos.size(0) == K.R && pos.size(1) == K.N &&
                  (pos.size(1) <= 1 || pos.stride(1) == 1) &&
                  (K.off ? (K.R <= 1 || pos.stride(0) == 0) : (pos.is_contiguous() || pos.stride(0) == 0)),
              "k_rope positions: int32 [R, N], contiguous or rows of stride 0 (one row of positions for all)");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.numel() >= 1 &&
                  2 * w.numel() <= K.d, "k_rope inv_freq: float32 [half], 2 * half <= d");
  rope.pos = pos.data_ptr<int32_t>();
  rope.pitch = K.off || K.R <= 1 ? 0 : pos.stride(0);  // 0: every row reads the same positions (or a flat block's own)
  rope.interleaved = interleaved != 0;
  rope.factor = static_cast<float>(factor);
  rope_doubling_table(w, rope, tab);
  for (int m = 2; m < 4; ++m)
    if (k_rope[m].has_value()) {
      const at::Tensor& t = *k_rope[m];
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == K.R && t.size(1) == K.d &&
                      (K.d <= 1 || t.stride(1) == 1) && (K.R <= 1 || t.stride(0) >= K.d),
                  "k_rope mean/scale: float32 [R, d], each row contiguous");
      (m == 2 ? rope.mean : rope.scale) = t.data_ptr<float>();
      (m == 2 ? rope.mean_pitch : rope.scale_pitch) = K.R <= 1 ? K.d : t.stride(0);
    }
  if (k_rope[4].has_value()) {
    const at::Tensor& t = *k_rope[4];
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(1) == K.d &&
                    t.size(0) >= 1 && K.R % t.size(0) == 0 && (K.d & (K.d - 1)) == 0,
                "k_rope signs: float32 [H, d] contiguous, R a multiple of H, d a power of two");
    rope.signs = t.data_ptr<float>();
    rope.signs_heads = t.size(0);
  }
}

// out [R, G, dv] float32, lse [R, G] float32, logits [R, G, N] float32 (optional), all
// preallocated by the caller.
void attend(const at::Tensor& q, const at::Tensor& k_codes, int64_t k_bits, const at::Tensor& k_lut,
            int64_t k_grouping, const at::Tensor& k_scale, const c10::optional<at::Tensor>& k_zero,
            const c10::optional<at::Tensor>& k_gid, int64_t k_group_size, const at::Tensor& v_codes,
            int64_t v_bits, const at::Tensor& v_lut, int64_t v_grouping, const at::Tensor& v_scale,
            const c10::optional<at::Tensor>& v_zero, const c10::optional<at::Tensor>& v_gid,
            int64_t v_group_size, double scaling, const c10::optional<at::Tensor>& start,
            const c10::optional<at::Tensor>& length, at::Tensor& out, at::Tensor& lse,
            const c10::optional<at::Tensor>& logits, int64_t isa, const c10::optional<at::Tensor>& qd,
            const std::vector<at::Tensor>& dense_k, const std::vector<at::Tensor>& dense_v,
            const c10::optional<at::Tensor>& dense_start, const c10::optional<at::Tensor>& vinv,
            const c10::optional<at::Tensor>& k_table, const c10::optional<at::Tensor>& v_table,
            const std::vector<std::vector<c10::optional<at::Tensor>>>& x_tensors,
            const std::vector<std::vector<int64_t>>& x_ints, const c10::optional<at::Tensor>& offsets,
            const std::vector<c10::optional<at::Tensor>>& dense_off,
            const std::vector<c10::optional<at::Tensor>>& dense_len,
            const std::vector<c10::optional<at::Tensor>>& k_rope, int64_t rope_interleaved, double rope_factor,
            const std::vector<std::vector<c10::optional<at::Tensor>>>& x_rope,
            const std::vector<int64_t>& x_rope_interleaved, const std::vector<double>& x_rope_factor) {
  std::atomic<int> status{kOk};
  AttendArgs a;
  a.k = make_block(k_codes, k_bits, k_lut, k_grouping, k_scale, k_zero, k_gid, k_group_size, k_table, offsets);
  a.v = make_block(v_codes, v_bits, v_lut, v_grouping, v_scale, v_zero, v_gid, v_group_size, v_table, offsets);
  // keys before RoPE (the call's packed block; the extra ones below): see make_rope
  KeyRope rope;
  std::vector<float> rope_tab;
  if (!k_rope.empty()) {
    make_rope(k_rope, rope_interleaved, rope_factor, a.k, rope, rope_tab);
    a.rope = &rope;
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q");
  // extra packed blocks: tensors [k_codes, k_lut, k_scale, k_zero, k_gid, k_table, v_codes, v_lut,
  // v_scale, v_zero, v_gid, v_table, start, q, vinv, offsets, length] (the last two: a flat ragged
  // block, int64 [R] and int32 [R], or None), ints [k_bits, k_grouping, k_gs, v_bits,
  // v_grouping, v_gs]; q [R, G, dk] float32 (the block's own space), vinv as ValueInverse or None
  const int64_t n_extra = static_cast<int64_t>(x_tensors.size());
  TORCH_CHECK(static_cast<int64_t>(x_ints.size()) == n_extra, "x_tensors and x_ints differ in length");
  std::vector<BlockView> xk(n_extra), xv(n_extra);
  std::vector<const int32_t*> xstart(n_extra, nullptr), xlen(n_extra, nullptr);
  std::vector<const float*> xq(n_extra, nullptr);
  std::vector<ValueInverse> xvi(n_extra);
  for (int64_t i = 0; i < n_extra; ++i) {
    const auto& T = x_tensors[i];
    const auto& I = x_ints[i];
    TORCH_CHECK(T.size() == 17 && I.size() == 6 && T[0].has_value() && T[1].has_value() && T[2].has_value() &&
                    T[6].has_value() && T[7].has_value() && T[8].has_value() && T[13].has_value(),
                "extra packed block ", i);
    TORCH_CHECK(T[13]->scalar_type() == at::kFloat && T[13]->is_contiguous() && T[13]->sizes() == q.sizes(),
                "extra packed block q");
    xq[i] = T[13]->data_ptr<float>();
    xvi[i] = make_inverse(T[14], a.v.d, q.size(0), "extra packed block vinv");
    xk[i] = make_block(*T[0], I[0], *T[1], I[1], *T[2], T[3], T[4], I[2], T[5], T[15]);
    xv[i] = make_block(*T[6], I[3], *T[7], I[4], *T[8], T[9], T[10], I[5], T[11], T[15]);
    if (T[16].has_value()) {
      TORCH_CHECK(T[16]->scalar_type() == at::kInt && T[16]->is_contiguous() && T[16]->numel() == xk[i].R, "length");
      xlen[i] = T[16]->data_ptr<int32_t>();
    }
    TORCH_CHECK(xk[i].R == a.k.R && xv[i].R == a.k.R && xk[i].N == xv[i].N && xk[i].d == a.k.d && xv[i].d == a.v.d,
                "extra packed block shapes");
    if (T[12].has_value()) {
      TORCH_CHECK(T[12]->scalar_type() == at::kInt && T[12]->is_contiguous() && T[12]->numel() == a.k.R, "start");
      xstart[i] = T[12]->data_ptr<int32_t>();
    }
  }
  // extra packed blocks' keys before RoPE: x_rope[i] empty (none) or make_rope's tensors
  TORCH_CHECK(x_rope.empty() || (static_cast<int64_t>(x_rope.size()) == n_extra &&
                                 static_cast<int64_t>(x_rope_interleaved.size()) == n_extra &&
                                 static_cast<int64_t>(x_rope_factor.size()) == n_extra), "x_rope");
  std::vector<KeyRope> xrope(n_extra);
  std::vector<std::vector<float>> xrope_tab(n_extra);
  std::vector<const KeyRope*> xrope_ptr(n_extra, nullptr);
  for (int64_t i = 0; i < static_cast<int64_t>(x_rope.size()); ++i)
    if (!x_rope[i].empty()) {
      make_rope(x_rope[i], x_rope_interleaved[i], x_rope_factor[i], xk[i], xrope[i], xrope_tab[i]);
      xrope_ptr[i] = &xrope[i];
    }
  a.xrope = xrope_ptr.data();
  a.xk = xk.data();
  a.xv = xv.data();
  a.xq = xq.data();
  const int64_t R = a.k.R, N = a.k.N;
  const int G = static_cast<int>(q.size(1));
  const int dv = a.v.d, dvp = pad_to(dv);
  a.q = q.data_ptr<float>();
  a.G = G;
  a.scaling = static_cast<float>(scaling);
  a.status = &status;
  const int32_t* st = start.has_value() ? start->data_ptr<int32_t>() : nullptr;
  const int32_t* ln = length.has_value() ? length->data_ptr<int32_t>() : nullptr;
  a.logits = logits.has_value() ? logits->data_ptr<float>() : nullptr;
  // full-precision blocks [B, H, n, d] (mixed calls), attended in the same softmax
  const int64_t n_dense = static_cast<int64_t>(dense_k.size());
  TORCH_CHECK(static_cast<int64_t>(dense_v.size()) == n_dense, "dense_k and dense_v differ in length");
  std::vector<DenseView> dviews(n_dense);
  for (int64_t i = 0; i < n_dense; ++i) {
    const at::Tensor& kt = dense_k[i];
    const at::Tensor& vt = dense_v[i];
    TORCH_CHECK(kt.dim() == 4 && vt.dim() == 4 && kt.scalar_type() == vt.scalar_type(), "dense blocks");
    TORCH_CHECK(kt.size(0) * kt.size(1) == R && vt.size(0) == kt.size(0) && vt.size(1) == kt.size(1) &&
                    vt.size(2) == kt.size(2), "dense block shapes");
    TORCH_CHECK(kt.stride(3) == 1 && vt.stride(3) == 1 && (kt.size(2) <= 1 || (kt.stride(2) == kt.size(3) &&
                                                                               vt.stride(2) == vt.size(3))),
                "dense blocks: tokens must be contiguous rows");
    TORCH_CHECK(kt.size(3) == a.k.d && vt.size(3) == a.v.d, "dense block head dims");
    DenseView& D = dviews[i];
    D.k = kt.data_ptr();
    D.v = vt.data_ptr();
    D.dt = dt_of(kt);
    TORCH_CHECK(D.dt == DT_F32 || D.dt == DT_F16 || D.dt == DT_BF16, "dense blocks: float32/16 or bfloat16");
    D.n = kt.size(2);
    D.kb = kt.stride(0);
    D.kh = kt.stride(1);
    D.vb = vt.stride(0);
    D.vh = vt.stride(1);
    D.dk = static_cast<int>(kt.size(3));
    D.dv = static_cast<int>(vt.size(3));
    if (dense_start.has_value()) D.start = dense_start->data_ptr<int32_t>() + i * R;
    if (i < static_cast<int64_t>(dense_off.size()) && dense_off[i].has_value()) {  // a flat ragged block
      const at::Tensor& o = *dense_off[i];
      TORCH_CHECK(o.scalar_type() == at::kLong && o.is_contiguous() && o.numel() == R, "dense offsets: int64 [R]");
      D.off = o.data_ptr<int64_t>();
    }
    if (i < static_cast<int64_t>(dense_len.size()) && dense_len[i].has_value()) {
      const at::Tensor& l = *dense_len[i];
      TORCH_CHECK(l.scalar_type() == at::kInt && l.is_contiguous() && l.numel() == R, "dense lengths: int32 [R]");
      D.len = l.data_ptr<int32_t>();
    }
  }
  if (n_dense) {
    TORCH_CHECK(!dense_start.has_value() || (dense_start->scalar_type() == at::kInt && dense_start->is_contiguous() &&
                                             dense_start->numel() == n_dense * R), "dense_start");
    a.H = static_cast<int>(dense_k[0].size(1));
  }
  a.dense = dviews.data();
  a.qd = a.q;
  if (qd.has_value()) {
    TORCH_CHECK(qd->scalar_type() == at::kFloat && qd->is_contiguous() && qd->sizes() == q.sizes(), "qd");
    a.qd = qd->data_ptr<float>();
  }
  const ValueInverse vi = make_inverse(vinv, dv, R, "vinv");
  // valid tokens of row r: [lo, hi) = [start, length) clipped to [0, N)
  std::vector<int64_t> lo(R), hi(R);
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    lo[r] = st ? std::min<int64_t>(std::max<int64_t>(st[r], 0), N) : 0;
    hi[r] = ln ? std::min<int64_t>(std::max<int64_t>(ln[r], 0), N) : N;
    if (hi[r] < lo[r]) hi[r] = lo[r];
    total += hi[r] - lo[r];
  }
  // split-K: about 16 chunks per thread in all, at least 256 tokens each
  const int nt = std::max(1, at::get_num_threads());
  int64_t chunk = std::max<int64_t>(256, (total + 16 * nt - 1) / (16 * nt));
  chunk = (chunk + kTile - 1) / kTile * kTile;
  std::vector<AttendItem> items;
  std::vector<int64_t> first(R + 1);
  for (int64_t r = 0; r < R; ++r) {
    first[r] = static_cast<int64_t>(items.size());
    for (int64_t t = lo[r]; t < hi[r]; t += chunk) items.push_back({r, t, std::min(hi[r], t + chunk), -1, 0});
    for (int64_t i = 0; i < n_extra; ++i) {
      const int64_t n = xlen[i] ? std::min<int64_t>(std::max<int32_t>(xlen[i][r], 0), xk[i].N) : xk[i].N;
      const int64_t t0 = xstart[i] ? std::min<int64_t>(std::max<int64_t>(xstart[i][r], 0), n) : 0;
      for (int64_t t = t0; t < n; t += chunk)
        items.push_back({r, t, std::min(n, t + chunk), -1, static_cast<int>(i + 1)});
      total += n - t0;
    }
    for (int64_t i = 0; i < n_dense; ++i) {
      const DenseView& D = dviews[i];
      const int64_t n = D.len ? std::min<int64_t>(std::max<int32_t>(D.len[r], 0), D.n) : D.n;
      const int64_t t0 = D.start ? std::min<int64_t>(std::max<int64_t>(D.start[r], 0), n) : 0;
      for (int64_t t = t0; t < n; t += chunk) items.push_back({r, t, std::min(n, t + chunk), static_cast<int>(i), 0});
      total += n - t0;
    }
  }
  first[R] = static_cast<int64_t>(items.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::vector<float> pm(n_items * G), pl(n_items * G), pacc(n_items * G * dvp);
  a.items = items.data();
  a.pm = pm.data();
  a.pl = pl.data();
  a.pacc = pacc.data();
  if (a.logits) {  // masked positions
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) {
        float* row = a.logits + (r * G + g) * N;
        std::fill(row, row + lo[r], ninf);
        std::fill(row + hi[r], row + N, ninf);
      }
  }
  const int isa_level = pick_isa(isa);
  if (n_items > 0) {
    run_items(n_items, total * G * (a.k.d + dv) / 4, [&](int64_t i, Scratch& s) {
      if (items[i].dense < 0)
        KVK_DISPATCH(isa_level, attend_item, a, i, s);
      else
        KVK_DISPATCH(isa_level, attend_dense_item, a, i, s);
    });
  }
  if (status.load() == kBadGroup) raise_bad_group();
  std::vector<float> share((n_extra + 1) * dv);
  // merge the chunks of each row by log-sum-exp
  float* o = out.data_ptr<float>();
  float* L = lse.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float* orow = o + (r * G + g) * dv;
      std::fill(orow, orow + dv, 0.0f);
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t i = first[r]; i < first[r + 1]; ++i) M = std::max(M, pm[i * G + g]);
      if (!(M > -std::numeric_limits<float>::infinity())) {
        L[r * G + g] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0.0;
      // each packed block's share apart, rotated back (its vinv) before the shares are added
      std::fill(share.begin(), share.end(), 0.0f);
      for (int64_t i = first[r]; i < first[r + 1]; ++i) {
        const float w = std::exp(pm[i * G + g] - M);
        sum += static_cast<double>(w) * pl[i * G + g];
        const float* pa = pacc.data() + (i * G + g) * dvp;
        float* dst = items[i].dense >= 0 ? orow : share.data() + static_cast<int64_t>(items[i].packed) * dv;
        for (int c = 0; c < dv; ++c) dst[c] += w * pa[c];
      }
      for (int64_t p = 0; p <= n_extra; ++p) {
        float* sp = share.data() + p * dv;
        rotate_back(sp, p == 0 ? vi : xvi[p - 1], r, dv);
        for (int c = 0; c < dv; ++c) orow[c] += sp[c];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int c = 0; c < dv; ++c) orow[c] *= inv;
      L[r * G + g] = M + static_cast<float>(std::log(sum));
    }
}

// In place: row r of buf ([R, cap, ...] contiguous, any dtype) keeps the tokens keep[r, :K]
// (sorted ascending, unique): buf[r, j] = buf[r, keep[r, j]] for j < K. Since keep[r, j] >= j,
// a forward sweep of memmoves never reads a token it has already overwritten: no temporary, and
// only the tokens after the first dropped one move (eviction of one token moves half a row).
void compact_rows(torch::Tensor buf, torch::Tensor keep) {
  TORCH_CHECK(buf.is_contiguous() && buf.device().is_cpu(), "buf must be a contiguous CPU tensor");
  TORCH_CHECK(keep.dim() == 2 && keep.scalar_type() == torch::kInt64 && keep.is_contiguous(),
              "keep must be a contiguous int64 [R, K] tensor");
  TORCH_CHECK(buf.dim() >= 2 && buf.size(0) == keep.size(0), "buf must be [R, cap, ...] with R = keep.size(0)");
  const int64_t R = buf.size(0), cap = buf.size(1), K = keep.size(1);
  TORCH_CHECK(K <= cap, "keep has more tokens than buf holds");
  const int64_t token = buf.numel() / std::max<int64_t>(1, R * cap) * buf.element_size();
  uint8_t* base = static_cast<uint8_t*>(buf.data_ptr());
  const int64_t* kp = keep.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t* kr = kp + r * K;
    for (int64_t j = 0; j < K; ++j)
      TORCH_CHECK(kr[j] >= j && kr[j] < cap && (j == 0 || kr[j] > kr[j - 1]),
                  "keep must be sorted, unique and inside the buffer");
  }
#pragma omp parallel for if (R > 1)
  for (int64_t r = 0; r < R; ++r) {
    uint8_t* row = base + r * cap * token;
    const int64_t* kr = kp + r * K;
    int64_t j = 0;
    while (j < K && kr[j] == j) ++j;  // the untouched prefix
    while (j < K) {  // runs of consecutive kept tokens move as one block
      int64_t e = j + 1;
      while (e < K && kr[e] == kr[e - 1] + 1) ++e;
      std::memmove(row + j * token, row + kr[j] * token, static_cast<size_t>((e - j) * token));
      j = e;
    }
  }
}

#include "kv_paged.h"
#include "kv_paged_write.h"

}  // namespace kvk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kv_cache compiled kernels (CPU): fused (de)quantization and attention from packed codes";
  m.def("quantize", &kvk::quantize, "fused quantize + pack (see kv_cache.kernels.ops.quantize_block)");
  m.def("turn_keys", &kvk::turn_keys, "a few keys between the stored frame and the model's (see kv_cache.kernels.arrival.turn_stored_keys)");
  m.def("dequantize", &kvk::dequantize, "fused unpack + dequantize (see kv_cache.kernels.ops.dequantize_block)");
  m.def("attend", &kvk::attend, "attention from packed codes (see kv_cache.kernels.ops.attend_block)");
  m.def("attend_paged", &kvk::attend_paged, "attention read from paged slots through a block table (see kv_cache.kernels.paged)");
  m.def("attend_paged_batch", &kvk::attend_paged_batch, "a step's attention for every request in one call: paged codes plus the step's own tokens (see kv_cache.kernels.paged_batch)");
  m.def("write_paged", &kvk::write_paged, "encode tokens into paged slots in place (see kv_cache.kernels.paged.write_paged)");
  m.def("compact_rows", &kvk::compact_rows, "in-place gather of sorted kept tokens per row (see ops.compact_rows_)");
  m.def("isa", &kvk::isa_name, "name of the code path a call with this isa flag takes");
}
