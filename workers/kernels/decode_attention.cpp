// Attention for a few queries per sequence, on CPU, in two ops over one inner loop:
// - decode_attention: the decodes over their persistent rows: one query token per sequence, its
//   G query heads per KV head, over the first `lengths[n]` positions of row `rows[n]`, the last
//   of which is this step's K/V (`new_k`, `new_v`), written into the row first, and into the
//   paged cache at slot `slots[n]`;
// - span_attention: the short chunks (draft verifications, prompt tails) over the paged cache in
//   place: query token n reads the first `lengths[n]` positions of its sequence through block
//   table `tables[spans[n]]` (causal within a chunk: each query's own length), its chunk's K/V
//   already in the cache. No gathered copy of the context, no mask, no padded queries.
//
// Why not SDPA: a decode has 1-3 queries per KV head and ~100-1,000 positions, where ATen's CPU
// flash attention spends most of a call on per-block set-up (tiles, packing, buffers) rather
// than reading K and V, and it needs a mask per row and calls per run of rows of near length.
// Here each (sequence, KV head) is one pass over exactly its own positions: scores in float32,
// a softmax with ATen's exp, then the weighted sum of V, all with ATen's vector types.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

inline Vec load_float(const float* p) { return Vec::loadu(p); }

inline Vec load_float(const at::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

inline Vec load_float(const at::Half* p) {
  Vec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

inline float sum_lanes(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
#endif
}

// Where position p's K (and V) vector lies, from a (sequence, KV head)'s base: in a persistent
// row, one stride apart ...
struct RowPositions {
  int64_t stride;
  int64_t operator()(int64_t p) const { return p * stride; }
};

// ... or in the paged cache, through the sequence's block table (positions of a block adjacent)
struct PagedPositions {
  const int64_t* table;
  int64_t block_size, slot_stride;
  int64_t operator()(int64_t p) const {
    return (table[p / block_size] * block_size + p % block_size) * slot_stride;
  }
};

// One (sequence, KV head): G queries of CH vectors each over `length` positions. G and CH are
// compile-time so the queries and the accumulators live in registers.
template <typename T, int G, int CH, typename Positions>
void attend_one(const T* q, int64_t q_group_stride, const T* k, const T* v, const Positions& at,
                int64_t length, float scale, float* scores, T* out) {
  constexpr int64_t dim = CH * kLanes;
  Vec query[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c)
      query[g][c] = load_float(q + g * q_group_stride + c * kLanes) * Vec(scale);
  // The rows are cold (a step reads every layer's once) and each (row, head) is a short stream,
  // too short for the hardware prefetcher to get ahead: fetch K a few positions ahead, and this
  // position's V now, so the second pass finds it in cache.
  constexpr int64_t kLineBytes = 64;
  constexpr int64_t kRowBytes = dim * sizeof(T);
  // ~2 KB ahead: 16 positions of bfloat16 heads of 64, 8 of float32 (each measured best)
  constexpr int64_t kAhead = std::max<int64_t>(2, 2048 / kRowBytes);
  for (int64_t p = 0; p < length; ++p) {
    const int64_t here = at(p);
    const T* key = k + here;
    const char* ahead = reinterpret_cast<const char*>(k + at(std::min(p + kAhead, length - 1)));
    const char* value_now = reinterpret_cast<const char*>(v + here);
    for (int64_t b = 0; b < kRowBytes; b += kLineBytes) {
      __builtin_prefetch(ahead + b);
      __builtin_prefetch(value_now + b);
    }
    Vec kv[CH];
    for (int c = 0; c < CH; ++c) kv[c] = load_float(key + c * kLanes);
    for (int g = 0; g < G; ++g) {
      Vec acc = query[g][0] * kv[0];
      for (int c = 1; c < CH; ++c) acc = at::vec::fmadd(query[g][c], kv[c], acc);
      scores[g * length + p] = sum_lanes(acc);
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * length;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < length; ++p) top = std::max(top, row[p]);
    Vec sum(0.f);
    int64_t p = 0;
    for (; p + kLanes <= length; p += kLanes) {
      const Vec e = (Vec::loadu(row + p) - Vec(top)).exp_u20();
      e.store(row + p);
      sum = sum + e;
    }
    float tail = 0.f;
    for (; p < length; ++p) {
      row[p] = std::exp(row[p] - top);
      tail += row[p];
    }
    total[g] = sum_lanes(sum) + tail;
  }
  Vec acc[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = Vec(0.f);
  for (int64_t p = 0; p < length; ++p) {
    const T* value = v + at(p);
    Vec vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = load_float(value + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const Vec w(scores[g * length + p]);
      for (int c = 0; c < CH; ++c) acc[g][c] = at::vec::fmadd(w, vv[c], acc[g][c]);
    }
  }
  float tmp[kLanes];
  for (int g = 0; g < G; ++g) {
    const Vec norm(1.f / total[g]);
    for (int c = 0; c < CH; ++c) {
      (acc[g][c] * norm).store(tmp);
      for (int64_t i = 0; i < kLanes; ++i) out[g * dim + c * kLanes + i] = static_cast<T>(tmp[i]);
    }
  }
}

template <typename T, typename Positions>
using AttendFn = void (*)(const T*, int64_t, const T*, const T*, const Positions&, int64_t, float,
                          float*, T*);

template <typename T, typename Positions, int G>
AttendFn<T, Positions> pick_chunks(int64_t chunks) {
  switch (chunks) {
    case 1: return &attend_one<T, G, 1, Positions>;
    case 2: return &attend_one<T, G, 2, Positions>;
    case 4: return &attend_one<T, G, 4, Positions>;
    case 8: return &attend_one<T, G, 8, Positions>;
    default: return nullptr;
  }
}

// The compiled (group, head_dim / lanes) pairs: 1-8 query heads per KV head, 1, 2, 4 or 8
// vectors a head; nullptr for any other shape (the caller keeps SDPA for those).
template <typename T, typename Positions = RowPositions>
AttendFn<T, Positions> pick(int64_t group, int64_t dim) {
  if (dim % kLanes != 0) return nullptr;
  const int64_t chunks = dim / kLanes;
  switch (group) {
    case 1: return pick_chunks<T, Positions, 1>(chunks);
    case 2: return pick_chunks<T, Positions, 2>(chunks);
    case 3: return pick_chunks<T, Positions, 3>(chunks);
    case 4: return pick_chunks<T, Positions, 4>(chunks);
    case 5: return pick_chunks<T, Positions, 5>(chunks);
    case 6: return pick_chunks<T, Positions, 6>(chunks);
    case 7: return pick_chunks<T, Positions, 7>(chunks);
    case 8: return pick_chunks<T, Positions, 8>(chunks);
    default: return nullptr;
  }
}

bool supports(int64_t group, int64_t head_dim) { return pick<float>(group, head_dim) != nullptr; }

template <typename T>
void run(const at::Tensor& q, at::Tensor& k, at::Tensor& v, const at::Tensor& new_k,
         const at::Tensor& new_v, const int64_t* row_of, const int64_t* length_of,
         at::Tensor& cache_k, at::Tensor& cache_v, const int64_t* slot_of, float scale,
         at::Tensor& out) {
  const int64_t n = q.size(0), kv_heads = q.size(1), group = q.size(2), dim = q.size(3);
  const T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  const T* nkp = new_k.data_ptr<T>();
  const T* nvp = new_v.data_ptr<T>();
  T* ckp = cache_k.data_ptr<T>();
  T* cvp = cache_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const AttendFn<T, RowPositions> attend = pick<T>(group, dim);
  const RowPositions at{k.stride(2)};
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kv_heads, h = item % kv_heads;
      const int64_t length = length_of[i];
      const int64_t base = row_of[i] * k.stride(0) + h * k.stride(1);
      // this step's K/V goes to its slot in the paged cache (the truth) and joins the row at
      // its last position; then the row is read
      const T* fresh_k = nkp + i * new_k.stride(0) + h * new_k.stride(1);
      const T* fresh_v = nvp + i * new_v.stride(0) + h * new_v.stride(1);
      const int64_t slot = h * cache_k.stride(0) + slot_of[i] * cache_k.stride(1);
      std::copy_n(fresh_k, dim, ckp + slot);
      std::copy_n(fresh_v, dim, cvp + slot);
      const int64_t last = base + (length - 1) * k.stride(2);
      std::copy_n(fresh_k, dim, kp + last);
      std::copy_n(fresh_v, dim, vp + last);
      scores.resize(group * length);
      attend(qp + i * q.stride(0) + h * q.stride(1), q.stride(2), kp + base, vp + base, at,
             length, scale, scores.data(), op + (i * kv_heads + h) * group * dim);
    }
  });
}

