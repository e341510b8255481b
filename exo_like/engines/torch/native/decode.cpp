// A stage's decode step in one call: every layer of a Llama-family or Gemma 3 shard (RMSNorm, fused q/k/v with
// optional biases and per-head q/k norms, rotary embedding from the engine's tables, the new keys and values
// written to the pool, attention over each row's slots or its sliding window, output projection, a SwiGLU or
// GELU-tanh gated MLP, Gemma's sandwich norms, residuals), float32 activations. The same arithmetic as the Python layers (model.py), with no Python and
// no per-op dispatch between the kernels: the norms, the rotation and the residuals round as transformers'
// float32 ops do (built with -ffp-contract=off); the products and the attention sum in another order.
// Products run on the native quantized kernel (quant.cpp) or, for float32 weights, a matrix-vector kernel here.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "quant.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EXO_X86 1
#endif

namespace exo {

// The batch-invariant products (a row's result the same in any batch): quant.cpp's integer kernel, rows.cpp's.
// (quant.h: quant_rows_matmul, quant_rows_matmuls)
at::Tensor rows_matmul(const at::Tensor& x, const at::Tensor& w);
bool native_avx2();  // quant.cpp: AVX2 code, or the portable code

namespace {

#ifdef EXO_X86
bool avx2() { return exo::native_avx2(); }  // quant.cpp

__attribute__((target("avx2,fma"))) float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  float total = hsum8(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float p, const float* v, float* out, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (; i < n; ++i) out[i] += p * v[i];
}
#endif

float dot(const float* a, const float* b, int64_t n) {
#ifdef EXO_X86
  if (avx2()) return dot_avx2(a, b, n);
#endif
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

void axpy(float p, const float* v, float* out, int64_t n) {
#ifdef EXO_X86
  if (avx2()) return axpy_avx2(p, v, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] += p * v[i];
}

#ifdef EXO_X86
// Outputs [c, c + 8V) of weighted_sum, kept in registers across the slots.
template <int V>
__attribute__((target("avx2,fma"))) void weighted_chunk_avx2(const float* weights, const float* values,
                                                             const int64_t* slots, int64_t count, int64_t dim,
                                                             int64_t c, float* out) {
  __m256 acc[V];
  for (int v = 0; v < V; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const __m256 p = _mm256_set1_ps(weights[j]);
    const float* row = values + slots[j] * dim + c;
    for (int v = 0; v < V; ++v) acc[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(row + 8 * v), acc[v]);
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + c + 8 * v, acc[v]);
}
#endif

// out = sum over j of weights[j] * values[slots[j]] (rows of `dim`), in increasing j: each element summed as axpy
// sums it from zero. With AVX2, up to 64 outputs stay in registers across the slots instead of being loaded and
// stored once a slot (the same fused multiply-adds in the same order).
void weighted_sum(const float* weights, const float* values, const int64_t* slots, int64_t count, int64_t dim,
                  float* out) {
#ifdef EXO_X86
  if (avx2() && dim % 8 == 0) {
    for (int64_t c = 0; c < dim; c += 64) {
      switch (std::min<int64_t>(64, dim - c) / 8) {
        case 1: weighted_chunk_avx2<1>(weights, values, slots, count, dim, c, out); break;
        case 2: weighted_chunk_avx2<2>(weights, values, slots, count, dim, c, out); break;
        case 3: weighted_chunk_avx2<3>(weights, values, slots, count, dim, c, out); break;
        case 4: weighted_chunk_avx2<4>(weights, values, slots, count, dim, c, out); break;
        case 5: weighted_chunk_avx2<5>(weights, values, slots, count, dim, c, out); break;
        case 6: weighted_chunk_avx2<6>(weights, values, slots, count, dim, c, out); break;
        case 7: weighted_chunk_avx2<7>(weights, values, slots, count, dim, c, out); break;
        default: weighted_chunk_avx2<8>(weights, values, slots, count, dim, c, out); break;
      }
    }
    return;
  }
#endif
  std::fill(out, out + dim, 0.0f);
  for (int64_t j = 0; j < count; ++j) axpy(weights[j], values + slots[j] * dim, out, dim);
}

// A projection: a natively packed quantized matrix, or a plain weight [out, in] (float32, or bfloat16 / float16
// widened as it is read), and an optional bias.
struct Projection {
  bool native = false;
  PackedMatrix packed;  // native
  at::Tensor weight;    // plain
  std::optional<at::Tensor> bias;

  std::vector<Projection> parts;  // a projection stacked from matrices of several types: outputs side by side

  at::Tensor apply(const at::Tensor& x) const {
    at::Tensor out;
    if (!parts.empty()) {
      std::vector<at::Tensor> outputs;
      for (const Projection& part : parts) outputs.push_back(part.apply(x));
      out = at::cat(outputs, 1);
    } else if (native) {
      out = quant_rows_matmul(x, packed);
    } else {
      out = rows_matmul(x, weight);
    }
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
};

Projection native_projection(at::Tensor low, at::Tensor high, at::Tensor scales, at::Tensor biases,
                             at::Tensor super_scales, at::Tensor super_biases, int64_t layout, double zero,
                             int64_t group, std::optional<at::Tensor> bias) {
  Projection p;
  p.native = true;
  p.packed = PackedMatrix{low, high, scales, biases, super_scales, super_biases, layout, group, zero};
  p.bias = bias;
  return p;
}

Projection stacked_projection(std::vector<Projection> parts, std::optional<at::Tensor> bias) {
  TORCH_CHECK(!parts.empty(), "a stacked projection needs parts");
  Projection p;
  p.parts = std::move(parts);
  p.bias = bias;
  return p;
}

Projection dense_projection(at::Tensor weight, std::optional<at::Tensor> bias) {
  const auto type = weight.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) && weight.is_contiguous() &&
                  weight.layout() == at::kStrided,
              "a dense projection takes a plain contiguous float32, bfloat16 or float16 weight");
  Projection p;
  p.weight = weight, p.bias = bias;
  return p;
}

// act(gate) * up of each row of a fused gate-and-up output (gate columns, then up columns), act silu or (`gelu`)
// GELU's tanh form: ATen's own vectorized ops on the same views as the Python layers' (mlp.py), so the same values
// (a scalar std::exp a value was 5-10 % of a step).
at::Tensor gated(const at::Tensor& both, bool gelu = false) {
  const int64_t inner = both.size(1) / 2;
  const at::Tensor gate = both.narrow(1, 0, inner);
  return (gelu ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(both.narrow(1, inner, inner)).contiguous();
}

// down(act(gate) * up) of each row, gate and up from one fused projection (gate rows, then up rows).
at::Tensor glu(const Projection& gate_up, const Projection& down, const at::Tensor& x, bool gelu = false) {
  return down.apply(gated(gate_up.apply(x).contiguous(), gelu));
}

// Whether a projection is one natively packed matrix without a bias (quant_rows_matmuls takes it).
bool plain_native(const Projection& p) { return p.native && p.parts.empty() && !p.bias.has_value(); }

// A mixture of experts' MLP routed as Qwen's and Mixtral's are: a float32 softmax over every expert's router
// logit, each row's top k (renormalised to sum to one where the family does, then times `scale`), the chosen
// experts' SwiGLU MLPs summed expert by expert in ascending order, as the Python layers sum them (mlp.py); an
// optional shared expert, scaled by a sigmoid gate where it has one (Qwen2-MoE).
struct Mixture {
  Projection router;
  std::vector<Projection> gate_ups, downs;
  int64_t top_k = 0;
  bool renormalize = false;
  double scale = 1.0;
  std::optional<Projection> shared_gate_up, shared_down, shared_gate;

  at::Tensor apply(const at::Tensor& x) const {
    const int64_t rows = x.size(0), hidden = x.size(1), experts = static_cast<int64_t>(gate_ups.size());
    const at::Tensor logits = router.apply(x).contiguous();
    std::vector<std::vector<std::pair<int64_t, float>>> chosen(experts);  // per expert: (row, weight)
    for (int64_t r = 0; r < rows; ++r) route(logits.data_ptr<float>() + r * experts, r, chosen);
    std::vector<int64_t> used;  // the experts some row chose, ascending
    std::vector<at::Tensor> picked;
    for (int64_t e = 0; e < experts; ++e) {
      if (chosen[e].empty()) continue;
      std::vector<int64_t> ids;
      for (const auto& entry : chosen[e]) ids.push_back(entry.first);
      used.push_back(e);
      picked.push_back(x.index_select(0, at::tensor(ids, at::kLong)));
    }
    const std::vector<at::Tensor> ys = expert_outputs(used, picked);
    at::Tensor out = at::zeros_like(x);
    float* o = out.data_ptr<float>();
    for (size_t j = 0; j < used.size(); ++j) {
      const auto& rows_weights = chosen[used[j]];
      const at::Tensor y = ys[j].contiguous();
      const float* yv = y.data_ptr<float>();
      for (size_t k = 0; k < rows_weights.size(); ++k) {
        const float weight = rows_weights[k].second;
        const int64_t row = rows_weights[k].first;
        for (int64_t i = 0; i < hidden; ++i) o[row * hidden + i] += yv[k * hidden + i] * weight;
      }
    }
    if (shared_gate_up.has_value()) {
      at::Tensor shared = glu(*shared_gate_up, *shared_down, x).contiguous();
      if (shared_gate.has_value()) gate_rows(shared_gate->apply(x).contiguous(), shared);
      out = out + shared;
    }
    return out;
  }

  // Each used expert's SwiGLU MLP on its rows. Where every one is a packed quantized matrix, all experts' gate-and-up
  // products run in one parallel region and all their down products in another (a region per expert's product
  // left the threads waiting on each other between small products); the results are the same either way.
  std::vector<at::Tensor> expert_outputs(const std::vector<int64_t>& used, const std::vector<at::Tensor>& picked) const {
    bool together = true;
    for (int64_t e : used) together = together && plain_native(gate_ups[e]) && plain_native(downs[e]);
    std::vector<at::Tensor> ys;
    if (!together) {
      for (size_t j = 0; j < used.size(); ++j) ys.push_back(glu(gate_ups[used[j]], downs[used[j]], picked[j]));
      return ys;
    }
    std::vector<const PackedMatrix*> first, second;
    for (int64_t e : used) {
      first.push_back(&gate_ups[e].packed);
      second.push_back(&downs[e].packed);
    }
    std::vector<at::Tensor> inner;
    for (const at::Tensor& both : quant_rows_matmuls(picked, first)) inner.push_back(gated(both));
    return quant_rows_matmuls(inner, second);
  }

  // shared[r] *= sigmoid(gate[r]) row by row, one scalar formula for every element (ATen's sigmoid takes another
  // formula for the elements past its vectors' width, so a row's value would depend on the batch's size).
  static void gate_rows(const at::Tensor& gate, at::Tensor& shared) {
    const int64_t rows = shared.size(0), width = shared.size(1);
    const float* g = gate.data_ptr<float>();
    float* s = shared.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float sigmoid = 1.0f / (1.0f + std::exp(-g[r]));
      for (int64_t i = 0; i < width; ++i) s[r * width + i] = sigmoid * s[r * width + i];
    }
  }

  // Row r's experts and weights, from its router logits.
  void route(const float* logit, int64_t r, std::vector<std::vector<std::pair<int64_t, float>>>& chosen) const {
    const int64_t experts = static_cast<int64_t>(gate_ups.size());
    std::vector<float> probs(logit, logit + experts);
    const float highest = *std::max_element(probs.begin(), probs.end());
    float total = 0.0f;
    for (float& p : probs) total += (p = std::exp(p - highest));
    for (float& p : probs) p /= total;
    std::vector<int64_t> order(experts);
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += probs[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      float weight = renormalize ? probs[order[j]] / sum : probs[order[j]];
      if (scale != 1.0) weight *= static_cast<float>(scale);
      chosen[order[j]].push_back({r, weight});
    }
  }
};

// Where a step's rows read and write keys: each row's write slot, and row r attends to
// slots[firsts[r] : firsts[r] + counts[r]] (its own new one included). One for the layers attending to every
// position, one for the sliding-window layers (their own pool, their own slots).
struct SlotView {
  at::Tensor write_slots, firsts, counts, slots;
};

struct Layer {
  at::Tensor input_norm, post_norm;  // post_norm: the MLP's input norm, or with sandwich norms the attention's output
  std::optional<at::Tensor> q_norm, k_norm;
  Projection qkv, o;
  std::optional<Projection> gate_up, down;  // a dense MLP's, or
  std::optional<Mixture> mixture;           // a mixture of experts
  std::optional<at::Tensor> pre_mlp_norm, post_mlp_norm;  // Gemma's sandwich norms
  int64_t rope = 0, view = 0;  // which rotary table (Gemma 3's local layers have their own) and which SlotView
  at::Tensor keys, values;  // [kv_heads, slots, head_dim]
};

// x * rsqrt(mean(x^2) + eps) * w per row, in transformers' float32 order: the mean of squares first, then the
// normalised value, then the weight. `width` values per row, rows of `stride`.
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t width, int64_t stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * stride;
    double sum = 0.0;  // ATen reduces in float32 with its own order; the result differs in the last bit at most
    for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(v[i]) * v[i];
    const float inverse = 1.0f / std::sqrt(static_cast<float>(sum / width) + eps);
    for (int64_t i = 0; i < width; ++i) out[r * stride + i] = w[i] * (v[i] * inverse);
  }
}

