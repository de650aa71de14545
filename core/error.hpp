#pragma once
// Typed errors for user mistakes, and CROSSKV_ASSERT for broken invariants.
#include <cstdio>
#include <stdexcept>
#include <string>

namespace crosskv {

// A user's mistake: config, input files, command line. One line, naming the file/key and what was expected.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class ConfigError : public UserError {
 public:
  using UserError::UserError;
};
class InputError : public UserError {
 public:
  using UserError::UserError;
};
// A system that cannot be solved as asked (singular / not SPD with lambda = 0).
class SolveError : public UserError {
 public:
  using UserError::UserError;
};
// An external library call failed (HDF5, MPI, BLAS, CUDA...). Carries host/rank/operands.
class SystemError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A user's mistake that every rank of a job knows of (agreed() in core/comm.hpp): one rank reports it, with the
// exit code of its error; the others exit with the same code quietly.
class AgreedError : public std::runtime_error {
 public:
  AgreedError(const std::string& what, int exit_code, bool report)
      : std::runtime_error(what), exit_code(exit_code), report(report) {}
  int exit_code;
  bool report;
};

// The tools' exit code for a user's mistake: 3 for a system that cannot be solved, else 2.
inline int user_error_code(const UserError& e) { return dynamic_cast<const SolveError*>(&e) ? 3 : 2; }

[[noreturn]] void assertion_failed(const char* expr, const char* file, int line, const std::string& msg);

// A command-line tool's body with the tools' exit codes: 2 for a user's mistake (UserError), 1 for anything else,
// each with one line on stderr naming the tool.
template <class Body>
int run_tool(const char* tool, Body&& body) {
  try {
    return body();
  } catch (const UserError& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool, e.what());
    return 1;
  }
}

}  // namespace crosskv

#define CROSSKV_ASSERT(cond, msg)                                                 \
  do {                                                                            \
    if (!(cond)) ::crosskv::assertion_failed(#cond, __FILE__, __LINE__, (msg));   \
  } while (0)
