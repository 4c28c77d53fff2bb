// posenc/names.h - the text names of posenc's enums, both ways, in one place: what flags,
// keywords, messages and JSON say. parse_* take the text and `what` (the flag or keyword the
// text came from, for the message) and throw ValueError "what: 'text' (a or b)" otherwise;
// hyphens and underscores are alike ("half-minus-one" and "half_minus_one").
#pragma once

#include <string>

#include "posenc/deberta.h"
#include "posenc/rope.h"
#include "posenc/sinusoidal.h"

namespace posenc {

const char* style_name(RopeStyle s);             // "half", "interleaved"
const char* angles_name(RopeAngles a);           // "accurate", "float32"
const char* scaling_name(RopeScalingType t);     // "default", "linear", "dynamic", "yarn", ...
const char* layout_name(SinLayout l);            // "interleaved", "concat"
const char* denominator_name(SinDenominator d);  // "dim", "half-minus-one"
const char* odd_dim_name(SinOddDim o);           // "error", "zero-pad"
const char* p2c_name(DebertaP2c p);              // "model", "paper"

RopeStyle parse_rope_style(const std::string& s, const std::string& what = "style");
RopeAngles parse_rope_angles(const std::string& s, const std::string& what = "angles");
SinLayout parse_sin_layout(const std::string& s, const std::string& what = "layout");
SinDenominator parse_sin_denominator(const std::string& s, const std::string& what = "denominator");
SinOddDim parse_sin_odd_dim(const std::string& s, const std::string& what = "odd_dim");
DebertaP2c parse_deberta_p2c(const std::string& s, const std::string& what = "deberta_p2c");

}  // namespace posenc