// rms_norm over many rows, split between the threads (each row computed as alone).
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    rms_norm(x + begin * width, w, out + begin * width, end - begin, width, width, eps);
  });
}

class DecodeStack {
 public:
  // gelu: the dense MLPs gate by GELU's tanh form (Gemma), else by SiLU.
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, bool gelu)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), gelu_(gelu) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, Projection qkv, Projection o, std::optional<Projection> gate_up,
                 std::optional<Projection> down, std::optional<at::Tensor> pre_mlp_norm,
                 std::optional<at::Tensor> post_mlp_norm, int64_t rope, int64_t view) {
    TORCH_CHECK(pre_mlp_norm.has_value() == post_mlp_norm.has_value(), "sandwich norms come in pairs");
    TORCH_CHECK(rope >= 0 && view >= 0, "a layer's rotary table and slot view are indices");
    layers_.push_back(Layer{input_norm, post_norm, q_norm, k_norm, qkv, o, gate_up, down, std::nullopt,
                            pre_mlp_norm, post_mlp_norm, rope, view, {}, {}});
  }

  // The last layer added has a mixture of experts for its MLP.
  void set_mixture(Projection router, std::vector<Projection> gate_ups, std::vector<Projection> downs, int64_t top_k,
                   bool renormalize, double scale, std::optional<Projection> shared_gate_up,
                   std::optional<Projection> shared_down, std::optional<Projection> shared_gate) {
    TORCH_CHECK(!layers_.empty() && gate_ups.size() == downs.size() && top_k > 0 &&
                    top_k <= static_cast<int64_t>(gate_ups.size()),
                "a mixture needs a layer, and as many gate/up as down projections, at least top_k");
    layers_.back().mixture = Mixture{router, std::move(gate_ups), std::move(downs), top_k, renormalize, scale,
                                     shared_gate_up, shared_down, shared_gate};
  }

  // The last shard's final norm and LM head, for `head`.
  void set_head(at::Tensor norm, Projection projection) {
    head_norm_ = norm;
    head_ = std::move(projection);
  }

  void set_pool(int64_t layer, at::Tensor keys, at::Tensor values) {
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == at::kFloat,
                "the pool must be contiguous float32");
    layers_.at(layer).keys = keys;
    layers_.at(layer).values = values;
  }

  // h [rows, hidden] float32; cos[i]/sin[i] [rows, head_dim] rotary table i (sin carrying rotate-half's sign);
  // views[i]: the rows' slots in the layers of view i (SlotView; the rows of a prompt chunk share their request's
  // slots, each up to its own position). Returns the new h.
  at::Tensor step(at::Tensor h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                  const std::vector<std::vector<at::Tensor>>& views) {
    h = h.contiguous().clone();
    const int64_t rows = h.size(0);
    TORCH_CHECK(cos.size() == sin.size(), "a rotary table is a cos and a sin");
    std::vector<at::Tensor> cc, sc;
    for (size_t i = 0; i < cos.size(); ++i) {
      cc.push_back(cos[i].contiguous());
      sc.push_back(sin[i].contiguous());
      TORCH_CHECK(cc[i].numel() == rows * head_dim_ && sc[i].numel() == rows * head_dim_,
                  "a rotary table needs head_dim values a row");
    }
    std::vector<SlotView> checked;
    for (const auto& view : views) checked.push_back(slot_view(view, rows));
    for (const Layer& layer : layers_) {
      TORCH_CHECK(layer.rope < static_cast<int64_t>(cc.size()) && layer.view < static_cast<int64_t>(checked.size()),
                  "a layer's rotary table or slot view was not given");
      run_layer(layer, h, cc[layer.rope], sc[layer.rope], checked[layer.view]);
    }
    return h;
  }

  // The logits of h's rows `sampled` [S]: final norm, then the LM head. Returns [S, vocab].
  at::Tensor head(const at::Tensor& h, const at::Tensor& sampled) const {
    TORCH_CHECK(head_.has_value(), "this stack has no LM head");
    const at::Tensor rows = h.contiguous().index_select(0, sampled);
    at::Tensor normed = at::empty_like(rows);
    rms_norm_rows(rows.data_ptr<float>(), head_norm_.data_ptr<float>(), normed.data_ptr<float>(), rows.size(0),
                  rows.size(1), eps_);
    return head_->apply(normed);
  }

 private:
  // (write slots, firsts, counts, slots) as one SlotView, each row's slots checked to lie within the list.
  static SlotView slot_view(const std::vector<at::Tensor>& parts, int64_t rows) {
    TORCH_CHECK(parts.size() == 4, "a slot view is write slots, firsts, counts and slots");
    SlotView view{parts[0].contiguous(), parts[1].contiguous(), parts[2].contiguous(), parts[3].contiguous()};
    TORCH_CHECK(view.firsts.numel() == rows && view.counts.numel() == rows && view.write_slots.numel() == rows,
                "a step needs a write slot, a first slot and a count per row");
    const int64_t* fs = view.firsts.data_ptr<int64_t>();
    const int64_t* cs = view.counts.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(fs[r] >= 0 && cs[r] > 0 && fs[r] + cs[r] <= view.slots.numel(), "a row's slots lie outside the list");
    }
    return view;
  }

  void run_layer(const Layer& layer, at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                 const SlotView& view) const {
    const int64_t rows = h.size(0), hidden = h.size(1), dim = head_dim_;
    at::Tensor normed = at::empty_like(h);
    rms_norm_rows(h.data_ptr<float>(), layer.input_norm.data_ptr<float>(), normed.data_ptr<float>(), rows, hidden, eps_);
    at::Tensor qkv = layer.qkv.apply(normed);  // [rows, (heads + 2 kv heads) * dim]
    const int64_t width = qkv.size(1);
    float* q = qkv.data_ptr<float>();
    if (layer.q_norm.has_value()) {
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          float* base = q + r * width;
          rms_norm(base, layer.q_norm->data_ptr<float>(), base, heads_, dim, dim, eps_);
          rms_norm(base + heads_ * dim, layer.k_norm->data_ptr<float>(), base + heads_ * dim, kv_heads_, dim, dim,
                   eps_);
        }
      });
    }
    rotate(q, cos.data_ptr<float>(), sin.data_ptr<float>(), rows, width);
    write_pool(layer, q, view.write_slots.data_ptr<int64_t>(), rows, width);
    at::Tensor attended = at::empty({rows, heads_ * dim}, h.options());
    attend(layer, q, width, attended.data_ptr<float>(), view.firsts.data_ptr<int64_t>(),
           view.counts.data_ptr<int64_t>(), view.slots.data_ptr<int64_t>(), rows);
    at::Tensor out = layer.o.apply(attended).contiguous();
    if (!layer.pre_mlp_norm.has_value()) {
      h.add_(out);
      rms_norm_rows(h.data_ptr<float>(), layer.post_norm.data_ptr<float>(), normed.data_ptr<float>(), rows, hidden,
                    eps_);
      h.add_(mlp(layer, normed));
      return;
    }
    // Sandwich norms (Gemma): h + norm(attention), then h + norm(mlp(norm(h))). (In place: a row's sum of squares
    // is taken before any of its values is written.)
    rms_norm_rows(out.data_ptr<float>(), layer.post_norm.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, eps_);
    h.add_(out);
    rms_norm_rows(h.data_ptr<float>(), layer.pre_mlp_norm->data_ptr<float>(), normed.data_ptr<float>(), rows, hidden,
                  eps_);
    at::Tensor mlp_out = mlp(layer, normed).contiguous();
    rms_norm_rows(mlp_out.data_ptr<float>(), layer.post_mlp_norm->data_ptr<float>(), mlp_out.data_ptr<float>(), rows,
                  hidden, eps_);
    h.add_(mlp_out);
  }

  at::Tensor mlp(const Layer& layer, const at::Tensor& normed) const {
    return layer.mixture.has_value() ? layer.mixture->apply(normed) : glu(*layer.gate_up, *layer.down, normed, gelu_);
  }

  // x * cos + swap_halves(x) * sin on every query and key head, in place.
  void rotate(float* qkv, const float* cos, const float* sin, int64_t rows, int64_t width) const {
    const int64_t dim = head_dim_, half = dim / 2;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> head(dim);
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t hd = 0; hd < heads_ + kv_heads_; ++hd) {
          float* x = qkv + r * width + hd * dim;
          std::copy(x, x + dim, head.begin());
          for (int64_t i = 0; i < dim; ++i) {
            const float a = head[i] * cos[r * dim + i];
            const float b = head[(i + half) % dim] * sin[r * dim + i];
            x[i] = a + b;
          }
        }
      }
    });
  }

  void write_pool(const Layer& layer, const float* qkv, const int64_t* write_slots, int64_t rows, int64_t width) const {
    const int64_t dim = head_dim_, slots = layer.keys.size(1);
    float* keys = layer.keys.data_ptr<float>();
    float* values = layer.values.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = write_slots[r];
      TORCH_CHECK(slot >= 0 && slot < slots, "a write slot lies outside the pool");
      for (int64_t kh = 0; kh < kv_heads_; ++kh) {
        const float* k = qkv + r * width + (heads_ + kh) * dim;
        const float* v = qkv + r * width + (heads_ + kv_heads_ + kh) * dim;
        std::copy(k, k + dim, keys + (kh * slots + slot) * dim);
        std::copy(v, v + dim, values + (kh * slots + slot) * dim);
      }
    }
  }

  // Each row's query heads against its slots: softmax(q k * scale) v, float32, one task per (row, head).
  void attend(const Layer& layer, const float* qkv, int64_t width, float* out, const int64_t* firsts,
              const int64_t* counts, const int64_t* slots, int64_t rows) const {
    const int64_t dim = head_dim_, group = heads_ / kv_heads_, pool_slots = layer.keys.size(1);
    const float* keys = layer.keys.data_ptr<float>();
    const float* values = layer.values.data_ptr<float>();
    const float scale = static_cast<float>(scale_);
    // Tasks head-major: a prompt's late rows see more slots than its early ones, so each thread's share of the
    // tasks takes every row of its heads.
    at::parallel_for(0, rows * heads_, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task % rows, hd = task / rows, kh = hd / group;
        const int64_t first = firsts[r], count = counts[r];
        const float* q = qkv + r * width + hd * dim;
        scores.resize(count);
        float highest = -INFINITY;
        for (int64_t j = 0; j < count; ++j) {
          const int64_t slot = slots[first + j];
          scores[j] = dot(q, keys + (kh * pool_slots + slot) * dim, dim) * scale;
          highest = std::max(highest, scores[j]);
        }
        float total = 0.0f;
        for (int64_t j = 0; j < count; ++j) {
          scores[j] = std::exp(scores[j] - highest);
          total += scores[j];
        }
        for (int64_t j = 0; j < count; ++j) scores[j] /= total;
        weighted_sum(scores.data(), values + kh * pool_slots * dim, slots + first, count, dim,
                     out + r * heads_ * dim + hd * dim);
      }
    });
  }

  int64_t heads_, kv_heads_, head_dim_;
  float eps_;
  double scale_;
  bool gelu_;
  std::vector<Layer> layers_;
  at::Tensor head_norm_;
  std::optional<Projection> head_;
};

}  // namespace

void register_decode(pybind11::module& module) {
  pybind11::class_<Projection>(module, "Projection");
  module.def("native_projection", &native_projection);
  module.def("dense_projection", &dense_projection);
  module.def("stacked_projection", &stacked_projection);
  pybind11::class_<DecodeStack>(module, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, bool>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_mixture", &DecodeStack::set_mixture)
      .def("set_head", &DecodeStack::set_head)
      .def("set_pool", &DecodeStack::set_pool)
      .def("step", &DecodeStack::step)
      .def("head", &DecodeStack::head);
}

}  // namespace exo
