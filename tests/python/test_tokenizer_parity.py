#!/usr/bin/env python3
"""Parity of `nopad tokenize` with BERT's uncased WordPiece tokenizer, line by line over data/wiki-sample/wiki_00..03.

Compared against:
  1. `tokenizers.BertWordPieceTokenizer(vocab, lowercase=True, clean_text=True, handle_chinese_chars=True,
     strip_accents=None)` (Hugging Face's Rust implementation): word pieces on every line, ids on a subset.
  2. A compact pure-Python transcription of Google BERT's tokenization.py semantics (`reference_*` below), which uses
     this Python's unicodedata and str.lower() exactly as tokenization.py does: must match on every line.
  3. `transformers.BertTokenizer`, only if transformers is importable (the GPU machine has it).

Allowed divergence from `tokenizers` (counted and printed; any other mismatch fails):
  * final_sigma: Python's str.lower() (and so tokenization.py and nopad) lowers a word-final capital sigma to U+03C2
    "ς"; the Rust crate lowercases character by character and always gives U+03C3 "σ". A mismatch is put in this
    class only if lowering character by character in the reference reproduces the `tokenizers` output exactly.

Environment: NOPAD_BINARY (the nopad executable), NOPAD_SOURCE_DIR (the repository root). Exits non-zero on failure.
"""
import os
import random
import re
import subprocess
import sys
import unicodedata

MAX_WORD_CHARS = 100
ID_SUBSET_LINES = 2000
RANDOM_LINES = 5000


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------------------------
# Reference: Google BERT tokenization.py semantics (BasicTokenizer(do_lower_case=True) + WordpieceTokenizer).

