// posenc/sinusoidal.h - fixed sinusoidal absolute encodings (Vaswani et al. 2017,
// docs/sinusoidal.md).
//
//   w_i = base^(-2i / den),  i in [0, d/2)
//   interleaved (paper):      PE[p, 2i] = sin(p w_i),  PE[p, 2i+1] = cos(p w_i)
//   concat (Transformer-XL, Marian, BART, Pegasus): PE[p] = [sin(p w_0 ..), cos(p w_0 ..)]
// Angles and sines are evaluated in double and rounded once to float32: float32 tables equal the
// float64 values to float32 rounding, and are correctly rounded with respect to the exact formula
// up to about p = 2^28 (the double angle's error is about p * 1e-16 rad). Peers form p*w in
// float32.
#pragma once

#include <cstdint>
#include <vector>

#include "posenc/tensor.h"

namespace posenc {

enum class SinLayout { kInterleaved, kConcat };

// Exponent denominator `den` of w_i = base^(-2i/den):
//   kDim            den = d (the paper; HF, Marian, BART)
//   kHalfMinusOne   w_i = base^(-i/(d/2 - 1)): tensor2tensor, fairseq, Whisper, CTranslate2, whose
//                   last frequency is exactly 1/base (d = 2 uses a divisor of 1, as they do).
enum class SinDenominator { kDim, kHalfMinusOne };

// What to do when `dim` is odd: an error (default) or fairseq's zero column appended at the end.
enum class SinOddDim { kError, kZeroPad };

struct SinusoidalConfig {
  int64_t dim = 0;    // d, the model (embedding) width
  double base = 1e4;  // > 1
  SinLayout layout = SinLayout::kInterleaved;
  SinDenominator denominator = SinDenominator::kDim;
  int64_t origin = 0;  // position of the first token when positions are implicit (fairseq:
                       // padding_idx + 1)
  SinOddDim odd_dim = SinOddDim::kError;
};

// Throws ValueError on dim < 1, odd dim under kError, base <= 1 or non-finite, origin < 0.
void validate(const SinusoidalConfig& cfg);

// Frequencies w_i, i in [0, floor(d/2)), in double.
std::vector<double> sinusoidal_frequencies(const SinusoidalConfig& cfg);

// Table [length, dim] row-major float32, row r at position origin + r.
std::vector<float> sinusoidal_table(const SinusoidalConfig& cfg, int64_t length);

// Writes the encodings of explicit positions into out [n, dim] (any strides).
void sinusoidal_encode(const SinusoidalConfig& cfg, const std::vector<int64_t>& positions,
                       View<float, 2> out);

// x [batch, seq, dim] += PE[position(b, i)] in place. Positions default to
// Positions::offset(cfg.origin). Throws ShapeError if x's last dim != cfg.dim.
void add_sinusoidal(const SinusoidalConfig& cfg, View<float, 3> x,
                    const Positions* positions = nullptr);

namespace ref {
// PE[p, k] in double, straight from the formula.
double sinusoidal_value(const SinusoidalConfig& cfg, int64_t p, int64_t k);
std::vector<double> sinusoidal_table(const SinusoidalConfig& cfg, int64_t length);
}  // namespace ref

}  // namespace posenc
