// posenc/error.h - the exceptions every public function throws on bad input.
//
// Library code never aborts: a public function validates its arguments and throws a subclass of
// posenc::Error whose message names the argument, what was expected and what was given, e.g.
//   "k: kv heads (3) must divide q heads (8)".
// The CLI maps every posenc::Error to one line on stderr and exit status 2.
#pragma once

#include <stdexcept>
#include <string>

namespace posenc {

// Base class: invalid argument (shape, value, configuration).
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

// A tensor's shape or stride does not fit the call.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A value (position, dimension, option) is out of its allowed range or not finite.
class ValueError : public Error {
 public:
  using Error::Error;
};

// A requested size overflows int64 or exceeds the allocation limit (posenc/size.h); the message
// names the arguments and the bytes they would need.
class SizeError : public ValueError {
 public:
  using ValueError::ValueError;
};

// A file could not be read or written, or is malformed (.npy, .safetensors, config.json).
class IoError : public Error {
 public:
  using Error::Error;
};

}  // namespace posenc
