#pragma once
// Command-line parsing for the tools: --help and --version as CLI11 prints them (exit 0); every usage error one
// line on stderr naming the tool, exit 2 (CLI11's own codes, 105-109, are not the tools' contract).
#include <cstdio>
#include <optional>
#include <vector>

#include <CLI/CLI.hpp>

namespace crosskv {

inline const std::vector<std::string>& log_levels() {
  static const std::vector<std::string> levels = {"trace", "debug", "info", "warn", "error"};
  return levels;
}

// The exit code when the tool should stop here, nullopt when it should run.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* tool) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --help-all
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "%s: error: %s (see --help)\n", tool, what.c_str());
    return 2;
  }
  return std::nullopt;
}

}  // namespace crosskv
