// CPU decode attention over paged packed K/V plus a float32 residual, dequantizing on read.
//
// The contract is attention_ref.decode_attention_ref's (layout in layout.py): one work item per
// (request, KV head) serves all query heads of its GQA group, so each packed byte is read once
// per group. A page's keys are dequantized into a D x group tile and its values into a
// group x D tile, both small enough to stay in L1, and folded into a running max / sum /
// accumulator (online softmax, float32). The torch reference makes about ten passes through
// memory over each chunk's float32 K/V; this reads the codes once. A row's arithmetic does not
// depend on the other rows of the batch.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kTile = 32;  // tokens folded at once: a tile's logits fit in four AVX2 registers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 to about 1 ulp (Cephes' expf polynomial), written so that loops over it
// vectorize: std::exp is a scalar libm call, and a draft step takes one per query head and
// token. Below -87 it returns exp(-87) (no denormals); callers zero masked slots themselves.
inline float exp_nonpositive(float x) {
  x = std::min(std::max(x, -87.0f), 0.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The running softmax state of one (request, KV head): G query heads of dim D.
struct GroupState {
  int G, D, stride;
  std::vector<float> m, l, acc, k_tile, v_tile;

  // `tokens`: the most tokens a fold takes (a page's group); the key tile has a zero-padded
  // row of `stride` >= tokens (a multiple of kTile) per channel.
  GroupState(int G_, int D_, int tokens)
      : G(G_), D(D_), stride((std::max(tokens, kTile) + kTile - 1) / kTile * kTile),
        m(G_, kNegInf), l(G_, 0.f), acc(static_cast<size_t>(G_) * D_, 0.f),
        k_tile(static_cast<size_t>(D_) * stride, 0.f),
        v_tile(static_cast<size_t>(stride) * D_, 0.f) {}

  // Fold in `n` tokens whose logits are q . k_tile + bias (k_tile [D][stride], bias [G] or
  // null) and whose values are v_tile [n][D], kTile tokens at a time; with `head_n`, query head
  // g takes only the first head_n[g] of them (a draft row sees the round's tokens up to its own).
  void fold(const float* q, const float* bias, int n, float sm_scale,
            const int32_t* head_n = nullptr) {
    for (int start = 0; start < n; start += kTile) {
      for (int g = 0; g < G; ++g) {
        const int count = std::min(kTile, (head_n == nullptr ? n : head_n[g]) - start);
        if (count > 0) {
          fold_tile(g, q + static_cast<size_t>(g) * D, bias == nullptr ? 0.f : bias[g], start,
                    count, sm_scale);
        }
      }
    }
  }

  void fold_tile(int g, const float* qg, float bias, int start, int count, float sm_scale) {
    float lg[kTile];
    for (int t = 0; t < kTile; ++t) lg[t] = bias;
    for (int d = 0; d < D; ++d) {
      const float qd = qg[d];
      const float* kd = k_tile.data() + static_cast<size_t>(d) * stride + start;
      for (int t = 0; t < kTile; ++t) lg[t] += qd * kd[t];
    }
    float mx = kNegInf;
    for (int t = 0; t < count; ++t) mx = std::max(mx, lg[t] * sm_scale);
    const float m_new = std::max(m[g], mx);
    const float alpha = std::exp(m[g] - m_new);
    float sum = 0.f;
    for (int t = 0; t < kTile; ++t) lg[t] = exp_nonpositive(lg[t] * sm_scale - m_new);
    for (int t = count; t < kTile; ++t) lg[t] = 0.f;
    for (int t = 0; t < kTile; ++t) sum += lg[t];
    l[g] = l[g] * alpha + sum;
    m[g] = m_new;
    float* ag = acc.data() + static_cast<size_t>(g) * D;
    int d0 = 0;
    for (; d0 + kTile <= D; d0 += kTile) {  // kTile channels of the accumulator in registers
      float a[kTile];
      for (int i = 0; i < kTile; ++i) a[i] = ag[d0 + i] * alpha;
      for (int t = 0; t < count; ++t) {
        const float p = lg[t];
        const float* vt = v_tile.data() + static_cast<size_t>(start + t) * D + d0;
        for (int i = 0; i < kTile; ++i) a[i] += p * vt[i];
      }
      for (int i = 0; i < kTile; ++i) ag[d0 + i] = a[i];
    }
    for (int d = d0; d < D; ++d) {
      float a = ag[d] * alpha;
      for (int t = 0; t < count; ++t) a += lg[t] * v_tile[static_cast<size_t>(start + t) * D + d];
      ag[d] = a;
    }
  }

  // out [G, D] = acc / l and lse [G] = m + log(l); a group that saw no token gets 0 and -inf.
  void write(float* out, float* lse) const {
    for (int g = 0; g < G; ++g) {
      const float denom = std::max(l[g], 1.f);
      for (int d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] / denom;
      lse[g] = m[g] + std::log(l[g]);
    }
  }
};

// The packed part of a layer, as PagedKV holds it (pointers into contiguous tensors).
struct Pages {
  const uint8_t* k_codes = nullptr;  // [P, H, D, group / per_byte]
  const at::Half* k_scale = nullptr;  // [P, H, D]
  const at::Half* k_zero = nullptr;
  const uint8_t* v_codes = nullptr;  // [P, group, H, D / per_byte]
  const at::Half* v_scale = nullptr;  // [P, group, H, D / v_group]
  const at::Half* v_zero = nullptr;
  const int32_t* table = nullptr;  // [B, max_pages]
  const int32_t* lengths = nullptr;  // [B]
  int max_pages = 0, group = 0, v_group = 0;
};

// Codes of one packed row as floats: out[i] = code i, for `width` bytes.
template <int BITS>
inline void unpack(const uint8_t* codes, int width, float* out) {
  constexpr int per_byte = 8 / BITS;
  constexpr int mask = (1 << BITS) - 1;
  for (int j = 0; j < width; ++j) {
    const int byte = codes[j];
    for (int lane = 0; lane < per_byte; ++lane) {
      out[j * per_byte + lane] = static_cast<float>((byte >> (lane * BITS)) & mask);
    }
  }
}

template <int BITS>
void fold_pages(GroupState& st, const Pages& pg, const float* q, int b, int h, int H,
                float sm_scale) {
  constexpr int per_byte = 8 / BITS;
  const int D = st.D, G = st.G, group = pg.group;
  const int k_width = group / per_byte, v_width = D / per_byte, v_groups = D / pg.v_group;
  const int n_pages = pg.lengths[b] / group;
  std::vector<float> scaled_q(static_cast<size_t>(G) * D), bias(G);
  for (int i = 0; i < n_pages; ++i) {
    const int64_t page = pg.table[static_cast<int64_t>(b) * pg.max_pages + i];
    // Keys are code * scale + zero per channel, so q . k = (q * scale) . code + q . zero:
    // the tile holds the raw codes and the queries take the page's scales.
    const int64_t k_row = (page * H + h) * D;
    for (int d = 0; d < D; ++d) {
      unpack<BITS>(pg.k_codes + (k_row + d) * k_width, k_width,
                   st.k_tile.data() + static_cast<size_t>(d) * st.stride);
    }
    for (int g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int d = 0; d < D; ++d) {
        const float qd = q[g * D + d];
        scaled_q[g * D + d] = qd * static_cast<float>(pg.k_scale[k_row + d]);
        dot += qd * static_cast<float>(pg.k_zero[k_row + d]);
      }
      bias[g] = dot;
    }
    // Values are quantized per token over groups of v_group channels.
    for (int t = 0; t < group; ++t) {
      const int64_t v_row = (page * group + t) * H + h;
      float* vt = st.v_tile.data() + static_cast<size_t>(t) * D;
      unpack<BITS>(pg.v_codes + v_row * v_width, v_width, vt);
      const at::Half* vs = pg.v_scale + v_row * v_groups;
      const at::Half* vz = pg.v_zero + v_row * v_groups;
      for (int j = 0; j < v_groups; ++j) {
        const float s = static_cast<float>(vs[j]), z = static_cast<float>(vz[j]);
        float* part = vt + j * pg.v_group;
        for (int d = 0; d < pg.v_group; ++d) part[d] = part[d] * s + z;
      }
    }
    st.fold(scaled_q.data(), bias.data(), group, sm_scale);
  }
}

// Fold in float32 tokens [B, R, H, D] of request b: the first `length` of them, or per query
// head g the first head_lengths[g].
void fold_exact(GroupState& st, const float* k, const float* v, int length, int R, int H, int b,
                int h, const float* q, float sm_scale, const int32_t* head_lengths = nullptr) {
  const int D = st.D;
  if (head_lengths != nullptr) {
    length = *std::max_element(head_lengths, head_lengths + st.G);
  }
  std::vector<int32_t> counts(head_lengths == nullptr ? 0 : st.G);
  for (int start = 0; start < length; start += kTile) {
    const int n = std::min(kTile, length - start);
    for (int t = 0; t < n; ++t) {
      const int64_t row = ((static_cast<int64_t>(b) * R + start + t) * H + h) * D;
      for (int d = 0; d < D; ++d) {
        st.k_tile[static_cast<size_t>(d) * st.stride + t] = k[row + d];
        st.v_tile[static_cast<size_t>(t) * D + d] = v[row + d];
      }
    }
    if (head_lengths == nullptr) {
      st.fold(q, nullptr, n, sm_scale);
    } else {
      for (int g = 0; g < st.G; ++g) counts[g] = head_lengths[g] - start;
      st.fold(q, nullptr, n, sm_scale, counts.data());
    }
  }
}

// q [B, Hq, D], k_res / v_res [B, R, H, D] float32; pages: k_codes, k_scale, k_zero, v_codes,
// v_scale, v_zero, page_table, lengths (or an empty list); tail: tail_k, tail_v [B, T, H, D]
// float32 and tail_lengths [B, Hq] int32, tokens after the residual seen per query head (or an
// empty list). Returns (out [B, Hq, D], lse [B, Hq]).
std::vector<at::Tensor> decode_attention(const at::Tensor& q, const std::vector<at::Tensor>& pages,
                                         int64_t bits, int64_t group, int64_t v_group,
                                         const at::Tensor& k_res, const at::Tensor& v_res,
                                         const at::Tensor& res_lengths, double sm_scale,
                                         const std::vector<at::Tensor>& tail) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [B, Hq, D] tensor");
  TORCH_CHECK(k_res.scalar_type() == at::kFloat && v_res.scalar_type() == at::kFloat &&
                  k_res.is_contiguous() && v_res.is_contiguous() && k_res.dim() == 4,
              "k_res and v_res must be contiguous float32 [B, R, H, D] tensors");
  TORCH_CHECK(res_lengths.scalar_type() == at::kInt, "res_lengths must be int32");
  const int B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int R = k_res.size(1), H = k_res.size(2);
  TORCH_CHECK(Hq % H == 0 && k_res.size(3) == D, "query heads must be a multiple of KV heads");
  Pages pg;
  if (!pages.empty()) {
    TORCH_CHECK(pages.size() == 8, "pages: expected 8 tensors");
    for (const auto& t : pages) TORCH_CHECK(t.is_contiguous(), "page tensors must be contiguous");
    TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
    pg.k_codes = pages[0].data_ptr<uint8_t>();
    pg.k_scale = pages[1].data_ptr<at::Half>();
    pg.k_zero = pages[2].data_ptr<at::Half>();
    pg.v_codes = pages[3].data_ptr<uint8_t>();
    pg.v_scale = pages[4].data_ptr<at::Half>();
    pg.v_zero = pages[5].data_ptr<at::Half>();
    pg.table = pages[6].data_ptr<int32_t>();
    pg.lengths = pages[7].data_ptr<int32_t>();
    pg.max_pages = pages[6].size(1);
    pg.group = static_cast<int>(group);
    pg.v_group = static_cast<int>(v_group);
  }
  const float *tkp = nullptr, *tvp = nullptr;
  const int32_t* tail_len = nullptr;
  int T = 0;
  if (!tail.empty()) {
    TORCH_CHECK(tail.size() == 3, "tail: expected tail_k, tail_v, tail_lengths");
    TORCH_CHECK(tail[0].scalar_type() == at::kFloat && tail[1].scalar_type() == at::kFloat &&
                    tail[0].is_contiguous() && tail[1].is_contiguous() &&
                    tail[0].dim() == 4 && tail[0].size(0) == B && tail[0].size(2) == H &&
                    tail[0].size(3) == D,
                "tail_k and tail_v must be contiguous float32 [B, T, H, D] tensors");
    TORCH_CHECK(tail[2].scalar_type() == at::kInt && tail[2].is_contiguous() &&
                    tail[2].size(0) == B && tail[2].size(1) == Hq,
                "tail_lengths must be a contiguous int32 [B, Hq] tensor");
    tkp = tail[0].data_ptr<float>();
    tvp = tail[1].data_ptr<float>();
    tail_len = tail[2].data_ptr<int32_t>();
    T = tail[0].size(1);
  }
  auto out = at::empty({B, Hq, D}, q.options());
  auto lse = at::empty({B, Hq}, q.options());
  const int G = Hq / H;
  const int tokens = pages.empty() ? kTile : static_cast<int>(group);
  const float scale = static_cast<float>(sm_scale);
  const float* qp = q.data_ptr<float>();
  const float* krp = k_res.data_ptr<float>();
  const float* vrp = v_res.data_ptr<float>();
  const int32_t* res_len = res_lengths.data_ptr<int32_t>();
  float* outp = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(B) * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int b = item / H, h = item % H;
      const int64_t head0 = static_cast<int64_t>(b) * Hq + static_cast<int64_t>(h) * G;
      const float* qg = qp + head0 * D;
      GroupState st(G, D, tokens);
      if (pg.k_codes != nullptr) {
        switch (bits) {
          case 2: fold_pages<2>(st, pg, qg, b, h, H, scale); break;
          case 4: fold_pages<4>(st, pg, qg, b, h, H, scale); break;
          default: fold_pages<8>(st, pg, qg, b, h, H, scale); break;
        }
      }
      fold_exact(st, krp, vrp, res_len[b], R, H, b, h, qg, scale);
      if (tkp != nullptr) fold_exact(st, tkp, tvp, 0, T, H, b, h, qg, scale, tail_len + head0);
      st.write(outp + head0 * D, lsep + head0);
    }
  });
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "Decode attention over paged packed K/V, a float32 residual and a per-head tail (CPU)");
}
