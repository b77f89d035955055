// One family of throwing checks: every failure names file:line, the failed expression and the
// values.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fp8dp {

// Internal invariant or runtime failure (RuntimeError in Python).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed a bad argument (ValueError in Python: std::invalid_argument maps to it).
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

inline std::string where(const char* file, int line, const char* expr) {
  std::string f(file);
  auto pos = f.rfind("src/");
  if (pos != std::string::npos) f = f.substr(pos);
  return concat(" (", f, ":", line, ", check `", expr, "` failed)");
}

[[noreturn]] inline void fail(const char* file, int line, const char* expr,
                              const std::string& msg) {
  throw Error(msg + where(file, line, expr));
}

[[noreturn]] inline void fail_arg(const char* file, int line, const char* expr,
                                  const std::string& msg) {
  throw ValueError(msg + where(file, line, expr));
}

}  // namespace detail
}  // namespace fp8dp

// FP8DP_CHECK(cond, "GEMM needs K % 16 == 0, got K=", k) -> fp8dp::Error (RuntimeError).
#define FP8DP_CHECK(cond, ...)                                                                \
  do {                                                                                        \
    if (!(cond))                                                                              \
      ::fp8dp::detail::fail(__FILE__, __LINE__, #cond, ::fp8dp::detail::concat(__VA_ARGS__)); \
  } while (0)

// FP8DP_CHECK_ARG(cond, "scale: expected > 0, got ", s) -> fp8dp::ValueError (ValueError).
#define FP8DP_CHECK_ARG(cond, ...)                                                                \
  do {                                                                                            \
    if (!(cond))                                                                                  \
      ::fp8dp::detail::fail_arg(__FILE__, __LINE__, #cond, ::fp8dp::detail::concat(__VA_ARGS__)); \
  } while (0)
