// check_ranks_agree: a fingerprint all-gather, and only on a difference a gather of the fields.
#include "comm/agreement.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "common/check.h"

namespace fp8dp {

namespace {

// The first field every rank sends: the object being built, so that ranks constructing different
// objects at the same time (a DDP on one, an optimizer on another) are told so.
constexpr const char* kObjectField = "object being built";
// Tags the layout of the fingerprint and of the serialized fields: a rank running another
// version of this protocol cannot decode our bytes, and is named instead.
constexpr int64_t kProtocol = 0x46503844'0001;  // "FP8D", version 1
constexpr int kDigest = 4;                      // protocol, bytes, hash 1, hash 2
// Long values (a parameter list) are cut in messages; the comparison uses all of them.
constexpr size_t kShowChars = 300;
constexpr size_t kShowGroups = 8;

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_str(std::string& out, const std::string& s) {
  put_u64(out, s.size());
  out += s;
}

// count, then (name, value) pairs, each string length-prefixed: any bytes may occur in a value.
std::string serialize(const std::vector<AgreementField>& fields) {
  std::string out;
  put_u64(out, fields.size());
  for (const auto& [name, value] : fields) {
    put_str(out, name);
    put_str(out, value);
  }
  return out;
}

class Reader {
 public:
  Reader(const uint8_t* p, size_t n, int rank) : p_(p), n_(n), rank_(rank) {}
  uint64_t u64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p_[at_ + i]) << (8 * i);
    at_ += 8;
    return v;
  }
  std::string str() {
    const uint64_t len = u64();
    need(len);
    std::string s(reinterpret_cast<const char*>(p_ + at_), len);
    at_ += len;
    return s;
  }

 private:
  void need(uint64_t k) {
    FP8DP_CHECK(k <= n_ - at_, "check_ranks_agree: the fields gathered from rank ", rank_,
                " are cut short (", n_, " bytes): a rank running another fp8dp version?");
  }
  const uint8_t* p_;
  size_t n_;
  size_t at_ = 0;
  int rank_;
};

std::vector<AgreementField> deserialize(const uint8_t* p, size_t n, int rank) {
  Reader r(p, n, rank);
  const uint64_t count = r.u64();
  std::vector<AgreementField> out;
  for (uint64_t i = 0; i < count; ++i) {
    std::string name = r.str();
    out.emplace_back(std::move(name), r.str());
  }
  return out;
}

// Two independent 64-bit hashes of the bytes (FNV-1a and a multiply-xorshift): an accidental
// collision of both, with equal lengths, is out of reach for a configuration typo.
std::pair<uint64_t, uint64_t> hashes(const std::string& bytes) {
  uint64_t a = 14695981039346656037ull, b = 0x9E3779B97F4A7C15ull;
  for (unsigned char c : bytes) {
    a = (a ^ c) * 1099511628211ull;
    b = (b + c + 1) * 0xBF58476D1CE4E5B9ull;
    b ^= b >> 31;
  }
  return {a, b};
}

std::string shown(const std::string& v) {
  if (v.size() <= kShowChars) return v;
  return v.substr(0, kShowChars) + "... (" + std::to_string(v.size()) + " chars)";
}

// "rank 2" / "ranks 0-1,3"
std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? "," : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

// "rank 0 False, rank 1 True": ranks grouped by value, in order of first appearance.
std::string by_value(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < values.size(); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == values[r]; });
    if (it == groups.end()) {
      groups.push_back({values[r], {static_cast<int>(r)}});
    } else {
      it->second.push_back(static_cast<int>(r));
    }
  }
  std::string out;
  for (size_t g = 0; g < groups.size() && g < kShowGroups; ++g)
    out += (g ? ", " : "") + ranks_text(groups[g].second) + " " + shown(groups[g].first);
  if (groups.size() > kShowGroups)
    out += ", and " + std::to_string(groups.size() - kShowGroups) + " more different values";
  return out;
}

}  // namespace

