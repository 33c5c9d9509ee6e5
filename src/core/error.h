// Errors that reach the user: one exception type carrying one clear sentence (what, where, what to do).
// Library code throws nopad::Error; the command line prints its message and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace nopad {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A device allocation that did not fit; the message says how much was asked and what was free. Callers that know
// what the memory was for (the batch size, say) catch it and add that.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

template <class... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(str_cat(args...));
}

}  // namespace nopad

// NOPAD_CHECK(cond, message parts...): throw nopad::Error with the concatenated message when cond is false.
#define NOPAD_CHECK(cond, ...)            \
  do {                                    \
    if (!(cond)) ::nopad::fail(__VA_ARGS__); \
  } while (0)