// An index tensor as contiguous int64, held (a conversion may be a new tensor) while read.
struct Longs {
  at::Tensor held;
  const int64_t* at;
  explicit Longs(const at::Tensor& index)
      : held(index.to(at::kLong).contiguous()), at(held.data_ptr<int64_t>()) {}
};

// Runs `body` with a value of the tensors' element type (its type is what `body` uses).
template <typename Body>
void by_dtype(at::ScalarType dtype, const char* op, Body&& body) {
  switch (dtype) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(at::BFloat16{}); break;
    case at::kHalf: body(at::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16, not ", dtype);
  }
}

at::Tensor decode_attention(const at::Tensor& q, at::Tensor& k, at::Tensor& v,
                            const at::Tensor& new_k, const at::Tensor& new_v,
                            const at::Tensor& rows, const at::Tensor& lengths,
                            at::Tensor& cache_k, at::Tensor& cache_v, const at::Tensor& slots,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: [N|R, KV, G|C, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "k and v: one layout");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype &&
                  new_k.scalar_type() == dtype && new_v.scalar_type() == dtype &&
                  cache_k.scalar_type() == dtype && cache_v.scalar_type() == dtype,
              "q, k, v, new_k, new_v, cache_k, cache_v: one dtype");
  TORCH_CHECK(cache_k.dim() == 3 && cache_k.sizes() == cache_v.sizes() &&
                  cache_k.strides() == cache_v.strides(),
              "cache_k, cache_v: one layout, [KV, S, D]");
  const int64_t n = q.size(0), kv_heads = q.size(1), group = q.size(2), dim = q.size(3);
  TORCH_CHECK(k.size(1) == kv_heads && k.size(3) == dim, "k: [R, KV, C, D] matching q");
  TORCH_CHECK(new_k.sizes() == at::IntArrayRef({n, kv_heads, dim}) &&
                  new_v.sizes() == new_k.sizes(),
              "new_k, new_v: [N, KV, D]");
  TORCH_CHECK(cache_k.size(0) == kv_heads && cache_k.size(2) == dim,
              "cache_k: [KV, S, D] matching q");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && new_k.stride(2) == 1 &&
                  new_v.stride(2) == 1 && cache_k.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(supports(group, dim), "decode_attention: no kernel for ", group,
              " query heads per KV head of ", dim);
  TORCH_CHECK(rows.numel() == n && lengths.numel() == n && slots.numel() == n,
              "one row, length and slot per query");
  const Longs rows64(rows), lengths64(lengths), slots64(slots);
  const int64_t *row_of = rows64.at, *length_of = lengths64.at, *slot_of = slots64.at;
  const int64_t capacity = k.size(2), num_rows = k.size(0);
  std::vector<bool> taken(num_rows, false);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < num_rows, "row out of range");
    TORCH_CHECK(!taken[row_of[i]], "a row taken by two queries");
    taken[row_of[i]] = true;
    TORCH_CHECK(length_of[i] >= 1 && length_of[i] <= capacity, "length beyond the row");
    TORCH_CHECK(slot_of[i] >= 0 && slot_of[i] < cache_k.size(1), "slot out of range");
  }
  auto out = at::empty({n, kv_heads, group, dim}, q.options());
  const float fscale = static_cast<float>(scale);
  by_dtype(dtype, "decode_attention", [&](auto type) {
    run<decltype(type)>(q, k, v, new_k, new_v, row_of, length_of, cache_k, cache_v, slot_of,
                        fscale, out);
  });
  return out;
}