def is_cjk(cp):
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or
            0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or
            0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def is_punct(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def reference_basic(text, char_by_char_lower=False):
    chars = []
    for ch in text:
        cp = ord(ch)
        if ch in "\t\n\r" or unicodedata.category(ch) == "Zs":
            chars.append(" ")
        elif cp == 0 or cp == 0xFFFD or unicodedata.category(ch).startswith("C"):
            continue
        elif is_cjk(cp):
            chars.append(" " + ch + " ")
        else:
            chars.append(ch)
    tokens = []
    for word in "".join(chars).split():
        word = "".join(c.lower() for c in word) if char_by_char_lower else word.lower()
        word = "".join(c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn")
        current = []
        for c in word:
            if is_punct(c):
                if current:
                    tokens.append("".join(current))
                    current = []
                tokens.append(c)
            else:
                current.append(c)
        if current:
            tokens.append("".join(current))
    return " ".join(tokens).split()


def reference_wordpiece(words, vocab):
    out = []
    for word in words:
        if len(word) > MAX_WORD_CHARS:
            out.append("[UNK]")
            continue
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            found = None
            while start < end:
                sub = word[start:end] if start == 0 else "##" + word[start:end]
                if sub in vocab:
                    found = sub
                    break
                end -= 1
            if found is None:
                pieces = ["[UNK]"]
                break
            pieces.append(found)
            start = end
        out.extend(pieces)
    return out


# ---------------------------------------------------------------------------------------------------------------

def run_nopad(binary, vocab_path, lines, pieces, words=False):
    args = [binary, "tokenize", "--vocab", vocab_path] + (["--pieces"] if pieces else []) + (["--words"] if words else [])
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    proc = subprocess.run(args, input=data, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        fail("%s exited with %d: %s" % (" ".join(args), proc.returncode, proc.stderr.decode(errors="replace")))
    out = proc.stdout.decode("utf-8").split("\n")
    if out and out[-1] == "":
        out.pop()
    if len(out) != len(lines):
        fail("nopad tokenize printed %d lines for %d input lines" % (len(out), len(lines)))
    return [o.split(" ") if o else [] for o in out]


def show(line_no, line, got, want, who):
    print("  line %d: %r" % (line_no, line[:200]))
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            print("    first difference at token %d: nopad %r, %s %r" % (i, got[i:i + 5], who, want[i:i + 5]))
            return
    print("    lengths differ: nopad %d tokens, %s %d" % (len(got), who, len(want)))


def main():
    binary = os.environ.get("NOPAD_BINARY")
    source = os.environ.get("NOPAD_SOURCE_DIR")
    if not binary or not source:
        fail("set NOPAD_BINARY (the nopad executable) and NOPAD_SOURCE_DIR (the repository root)")
    try:
        from tokenizers import BertWordPieceTokenizer
    except ImportError:
        fail("the Python package 'tokenizers' is not importable: run `pip install tokenizers`")

    vocab_path = os.path.join(source, "data", "vocab", "bert-uncased-vocab.txt")
    with open(vocab_path, encoding="utf-8") as f:
        vocab_list = [line.rstrip("\n").rstrip("\r") for line in f]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}

    lines = []
    for name in ("wiki_00", "wiki_01", "wiki_02", "wiki_03"):
        with open(os.path.join(source, "data", "wiki-sample", name), encoding="utf-8", newline="") as f:
            text = f.read()
        # Split on '\n' only, as the nopad command does (str.splitlines() would also split on U+2028 etc.).
        file_lines = text.split("\n")
        if file_lines and file_lines[-1] == "":
            file_lines.pop()
        lines.extend(file_lines)

    got = run_nopad(binary, vocab_path, lines, pieces=True)
    n_tokens = sum(len(g) for g in got)
    print("lines: %d, nopad tokens: %d, Unicode (Python unicodedata) %s" %
          (len(lines), n_tokens, unicodedata.unidata_version))
    ok = True

    # 1. Pure-Python reference of tokenization.py: zero mismatches.
    ref_mismatch = 0
    for i, line in enumerate(lines):
        want = reference_wordpiece(reference_basic(line), vocab)
        if got[i] != want:
            ref_mismatch += 1
            if ref_mismatch <= 10:
                show(i + 1, line, got[i], want, "reference")
    print("vs reference (tokenization.py semantics): %d mismatching lines" % ref_mismatch)
    ok &= ref_mismatch == 0

    # 1b. Seeded random lines drawn from all of Unicode (plus the hard cases: capital sigma, marks, Hangul, CJK,
    # case-ignorable punctuation) against the reference only: this exercises every table entry class, while the
    # Rust crate's older Unicode version would differ on recently assigned characters.
    rng = random.Random(20240531)
    pools = [
        lambda: rng.choice("AbcΣσΑΆΈΟΔ   .'-:İıẞß"),
        lambda: chr(rng.choice([0x300, 0x301, 0x308, 0x345, 0x5B0, 0x93C, 0x200B, 0x200D, 0x1D165, 0x1D16D, 0x16FF0])),
        lambda: chr(rng.randrange(0xAC00, 0xD7A4)),
        lambda: chr(rng.randrange(0x4E00, 0xA000)),
        lambda: chr(rng.randrange(0x80, 0x3000)),
        lambda: chr(rng.choice([rng.randrange(0x3000, 0xD800), rng.randrange(0xE000, 0x30000)])),
        lambda: chr(rng.randrange(0x30000, 0x110000)),
    ]
    # The tables were generated from one Unicode version; the reference uses this Python's. Where they differ (the
    # GPU machine's Python 3.12 has Unicode 15), characters assigned after the tables' version would differ by
    # construction, so draw only characters already assigned in Unicode 3.2, whose properties both versions share.
    with open(os.path.join(os.environ["NOPAD_SOURCE_DIR"], "src/data/unicode_tables.inc"), encoding="utf-8") as f:
        tables_version = re.search(r"Unicode ([0-9.]+)", f.readline()).group(1)
    if unicodedata.unidata_version != tables_version:
        print("Python's Unicode %s differs from the tables' %s: random characters limited to Unicode 3.2's" %
              (unicodedata.unidata_version, tables_version))
        stable = lambda c: unicodedata.ucd_3_2_0.category(c) != "Cn"  # noqa: E731
    else:
        stable = lambda c: True  # noqa: E731

    def draw():
        while True:
            c = rng.choice(pools)()
            if stable(c):
                return c

    random_lines = []
    for _ in range(RANDOM_LINES):
        chars = [draw() for _ in range(rng.randrange(1, 40))]
        random_lines.append("".join(c for c in chars if c != "\n"))
    got_random = run_nopad(binary, vocab_path, random_lines, pieces=True)
    got_words = run_nopad(binary, vocab_path, random_lines, pieces=False, words=True)
    random_mismatch = 0
    for i, line in enumerate(random_lines):
        want_words = reference_basic(line)
        want = reference_wordpiece(want_words, vocab)
        if got_random[i] != want or got_words[i] != want_words:
            random_mismatch += 1
            if random_mismatch <= 10:
                show(i + 1, line, got_words[i] + ["|"] + got_random[i], want_words + ["|"] + want, "reference")
    print("random Unicode lines vs reference (words and pieces): %d of %d mismatching" %
          (random_mismatch, len(random_lines)))
    ok &= random_mismatch == 0

    # 2. Hugging Face tokenizers.
    hf = BertWordPieceTokenizer(vocab_path, lowercase=True, clean_text=True, handle_chinese_chars=True,
                                strip_accents=None)
    encodings = hf.encode_batch(lines, add_special_tokens=False)
    classes = {"final_sigma": 0}
    unexplained = 0
    for i, (line, enc) in enumerate(zip(lines, encodings)):
        if got[i] == enc.tokens:
            continue
        if reference_wordpiece(reference_basic(line, char_by_char_lower=True), vocab) == enc.tokens:
            classes["final_sigma"] += 1
            continue
        unexplained += 1
        if unexplained <= 10:
            show(i + 1, line, got[i], enc.tokens, "tokenizers")
    print("vs tokenizers %s: %d unexplained mismatching lines; allowed classes: %s" %
          (__import__("tokenizers").__version__, unexplained, classes))
    ok &= unexplained == 0

    # Ids on a subset (the first lines of every file region).
    subset = list(range(0, len(lines), max(1, len(lines) // ID_SUBSET_LINES)))
    sub_lines = [lines[i] for i in subset]
    got_ids = run_nopad(binary, vocab_path, sub_lines, pieces=False)
    id_mismatch = 0
    for k, i in enumerate(subset):
        want_ids = [str(v) for v in encodings[i].ids]
        if got_ids[k] != want_ids and got[i] == encodings[i].tokens:
            id_mismatch += 1
            if id_mismatch <= 10:
                show(i + 1, lines[i], got_ids[k], want_ids, "tokenizers ids")
        # Ids must also be the vocabulary positions of the printed pieces.
        if [vocab_list[int(t)] for t in got_ids[k]] != got[i]:
            id_mismatch += 1
            print("  line %d: ids and pieces of nopad disagree" % (i + 1))
    print("ids on %d lines: %d mismatching lines" % (len(subset), id_mismatch))
    ok &= id_mismatch == 0

    # 3. Optional: transformers' BertTokenizer (pure Python before transformers 5; backed by `tokenizers` since,
    # which lower-cases character by character: the same final-sigma class as above is allowed, nothing else).
    try:
        import transformers
        from transformers import BertTokenizer
    except ImportError:
        print("transformers not importable: BertTokenizer comparison skipped (optional)")
    else:
        slow = BertTokenizer(vocab_path, do_lower_case=True)
        slow_unexplained, slow_sigma = 0, 0
        for i, line in enumerate(lines):
            want = slow.tokenize(line)
            if got[i] == want:
                continue
            if reference_wordpiece(reference_basic(line, char_by_char_lower=True), vocab) == want:
                slow_sigma += 1
                continue
            slow_unexplained += 1
            if slow_unexplained <= 10:
                show(i + 1, line, got[i], want, "BertTokenizer")
        print("vs transformers %s BertTokenizer: %d unexplained mismatching lines; allowed classes: "
              "{'final_sigma': %d}" % (transformers.__version__, slow_unexplained, slow_sigma))
        ok &= slow_unexplained == 0

    if not ok:
        fail("tokenizer parity failed (see above)")
    print("PASS")


if __name__ == "__main__":
    main()
