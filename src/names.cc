// src/names.cc - the text names of posenc's enums (posenc/names.h).
#include "posenc/names.h"

#include <utility>

#include "posenc/error.h"

namespace posenc {

namespace {

// The value whose name is `s` among `choices`, else ValueError listing the names. Names are
// spelled with hyphens ("half-minus-one", as CLI values); the underscore spelling of Python
// keywords ("half_minus_one") is accepted too.
template <class E, std::size_t N>
E parse_choice(const std::string& s, const std::string& what,
               const std::pair<const char*, E> (&choices)[N]) {
  std::string key = s;
  for (char& c : key) {
    if (c == '_') c = '-';
  }
  std::string names;
  for (std::size_t i = 0; i < N; ++i) {
    if (key == choices[i].first) return choices[i].second;
    if (i > 0) names += i + 1 == N ? " or " : ", ";
    names += choices[i].first;
  }
  throw ValueError(what + ": '" + s + "' (" + names + ")");
}

constexpr std::pair<const char*, RopeStyle> kStyles[] = {{"half", RopeStyle::kHalf},
                                                         {"interleaved", RopeStyle::kInterleaved}};
constexpr std::pair<const char*, RopeAngles> kAngles[] = {{"accurate", RopeAngles::kAccurate},
                                                          {"float32", RopeAngles::kFloat32}};
constexpr std::pair<const char*, SinLayout> kLayouts[] = {{"interleaved", SinLayout::kInterleaved},
                                                          {"concat", SinLayout::kConcat}};
constexpr std::pair<const char*, SinDenominator> kDenominators[] = {
    {"dim", SinDenominator::kDim}, {"half-minus-one", SinDenominator::kHalfMinusOne}};
constexpr std::pair<const char*, SinOddDim> kOddDims[] = {{"error", SinOddDim::kError},
                                                          {"zero-pad", SinOddDim::kZeroPad}};
constexpr std::pair<const char*, DebertaP2c> kP2c[] = {{"model", DebertaP2c::kModel},
                                                       {"paper", DebertaP2c::kPaper}};

constexpr std::pair<const char*, RopeScalingType> kScalings[] = {
    {"default", RopeScalingType::kDefault},
    {"linear", RopeScalingType::kLinear},
    {"dynamic", RopeScalingType::kDynamic},
    {"yarn", RopeScalingType::kYarn},
    {"llama3", RopeScalingType::kLlama3},
    {"longrope", RopeScalingType::kLongRope},
    {"proportional", RopeScalingType::kProportional}};

template <class E, std::size_t N>
const char* name_of(E value, const std::pair<const char*, E> (&choices)[N]) {
  for (const auto& [name, v] : choices) {
    if (v == value) return name;
  }
  return "unknown";
}

}  // namespace

const char* style_name(RopeStyle s) { return name_of(s, kStyles); }
const char* angles_name(RopeAngles a) { return name_of(a, kAngles); }
const char* layout_name(SinLayout l) { return name_of(l, kLayouts); }
const char* denominator_name(SinDenominator d) { return name_of(d, kDenominators); }
const char* odd_dim_name(SinOddDim o) { return name_of(o, kOddDims); }
const char* p2c_name(DebertaP2c p) { return name_of(p, kP2c); }

const char* scaling_name(RopeScalingType t) { return name_of(t, kScalings); }

RopeStyle parse_rope_style(const std::string& s, const std::string& what) {
  return parse_choice(s, what, kStyles);
}
RopeAngles parse_rope_angles(const std::string& s, const std::string& what) {
  return parse_choice(s, what, kAngles);
}
SinLayout parse_sin_layout(const std::string& s, const std::string& what) {
  return parse_choice(s, what, kLayouts);
}
SinDenominator parse_sin_denominator(const std::string& s, const std::string& what) {
  return parse_choice(s, what, kDenominators);
}
SinOddDim parse_sin_odd_dim(const std::string& s, const std::string& what) {
  return parse_choice(s, what, kOddDims);
}
DebertaP2c parse_deberta_p2c(const std::string& s, const std::string& what) {
  return parse_choice(s, what, kP2c);
}

}  // namespace posenc