template <typename T>
void run_spans(const at::Tensor& q, const at::Tensor& cache_k, const at::Tensor& cache_v,
               const int64_t* tables, int64_t width, const int64_t* span_of,
               const int64_t* length_of, int64_t block_size, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), kv_heads = q.size(1), group = q.size(2), dim = q.size(3);
  const T* qp = q.data_ptr<T>();
  const T* ckp = cache_k.data_ptr<T>();
  const T* cvp = cache_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const AttendFn<T, PagedPositions> attend = pick<T, PagedPositions>(group, dim);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kv_heads, h = item % kv_heads;
      const int64_t length = length_of[i];
      const PagedPositions at{tables + span_of[i] * width, block_size, cache_k.stride(1)};
      scores.resize(group * length);
      attend(qp + i * q.stride(0) + h * q.stride(1), q.stride(2),
             ckp + h * cache_k.stride(0), cvp + h * cache_v.stride(0), at, length, scale,
             scores.data(), op + (i * kv_heads + h) * group * dim);
    }
  });
}

at::Tensor span_attention(const at::Tensor& q, const at::Tensor& cache_k,
                          const at::Tensor& cache_v, const at::Tensor& tables,
                          const at::Tensor& spans, const at::Tensor& lengths, int64_t block_size,
                          double scale) {
  TORCH_CHECK(q.dim() == 4 && cache_k.dim() == 3, "q: [N, KV, G, D]; cache_k: [KV, S, D]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(cache_k.scalar_type() == dtype && cache_v.scalar_type() == dtype,
              "q, cache_k, cache_v: one dtype");
  TORCH_CHECK(cache_k.sizes() == cache_v.sizes() && cache_k.strides() == cache_v.strides(),
              "cache_k, cache_v: one layout, [KV, S, D]");
  const int64_t n = q.size(0), kv_heads = q.size(1), group = q.size(2), dim = q.size(3);
  TORCH_CHECK(cache_k.size(0) == kv_heads && cache_k.size(2) == dim,
              "cache_k: [KV, S, D] matching q");
  TORCH_CHECK(q.stride(3) == 1 && cache_k.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(supports(group, dim), "span_attention: no kernel for ", group,
              " query heads per KV head of ", dim);
  TORCH_CHECK(block_size >= 1 && cache_k.size(1) % block_size == 0,
              "the cache holds whole blocks of block_size");
  TORCH_CHECK(tables.dim() == 2, "tables: [spans, width] block ids");
  TORCH_CHECK(spans.numel() == n && lengths.numel() == n, "one span and length per query");
  const Longs tables64(tables), spans64(spans), lengths64(lengths);
  const int64_t *table = tables64.at, *span_of = spans64.at, *length_of = lengths64.at;
  const int64_t count = tables.size(0), width = tables.size(1);
  const int64_t blocks = cache_k.size(1) / block_size;
  for (int64_t i = 0; i < count * width; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < blocks, "block id out of range");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(span_of[i] >= 0 && span_of[i] < count, "span out of range");
    TORCH_CHECK(length_of[i] >= 1 && length_of[i] <= width * block_size,
                "length beyond the span's blocks");
  }
  auto out = at::empty({n, kv_heads, group, dim}, q.options());
  const float fscale = static_cast<float>(scale);
  by_dtype(dtype, "span_attention", [&](auto type) {
    run_spans<decltype(type)>(q, cache_k, cache_v, table, width, span_of, length_of, block_size,
                              fscale, out);
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(sluice, m) {
  m.def(
      "decode_attention(Tensor q, Tensor(a!) k, Tensor(b!) v, Tensor new_k, Tensor new_v,"
      " Tensor rows, Tensor lengths, Tensor(c!) cache_k, Tensor(d!) cache_v, Tensor slots,"
      " float scale) -> Tensor");
  m.def(
      "span_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor tables, Tensor spans,"
      " Tensor lengths, int block_size, float scale) -> Tensor");
  m.def("decode_attention_supports(int group, int head_dim) -> bool", &supports);
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("span_attention", &span_attention);
}
