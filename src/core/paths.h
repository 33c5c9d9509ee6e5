// Where nopad finds the files it ships (the vocabulary and model configs under data/), wherever the binary runs from:
// a source checkout (./data, or the checkout above build/), or an installation (`cmake --install`: PREFIX/bin/nopad
// beside PREFIX/share/nopad/data).
#pragma once
#include <filesystem>
#include <optional>
#include <string_view>
#include <vector>

namespace nopad {

// The running executable (/proc/self/exe), or an empty path when it cannot be read.
std::filesystem::path executable_path();

// The folders searched for shipped data, in order: ./data, EXE_DIR/../data, EXE_DIR/../share/nopad/data.
std::vector<std::filesystem::path> data_search_dirs();

// The first existing data_search_dirs()/relative, or nullopt ("vocab/bert-uncased-vocab.txt").
std::optional<std::filesystem::path> find_data_file(std::string_view relative);

}  // namespace nopad
