// src/schemes/rope_term.h - RoPE in attention (docs/rope.md): q and k rotated by their positions
// before the dot product; dims [offset, offset + rotary_dim) of each head rotate (DeepSeek's
// decoupled RoPE: offset qk_nope_head_dim). No learned parameter: dq and dk are rotated back. The
// simple paths read rotated copies; the fused kernels rotate rows as they load them. The
// interface: schemes/term.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/rope_kernels.h"
#include "schemes/term.h"

namespace posenc::attn {

template <class T>
struct RopeTerm : NoTerm<T> {
  const Rope* rope = nullptr;

  void prepare(const Rope& r, TermInputs<T>& in) {
    const Dims& d = in.d;
    const auto& f = r.freqs;
    if (f.inv_freq.empty()) fail("attention: rope: freqs.inv_freq is empty");
    if (r.offset < 0 || r.offset > d.head_dim) {
      fail("attention: rope: offset (" + std::to_string(r.offset) + ") must lie in [0, head_dim " +
           std::to_string(d.head_dim) + "]");
    }
    if (r.offset + f.rotary_dim() > d.head_dim) {
      fail<ShapeError>("attention: rope: rotary_dim (" + std::to_string(f.rotary_dim()) + ")" +
                       (r.offset > 0 ? " from offset " + std::to_string(r.offset) : "") +
                       " exceeds head_dim (" + std::to_string(d.head_dim) + ")");
    }
    for (double w : f.inv_freq) {
      if (!std::isfinite(w)) fail("attention: rope: freqs.inv_freq has a non-finite entry");
    }
    if (!std::isfinite(f.attention_factor) || f.attention_factor <= 0) {
      fail("attention: rope: attention_factor must be finite and > 0");
    }
    rope = &r;
    if (in.simple_path) {
      rotated_copies(r, in.q, in.k, in.qp, in.kp, in.opt.num_threads, in.q_rot, in.k_rot);
    }
  }

  // dq and dk were formed for the rotated q and k: rotate them back.
  void finish_grads(const Problem<T>& pr, const AttentionGradsOf<T>& g, View<const T, 4> dq,
                    View<const T, 4> dk) const {
    const Rope& r = *rope;
    const int threads = pr.opt.num_threads;
    if (r.offset > 0) {
      rotate_heads<T>(r, dq, g.dq, &pr.qp, Direction::kInverse, threads);
      rotate_heads<T>(r, dk, g.dk, &pr.kp, Direction::kInverse, threads);
    } else if constexpr (std::is_same_v<T, double>) {
      ref::apply_rope(r.freqs, r.style, dq, g.dq, &pr.qp, Direction::kInverse);
      ref::apply_rope(r.freqs, r.style, dk, g.dk, &pr.kp, Direction::kInverse);
    } else {
      apply_rope(r.freqs, r.style, dq, g.dq, &pr.qp, Direction::kInverse, threads);
      apply_rope(r.freqs, r.style, dk, g.dk, &pr.kp, Direction::kInverse, threads);
    }
  }

  // The kernel rotates q and k rows as it loads them, from cos/sin by absolute position
  // (O(positions x rotary_dim) doubles) when that table is no larger than rotated copies of q
  // and k would be (sparse positions) and the angles are the accurate ones; else the copies.
  bool fill_kernel(KernelInputs& in) const {
    const Dims& d = in.pr.d;
    const Rope& r = *rope;
    const int64_t pairs = static_cast<int64_t>(r.freqs.inv_freq.size());
    const int64_t padded = kernels::rope_table_padded(pairs);
    const double table_bytes =
        static_cast<double>(in.phi - in.plo + 1) * static_cast<double>(2 * padded * 8);
    const double copy_bytes =
        static_cast<double>(d.batch * (d.seq_q * d.heads_q + d.seq_k * d.heads_kv)) *
        static_cast<double>(d.head_dim * 4);
    // Where copies are not an option (half-precision storage, paged caches) the table serves up
    // to 64 MiB.
    const double table_max = in.allow_rope_copies ? copy_bytes : std::max(copy_bytes, 0x1p26);
    if (r.freqs.angles == RopeAngles::kAccurate && table_bytes <= table_max) {
      const int64_t n = in.phi - in.plo + 1;
      double* cs =
          in.f64
              .emplace_back(hwy::AllocateAligned<double>(static_cast<std::size_t>(n * 2 * padded)))
              .get();
      kernels::rope_fill_table(r.freqs.inv_freq.data(), pairs, r.freqs.attention_factor, in.plo, n,
                               cs, in.threads);
      std::vector<int64_t>& base = in.i64.emplace_back(static_cast<std::size_t>(d.batch));
      for (int64_t b = 0; b < d.batch; ++b) {
        base[static_cast<std::size_t>(b)] = in.bases[static_cast<std::size_t>(b)] - in.plo;
      }
      in.fp.rope.cs = cs;
      in.fp.rope.padded = padded;
      in.fp.rope.pairs = pairs;
      in.fp.rope.offset = r.offset;
      in.fp.rope.head_dim = d.head_dim;
      in.fp.rope.interleaved = r.style == RopeStyle::kInterleaved;
      in.fp.rope_base = base.data();
      return true;
    }
    if (!in.allow_rope_copies) return false;
    std::vector<float>& q_rot = in.f32.emplace_back();
    std::vector<float>& k_rot = in.f32.emplace_back();
    rotated_copies(r, in.pr.q, in.pr.k, in.pr.qp, in.pr.kp, in.pr.opt.num_threads, q_rot, k_rot);
    in.fp.q = q_rot.data();
    in.fp.q_stride = {d.seq_q * d.heads_q * d.head_dim, d.heads_q * d.head_dim, d.head_dim};
    in.fp.k = k_rot.data();
    in.fp.k_stride = {d.seq_k * d.heads_kv * d.head_dim, d.heads_kv * d.head_dim, d.head_dim};
    return true;
  }

  // The kernel's dq and dk are for the rotated q and k: rotated back in place.
  void fold_grads(KernelGrads& kg) const {
    const auto& pr = kg.pr;
    rotate_heads<float>(*rope, View<const float, 4>(kg.g.dq), kg.g.dq, &pr.qp, Direction::kInverse,
                        pr.opt.num_threads);
    rotate_heads<float>(*rope, View<const float, 4>(kg.g.dk), kg.g.dk, &pr.kp, Direction::kInverse,
                        pr.opt.num_threads);
  }

  // The scheme from settings, parameter tensors and a model config (schemes/rope_frequencies.cc).
  static void build(detail::SchemeBuild& b, const ModelLayer* layer);
};

}  // namespace posenc::attn
