// src/attention/reference.h - the materialized attention (reference.cc) as the fused glue's
// fallback sees it: forward and backward over a prepared call, and the backward's argument checks.
#pragma once

#include "attention/prepared.h"
#include "core/problem.h"

namespace posenc::attn {

// The forward, one row of scores at a time (out: q's shape with v's head dim; lse optional).
template <class T>
void run(const Problem<T>& pr, const Prepared<T>& p, View<T, 4> out, const View<T, 3>* lse);

// The backward into zeroed gradients (check_backward_args zeroes them).
template <class T>
void run_backward(const Problem<T>& pr, const Prepared<T>& p, const View<const T, 4>& out,
                  const View<const T, 3>& lse, const View<const T, 4>& dout,
                  const AttentionGradsOf<T>& g);

// Validates the backward's extra inputs and the gradient views against the call and its term;
// zeroes every gradient that will be written, dq, dk and dv unless zero_qkv is false (the fused
// kernel writes every element of them: 48 MB of stores saved at 4096 x 8 x 128).
template <class T>
void check_backward_args(const Problem<T>& pr, const PositionScheme& scheme, const Prepared<T>& p,
                         const View<const T, 4>& out, const View<const T, 3>& lse,
                         const View<const T, 4>& dout, const AttentionGradsOf<T>& g,
                         bool zero_qkv = true);

// Zeroes dq, dk and dv (those given).
template <class T>
void zero_qkv_grads(const AttentionGradsOf<T>& g);

}  // namespace posenc::attn
