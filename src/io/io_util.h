// src/io/io_util.h - helpers shared by the .npy and .safetensors readers (defined in file.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace posenc::io_detail {

// `s` with control bytes escaped, for error messages.
std::string printable(const std::string& s);
// "[2, 3]".
std::string dims_str(const std::vector<int64_t>& shape);
// numel and byte count of a shape, false on overflow of int64.
bool checked_nbytes(const std::vector<int64_t>& shape, int64_t itemsize, int64_t* numel,
                    int64_t* nbytes);

}  // namespace posenc::io_detail
