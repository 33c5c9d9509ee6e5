// Tests for the safetensors reader and writer: exact bytes of the written file, round trips with dtype conversion,
// and clear errors on truncated or corrupted files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/io.h"
#include "train/safetensors.h"

namespace nopad {
namespace {

fs::path temp_dir() {
  fs::path d = fs::temp_directory_path() / ("nopad_safetensors_test_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// Builds a file from a header text and data bytes, padding nothing (tests craft bad headers).
fs::path write_raw(const std::string& name, const std::string& header, const std::string& data) {
  const fs::path p = temp_dir() / name;
  write_file_atomic(p, le64(header.size()) + header + data);
  return p;
}

std::string error_of(const fs::path& p) {
  try {
    SafetensorsFile f(p);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, WriterBytesMatchTheFormatExactly) {
  const std::vector<float> w{1.0f, -2.0f, 0.5f, 3.0f};
  const std::vector<int64_t> ids{7, 9};
  const fs::path p = temp_dir() / "exact.safetensors";
  // Given out of order: the writer sorts by name.
  write_safetensors(p, {{"weight", DType::kF32, {2, 2}, w.data()}, {"ids", DType::kI64, {2}, ids.data()}},
                    {{"format", "pt"}});
  const std::string expected_json =
      R"({"__metadata__":{"format":"pt"},"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
      R"("weight":{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]}})";
  std::string header = expected_json;
  header.append((8 - header.size() % 8) % 8, ' ');
  ASSERT_EQ(header.size() % 8, 0u);
  std::string expected = le64(header.size()) + header;
  expected.append(reinterpret_cast<const char*>(ids.data()), 16);
  expected.append(reinterpret_cast<const char*>(w.data()), 16);
  EXPECT_EQ(read_file(p), expected);
  // No temporary left beside it.
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(p.parent_path()))
    if (e.path().filename().string().rfind("exact", 0) == 0) ++files;
  EXPECT_EQ(files, 1u);
}

TEST(Safetensors, RoundTripWithConversions) {
  const std::vector<float> f32{0.0f, -1.5f, 3.140625f, 65504.0f, 1e-7f, -0.0f};
  std::vector<uint16_t> f16, bf16;
  for (float x : f32) {
    f16.push_back(float_to_half(x));
    bf16.push_back(float_to_bf16(x));
  }
  const std::vector<uint8_t> empty;
  const fs::path p = temp_dir() / "rt.safetensors";
  write_safetensors(p,
                    {{"a.f32", DType::kF32, {2, 3}, f32.data()},
                     {"b.f16", DType::kF16, {6}, f16.data()},
                     {"c.bf16", DType::kBF16, {3, 2}, bf16.data()},
                     {"d.empty", DType::kU8, {0, 4}, empty.data()}},
                    {{"step", "12"}, {"note", "quote \" and \\ and é"}});
  SafetensorsFile f(p);
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.tensors()[0].name, "a.f32");
  EXPECT_EQ(f.at("a.f32").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.metadata().at("step"), "12");
  EXPECT_EQ(f.metadata().at("note"), "quote \" and \\ and é");
  EXPECT_EQ(f.read_float("a.f32"), f32);
  const std::vector<float> h = f.read_float("b.f16");
  EXPECT_EQ(h[1], -1.5f);
  EXPECT_EQ(h[2], 3.140625f);  // exactly representable in half
  EXPECT_EQ(h[3], 65504.0f);
  EXPECT_NEAR(h[4], 1e-7f, 3e-8f);  // a half subnormal
  EXPECT_TRUE(std::signbit(h[5]));
  const std::vector<float> b = f.read_float("c.bf16");
  EXPECT_EQ(b[1], -1.5f);
  EXPECT_NEAR(b[2], 3.140625f, 0.02f);
  EXPECT_EQ(f.at("d.empty").numel, 0u);
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_THROW(f.at("missing"), Error);
  std::vector<float> wrong(5);
  EXPECT_THROW(f.read_float("a.f32", wrong.data(), wrong.size()), Error);
  EXPECT_THROW(f.read_float("d.empty"), Error);  // U8 is not a float type
}

TEST(Safetensors, HalfAndBf16Conversions) {
  EXPECT_EQ(float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);  // rounds to even: infinity
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // halfway: to even
  EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(NAN))));
  for (uint32_t h = 0; h < 0x7c00; ++h) EXPECT_EQ(float_to_half(half_to_float(static_cast<uint16_t>(h))), h);
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x4049), 3.140625f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(Safetensors, WriterRejectsBadInput) {
  const float x = 1;
  const fs::path p = temp_dir() / "bad_write.safetensors";
  EXPECT_THROW(write_safetensors(p, {{"a", DType::kF32, {1}, &x}, {"a", DType::kF32, {1}, &x}}), Error);
  EXPECT_THROW(write_safetensors(p, {{"__metadata__", DType::kF32, {1}, &x}}), Error);
  EXPECT_THROW(write_safetensors(p, {{"a", DType::kF32, {-1}, &x}}), Error);
  EXPECT_FALSE(fs::exists(p));
}

TEST(Safetensors, TruncatedFilesAreRejectedWithTheFileName) {
  const std::vector<float> w(16, 1.0f);
  const fs::path good = temp_dir() / "good.safetensors";
  write_safetensors(good, {{"w", DType::kF32, {16}, w.data()}});
  const std::string bytes = read_file(good);
  for (size_t cut : {size_t{0}, size_t{5}, size_t{8}, size_t{20}, bytes.size() - 1}) {
    const fs::path p = temp_dir() / ("trunc" + std::to_string(cut) + ".safetensors");
    write_file_atomic(p, bytes.substr(0, cut));
    const std::string err = error_of(p);
    EXPECT_NE(err.find(p.string()), std::string::npos) << "cut " << cut << ": " << err;
  }
}

TEST(Safetensors, CorruptedHeadersNameTheProblem) {
  const std::string data8(8, '\0');
  struct Case {
    std::string header, data, expect;
  };
  const std::vector<Case> cases{
      {"{not json", data8, "not valid JSON"},
      {"[1,2]", "", "not a JSON object"},
      {R"({"t":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", data8, "unsupported dtype 'F99'"},
      {R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8, "tensor 't'"},
      {R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8, "non-negative"},
      {R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8, "outside the data section"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data8, "tensor 't'"},
      {R"({"t":{"dtype":"F32","shape":[2]}})", data8, "data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       data8, "overlaps"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8, "unused bytes"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data8, "after the last tensor"},
      {R"({"__metadata__":{"k":1}})", "", "__metadata__"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const fs::path p = write_raw("corrupt" + std::to_string(i++) + ".safetensors", c.header, c.data);
    const std::string err = error_of(p);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.header << " -> " << err;
    EXPECT_NE(err.find(p.string()), std::string::npos) << err;
  }
  // A header length far past the end of the file.
  const fs::path p = temp_dir() / "huge_len.safetensors";
  write_file_atomic(p, le64(1ull << 40) + "{}");
  EXPECT_NE(error_of(p).find("runs past the end"), std::string::npos);
}

TEST(Safetensors, ReadsUnpaddedHeaderAsOtherWritersMayProduce) {
  float v[2] = {1.5f, -2.5f};
  const fs::path p = write_raw("unpadded.safetensors", R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                               std::string(reinterpret_cast<const char*>(v), 8));
  SafetensorsFile f(p);
  EXPECT_EQ(f.read_float("x"), (std::vector<float>{1.5f, -2.5f}));
}

}  // namespace
}  // namespace nopad