std::string describe_disagreement(const std::vector<std::vector<AgreementField>>& per_rank,
                                  const std::string& what) {
  size_t longest = 0;
  for (const auto& f : per_rank) longest = std::max(longest, f.size());
  for (size_t i = 0; i < longest; ++i) {
    std::vector<std::optional<AgreementField>> at(per_rank.size());
    for (size_t r = 0; r < per_rank.size(); ++r)
      if (i < per_rank[r].size()) at[r] = per_rank[r][i];
    if (std::all_of(at.begin(), at.end(), [&](const auto& f) { return f == at[0]; })) continue;
    std::vector<std::string> names;  // the distinct names at position i
    for (const auto& f : at)
      if (f && std::find(names.begin(), names.end(), f->first) == names.end())
        names.push_back(f->first);
    std::vector<std::string> values(per_rank.size());
    // A rank that has fewer fields runs other code: say how many it checks (besides `what`).
    auto absent = [&](size_t r) {
      return "(no such field: it checks " + std::to_string(per_rank[r].size() - 1) + ")";
    };
    if (names.size() == 1) {
      for (size_t r = 0; r < at.size(); ++r) values[r] = at[r] ? at[r]->second : absent(r);
      return what + ": ranks disagree on " + names[0] + ": " + by_value(values) +
             "; every rank must build " + what + " with the same " + names[0] +
             " (contract C12: the ranks run the same collectives)";
    }
    for (size_t r = 0; r < at.size(); ++r)
      values[r] = at[r] ? at[r]->first + " = " + at[r]->second : absent(r);
    return what + ": ranks check different fields (different fp8dp versions?): field " +
           std::to_string(i) + " (counting from 1) is " + by_value(values) +
           "; run the same fp8dp on every rank (contract C12)";
  }
  return "";
}

void check_ranks_agree(Communicator& comm, const std::vector<AgreementField>& fields,
                       const std::string& what, const c10::Device& device) {
  const int n = comm.size();
  if (n == 1) return;  // nothing to compare with
  std::vector<AgreementField> all;
  all.reserve(fields.size() + 1);
  all.emplace_back(kObjectField, what);
  all.insert(all.end(), fields.begin(), fields.end());
  const std::string bytes = serialize(all);
  const auto [h1, h2] = hashes(bytes);
  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor mine =
      at::tensor(std::vector<int64_t>{kProtocol, static_cast<int64_t>(bytes.size()),
                                      static_cast<int64_t>(h1), static_cast<int64_t>(h2)},
                 longs)
          .to(device);
  at::Tensor gathered = at::empty({kDigest * n}, longs.device(device));
  comm.all_gather({mine}, {gathered})->wait();
  const at::Tensor digests = gathered.cpu();
  comm.check_for_errors();  // an aborted collective unblocks the copy with garbage: raise first
  const int64_t* d = digests.const_data_ptr<int64_t>();
  bool same = true;
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    same = same && std::equal(d + kDigest * r, d + kDigest * (r + 1), d);
    longest = std::max(longest, d[kDigest * r + 1]);
  }
  if (same) return;
  // Every rank saw the same digests, so every rank is here. Ranks of another protocol version
  // would gather a different size below: name them and stop before it.
  for (int r = 0; r < n; ++r)
    FP8DP_CHECK_ARG(d[kDigest * r] == kProtocol, what, ": rank ", r,
                    " runs another version of fp8dp's rank-agreement check (protocol ",
                    d[kDigest * r], ", this rank ", kProtocol,
                    "): run the same fp8dp on every rank");
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  at::Tensor padded = at::zeros({longest}, u8);
  std::memcpy(padded.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  at::Tensor all_bytes = at::empty({longest * n}, u8.device(device));
  comm.all_gather({padded.to(device)}, {all_bytes})->wait();
  const at::Tensor got = all_bytes.cpu();
  comm.check_for_errors();
  std::vector<std::vector<AgreementField>> per_rank;
  for (int r = 0; r < n; ++r)
    per_rank.push_back(deserialize(got.const_data_ptr<uint8_t>() + longest * r,
                                   static_cast<size_t>(d[kDigest * r + 1]), r));
  std::string msg = describe_disagreement(per_rank, what);
  if (msg.empty())
    msg = what + ": the ranks' fingerprints differ although their fields are equal (ranks " +
          "running different fp8dp builds?); run the same fp8dp on every rank";
  detail::fail_arg(__FILE__, __LINE__, "ranks agree", msg);
}

}  // namespace fp8dp
