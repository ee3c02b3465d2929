// Reading the example trainers' JSON-lines logs (one line per committed outer step) in tests.
// Header only; the including target links Boost::json.
#pragma once

#include <boost/json.hpp>

#include <fstream>
#include <string>
#include <vector>

namespace lk::test {

// The batch hashes of every line of a trainer's log, in the order written (two lives of a group
// may append to one log): the data stream the trainer drew, inner step by inner step.
inline std::vector<std::string> BatchSequence(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    boost::json::object o = boost::json::parse(line).as_object();
    for (const auto& b : o.at("batches").as_array()) out.emplace_back(b.as_string());
  }
  return out;
}

}  // namespace lk::test
