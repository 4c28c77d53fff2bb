// src/model/format.h - number formatting shared by the config reader's messages and describe
// (private to the library).
#pragma once

#include <cstdint>
#include <string>

namespace posenc::model {

std::string fmt(double v);  // "%.10g"
std::string fmt(int64_t v);

}  // namespace posenc::model
