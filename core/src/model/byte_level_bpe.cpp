// Byte-level BPE encoding, as Hugging Face `tokenizers` runs it: added tokens split out first,
// NFC (when declared), regex pre-tokenization, each piece's bytes mapped to GPT-2's printable
// alphabet, then merges applied lowest rank first, leftmost first among equal ranks.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "byte_level_bpe.hpp"

#include <fmt/format.h>
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <functional>
#include <limits>
#include <queue>
#include <string_view>
#include <unordered_map>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the other 68 bytes
// for U+0100.. in byte order; so every byte sequence is a printable string ("Ġ" = space).
std::array<std::string, 256> byte_alphabet() {
  std::array<std::string, 256> alphabet;
  char32_t next = 0x100;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    append_utf8(alphabet[b], printable ? static_cast<char32_t>(b) : next++);
  }
  return alphabet;
}

// Byte length of the UTF-8 character starting with `lead` (1 for a stray byte).
std::size_t utf8_length(unsigned char lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

class Pcre2Regex {
 public:
  Pcre2Regex(const std::string& pattern, const std::string& origin) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      throw Error(fmt::format("{}: pre-tokenizer regex /{}/ is not valid at offset {}: {}", origin,
                              pattern, offset, reinterpret_cast<char*>(message.data())));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  Pcre2Regex(const Pcre2Regex&) = delete;
  Pcre2Regex& operator=(const Pcre2Regex&) = delete;
  ~Pcre2Regex() { pcre2_code_free(code_); }

  // Splits `text` (valid UTF-8) into matches and the gaps between them, in order; empty
  // matches are skipped.
  void split(std::string_view text, std::vector<std::string_view>& out) const {
    pcre2_match_data* match = pcre2_match_data_create_from_pattern(code_, nullptr);
    std::size_t gap_start = 0;
    std::size_t at = 0;
    while (at < text.size()) {
      const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
      const int rc =
          jit_ ? pcre2_jit_match(code_, subject, text.size(), at, 0, match, nullptr)
               : pcre2_match(code_, subject, text.size(), at, PCRE2_NO_UTF_CHECK, match, nullptr);
      if (rc < 0) break;  // no further match (or a resource limit): the rest is one gap
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match);
      if (span[1] == span[0]) {  // empty match: step over one character
        at = span[0] + utf8_length(static_cast<unsigned char>(text[span[0]]));
        continue;
      }
      if (span[0] > gap_start) out.push_back(text.substr(gap_start, span[0] - gap_start));
      out.push_back(text.substr(span[0], span[1] - span[0]));
      gap_start = at = span[1];
    }
    if (gap_start < text.size()) out.push_back(text.substr(gap_start));
    pcre2_match_data_free(match);
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

std::string nfc(std::string_view text) {
  utf8proc_uint8_t* result = nullptr;
  const auto length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &result,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (length < 0) throw Error(fmt::format("NFC normalization failed: {}", utf8proc_errmsg(length)));
  std::string out(reinterpret_cast<char*>(result), static_cast<std::size_t>(length));
  std::free(result);
  return out;
}

class ByteLevelBpe final : public Tokenizer {
 public:
  explicit ByteLevelBpe(ByteLevelBpeSpec spec);

  std::vector<std::int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const std::int32_t> ids) const override;
  std::int32_t vocab_size() const override { return static_cast<std::int32_t>(pieces_.size()); }
  std::string description() const override { return description_; }
  std::optional<std::int32_t> token_id(std::string_view token_text) const override;

 private:
  struct Segment {
    std::string_view text;
    std::optional<std::int32_t> added;  // an added token's id; text is then empty
  };
  std::vector<Segment> split_added_tokens(std::string_view text) const;
  void encode_piece(std::string_view piece, std::vector<std::int32_t>& ids) const;
  std::int32_t vocabulary_id(const std::string& symbol) const;

  std::string origin_;
  std::string description_;
  std::array<std::string, 256> alphabet_ = byte_alphabet();
  std::unordered_map<std::string, std::int32_t> vocab_;       // byte-level text -> id
  std::vector<std::optional<std::string>> pieces_;            // id -> bytes it decodes to
  std::unordered_map<std::string, std::int32_t> merge_rank_;  // "left right" -> rank
  std::vector<AddedTokenSpec> added_;                         // longest content first
  std::vector<std::unique_ptr<Pcre2Regex>> regexes_;
  bool nfc_ = false;
  bool ignore_merges_ = false;
  std::optional<std::int32_t> unk_;
};

ByteLevelBpe::ByteLevelBpe(ByteLevelBpeSpec spec)
    : origin_(std::move(spec.origin)),
      description_(std::move(spec.description)),
      added_(std::move(spec.added)),
      nfc_(spec.nfc),
      ignore_merges_(spec.ignore_merges),
      unk_(spec.unk) {
  bos_ = spec.bos;
  eos_ = spec.eos;
  add_bos_ = spec.add_bos;
  add_eos_ = spec.add_eos;
  std::unordered_map<std::string, unsigned char> byte_of;
  for (int b = 0; b < 256; ++b) byte_of[alphabet_[b]] = static_cast<unsigned char>(b);
  pieces_.resize(spec.tokens.size());
  for (std::size_t id = 0; id < spec.tokens.size(); ++id) {
    const std::string& token = spec.tokens[id];
    if (token.empty()) continue;
    vocab_.emplace(token, static_cast<std::int32_t>(id));
    std::string bytes;  // characters outside the byte alphabet stay as they are
    for (std::size_t at = 0; at < token.size();) {
      const std::size_t n =
          std::min(utf8_length(static_cast<unsigned char>(token[at])), token.size() - at);
      const auto byte = byte_of.find(token.substr(at, n));
      bytes += byte != byte_of.end() ? std::string(1, static_cast<char>(byte->second))
                                     : token.substr(at, n);
      at += n;
    }
    pieces_[id] = std::move(bytes);
  }
  for (std::size_t rank = 0; rank < spec.merges.size(); ++rank) {
    const auto& [left, right] = spec.merges[rank];
    if (!vocab_.contains(left) || !vocab_.contains(right) || !vocab_.contains(left + right))
      throw Error(fmt::format("{}: merge {} \"{} {}\" joins pieces that are not in the vocabulary",
                              origin_, rank, left, right));
    merge_rank_.emplace(left + " " + right, static_cast<std::int32_t>(rank));
  }
  for (const auto& token : added_) {
    if (token.id < 0 || token.id >= kMaxTokenizerVocab || token.content.empty())
      throw Error(fmt::format("{}: added token \"{}\" has id {} (needs an id in [0, {}) and text)",
                              origin_, token.content, token.id, kMaxTokenizerVocab));
    if (static_cast<std::size_t>(token.id) >= pieces_.size()) pieces_.resize(token.id + 1);
    pieces_[static_cast<std::size_t>(token.id)] = token.content;
  }
  std::stable_sort(added_.begin(), added_.end(), [](const auto& a, const auto& b) {
    return a.content.size() > b.content.size();
  });
  for (const auto& pattern : spec.split_regexes)
    regexes_.push_back(std::make_unique<Pcre2Regex>(pattern, origin_));
}

std::optional<std::int32_t> ByteLevelBpe::token_id(std::string_view token_text) const {
  for (const auto& token : added_)
    if (token.content == token_text) return token.id;
  std::string mapped;
  for (unsigned char byte : token_text) mapped += alphabet_[byte];
  if (const auto found = vocab_.find(mapped); found != vocab_.end()) return found->second;
  return std::nullopt;
}

// Leftmost, then longest, added token wins; lstrip/rstrip take the whitespace beside it.
std::vector<ByteLevelBpe::Segment> ByteLevelBpe::split_added_tokens(std::string_view text) const {
  std::vector<Segment> segments;
  std::size_t start = 0;
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  for (std::size_t at = 0; at < text.size();) {
    const AddedTokenSpec* hit = nullptr;
    for (const auto& token : added_)
      if (text.compare(at, token.content.size(), token.content) == 0) {
        hit = &token;
        break;
      }
    if (hit == nullptr) {
      ++at;
      continue;
    }
    std::size_t before_end = at;
    if (hit->lstrip)
      while (before_end > start && is_space(text[before_end - 1])) --before_end;
    if (before_end > start) segments.push_back({text.substr(start, before_end - start), {}});
    segments.push_back({{}, hit->id});
    at += hit->content.size();
    if (hit->rstrip)
      while (at < text.size() && is_space(text[at])) ++at;
    start = at;
  }
  if (start < text.size()) segments.push_back({text.substr(start), {}});
  return segments;
}

std::int32_t ByteLevelBpe::vocabulary_id(const std::string& symbol) const {
  if (const auto found = vocab_.find(symbol); found != vocab_.end()) return found->second;
  if (unk_) return *unk_;
  throw Error(fmt::format(
      "{}: the piece \"{}\" has no token and the tokenizer has no unknown token", origin_, symbol));
}

// One pre-tokenized piece: bytes -> alphabet symbols -> merges -> ids. Merges go lowest rank
// first, leftmost first among equal ranks, as a linked list of symbols (each a range of the
// mapped piece) and a min-heap of adjacent pairs: O(n log n) in the piece's length, where
// rescanning every pair after each merge was O(n^2) (llama.cpp's llm_tokenizer_bpe and HF
// tokenizers' word merges work the same way). A popped pair whose symbols changed is stale.
void ByteLevelBpe::encode_piece(std::string_view piece, std::vector<std::int32_t>& ids) const {
  std::string mapped;  // the piece in the byte alphabet: symbols are ranges of it
  mapped.reserve(2 * piece.size());
  struct Symbol {
    std::size_t start = 0, length = 0;
    std::ptrdiff_t prev = -1, next = -1;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (unsigned char byte : piece) {
    const auto n = static_cast<std::ptrdiff_t>(symbols.size());
    symbols.push_back({mapped.size(), alphabet_[byte].size(), n - 1,
                       n + 1 < static_cast<std::ptrdiff_t>(piece.size()) ? n + 1 : -1});
    mapped += alphabet_[byte];
  }
  auto text = [&](const Symbol& s) { return std::string_view(mapped).substr(s.start, s.length); };
  if (ignore_merges_)
    if (const auto found = vocab_.find(mapped); found != vocab_.end()) {
      ids.push_back(found->second);
      return;
    }
  struct Pair {
    std::int32_t rank;
    std::size_t left;    // index of the left symbol (its start orders equal ranks, left first)
    std::size_t length;  // left + right length when pushed: differs once either merged again
    bool operator>(const Pair& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Pair, std::vector<Pair>, std::greater<>> heap;
  std::string key;
  auto push_pair = [&](std::ptrdiff_t left) {
    if (left < 0 || symbols[static_cast<std::size_t>(left)].next < 0) return;
    const Symbol& l = symbols[static_cast<std::size_t>(left)];
    const Symbol& r = symbols[static_cast<std::size_t>(l.next)];
    key.assign(text(l)).append(" ").append(text(r));
    if (const auto rank = merge_rank_.find(key); rank != merge_rank_.end())
      heap.push({rank->second, static_cast<std::size_t>(left), l.length + r.length});
  };
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i) push_pair(static_cast<std::ptrdiff_t>(i));
  while (!heap.empty()) {
    const Pair pair = heap.top();
    heap.pop();
    Symbol& left = symbols[pair.left];
    if (left.length == 0 || left.next < 0) continue;  // merged into its left neighbour, or last
    Symbol& right = symbols[static_cast<std::size_t>(left.next)];
    if (left.length + right.length != pair.length) continue;  // either grew since: stale
    left.length += right.length;                              // the ranges are adjacent in `mapped`
    right.length = 0;
    left.next = right.next;
    if (left.next >= 0)
      symbols[static_cast<std::size_t>(left.next)].prev = static_cast<std::ptrdiff_t>(pair.left);
    push_pair(left.prev);
    push_pair(static_cast<std::ptrdiff_t>(pair.left));
  }
  std::string symbol;
  for (std::ptrdiff_t i = symbols.empty() ? -1 : 0; i >= 0;
       i = symbols[static_cast<std::size_t>(i)].next) {
    symbol.assign(text(symbols[static_cast<std::size_t>(i)]));
    ids.push_back(vocabulary_id(symbol));
  }
}

std::vector<std::int32_t> ByteLevelBpe::encode(std::string_view text) const {
  if (const std::size_t valid = valid_utf8_prefix(text); valid != text.size())
    throw Error(fmt::format("text to encode is not valid UTF-8 at byte {}", valid));
  std::vector<std::int32_t> ids;
  std::vector<std::string_view> pieces;
  std::vector<std::string_view> next;
  for (const Segment& segment : split_added_tokens(text)) {
    if (segment.added) {
      ids.push_back(*segment.added);
      continue;
    }
    const std::string normalized = nfc_ ? nfc(segment.text) : std::string(segment.text);
    pieces.assign(1, normalized);
    for (const auto& regex : regexes_) {
      next.clear();
      for (std::string_view piece : pieces) regex->split(piece, next);
      pieces.swap(next);
    }
    for (std::string_view piece : pieces) encode_piece(piece, ids);
  }
  return ids;
}

std::string ByteLevelBpe::decode(std::span<const std::int32_t> ids) const {
  std::string text;
  for (std::int32_t id : ids) {
    if (id >= 0 && static_cast<std::size_t>(id) < pieces_.size() && pieces_[id])
      text += *pieces_[id];
    else
      text += fmt::format("<id:{}>", id);
  }
  return text;
}

}  // namespace

std::unique_ptr<Tokenizer> make_byte_level_bpe(ByteLevelBpeSpec spec) {
  return std::make_unique<ByteLevelBpe>(std::move(spec));
}

}  // namespace kvlab
