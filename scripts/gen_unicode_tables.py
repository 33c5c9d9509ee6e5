#!/usr/bin/env python3
"""Generates src/data/unicode_tables.inc: the Unicode data the WordPiece tokenizer needs, without ICU.

The tables reproduce what Google BERT's tokenization.py computes with Python's unicodedata and str.lower(), so they
are derived from the running Python's Unicode database (the version is written into the output):

  * kCharFlags (two-stage table, 256 code points per block): one byte of flags per code point
      DROP     U+0000, U+FFFD and category C* except \\t \\n \\r        (clean_text removes them)
      SPACE    \\t \\n \\r, category Zs, and what str.split() also splits on (Zl, Zp)
      PUNCT    category P* or ASCII 33-47, 58-64, 91-96, 123-126
      MAPPED   NFD(c.lower()) != c  (see kMapIndex / kMapPool; Hangul syllables are decomposed in C++)
      MN       category Mn (dropped after NFD)
      IGN      Case_Ignorable, as CPython's final-sigma rule sees it
      CASED    Cased and not Case_Ignorable, as CPython's final-sigma rule sees it
      REORDER  not Mn but canonical combining class != 0 (so NFD may reorder it; rare: a few Mc)
  * kMapIndex / kMapPool: sorted {cp, offset, len} entries giving NFD(c.lower()) for every MAPPED code point.
    Combining marks are kept here and dropped afterwards, so canonical reordering stays exact.
  * kCombiningClass: sorted {first, last, ccc} ranges of nonzero canonical combining classes (for reordering).

Final sigma: CPython lowers U+03A3 to U+03C2 when a Cased character precedes it (skipping Case_Ignorable ones) and
no Cased character follows it (skipping Case_Ignorable ones). unicodedata does not expose Cased/Case_Ignorable, so
they are measured through str.lower() itself, which makes them exact for this Python:
    "A" + c + "Σ" ends in "ς"  <=>  IGN(c) or CASED(c)
    c + "Σ"       ends in "ς"  <=>  CASED(c) (and c not IGN)
Only "CASED among non-ignorable" is ever consulted by the rule, which is exactly what the second probe gives.

Usage: python3 scripts/gen_unicode_tables.py [output]   (default: src/data/unicode_tables.inc)
"""
import os
import sys
import unicodedata

DROP, SPACE, PUNCT, MAPPED, MN, IGN, CASED, REORDER = (1 << i for i in range(8))
MAX_CP = 0x110000
BLOCK = 256


def is_surrogate(cp):
    return 0xD800 <= cp <= 0xDFFF


def flags_of(cp):
    ch = chr(cp)
    cat = unicodedata.category(ch)
    f = 0
    if ch in "\t\n\r":
        f |= SPACE
    elif cp == 0 or cp == 0xFFFD or cat.startswith("C"):
        f |= DROP
    elif cat == "Zs" or ch.isspace():
        # BERT maps Zs to ' ' and then splits with str.split(), which also splits on Zl/Zp (U+2028, U+2029).
        f |= SPACE
    if cat.startswith("P") or 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        f |= PUNCT
    if cat == "Mn":
        f |= MN
    elif unicodedata.combining(ch) != 0:
        f |= REORDER
    if not (0xAC00 <= cp <= 0xD7A3):  # Hangul syllables: decomposed algorithmically
        if unicodedata.normalize("NFD", ch.lower()) != ch:
            f |= MAPPED
    else:
        f |= MAPPED
    ign_or_cased = ("A" + ch + "\u03a3").lower().endswith("\u03c2")
    cased = (ch + "\u03a3").lower().endswith("\u03c2")
    if cased:
        f |= CASED
    elif ign_or_cased:
        f |= IGN
    return f


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "src", "data", "unicode_tables.inc")

    flags = [0] * MAX_CP
    for cp in range(MAX_CP):
        if is_surrogate(cp):
            flags[cp] = DROP  # never produced by the decoder; category Cs anyway
        else:
            flags[cp] = flags_of(cp)

    # Two-stage table with deduplicated blocks.
    blocks, block_index, stage1 = [], {}, []
    for b in range(MAX_CP // BLOCK):
        key = bytes(flags[b * BLOCK:(b + 1) * BLOCK])
        if key not in block_index:
            block_index[key] = len(blocks)
            blocks.append(key)
        stage1.append(block_index[key])

    # Mapping: NFD(lower(c)) for every MAPPED code point except Hangul syllables.
    index, pool = [], []
    for cp in range(MAX_CP):
        if is_surrogate(cp) or 0xAC00 <= cp <= 0xD7A3 or not flags[cp] & MAPPED:
            continue
        m = [ord(c) for c in unicodedata.normalize("NFD", chr(cp).lower())]
        index.append((cp, len(pool), len(m)))
        pool.extend(m)
    assert max(l for _, _, l in index) < 256 and len(pool) < (1 << 24)

    ccc_ranges = []
    for cp in range(MAX_CP):
        if is_surrogate(cp):
            continue
        c = unicodedata.combining(chr(cp))
        if c == 0:
            continue
        if ccc_ranges and ccc_ranges[-1][1] == cp - 1 and ccc_ranges[-1][2] == c:
            ccc_ranges[-1][1] = cp
        else:
            ccc_ranges.append([cp, cp, c])

    def rows(values, per_line):
        vals = [str(v) for v in values]
        return "\n".join("    " + ",".join(vals[i:i + per_line]) + "," for i in range(0, len(vals), per_line))

    lines = [
        "// Generated by scripts/gen_unicode_tables.py from Python %s's unicodedata (Unicode %s). Do not edit."
        % (sys.version.split()[0], unicodedata.unidata_version),
        "// Regenerate: python3 scripts/gen_unicode_tables.py. Included once, by src/data/unicode.cpp.",
        "// Flags: see the generator's docstring and src/data/unicode.h.",
        "#define NOPAD_UNICODE_VERSION \"%s\"" % unicodedata.unidata_version,
        "constexpr int kFlagBlockShift = 8;",
        "constexpr uint16_t kFlagStage1[%d] = {" % len(stage1),
        rows(stage1, 32),
        "};",
        "constexpr uint8_t kFlagStage2[%d] = {" % (len(blocks) * BLOCK),
        rows([v for blk in blocks for v in blk], 64),
        "};",
        "struct MapEntry { uint32_t cp; uint32_t offset : 24; uint32_t len : 8; };",
        "constexpr MapEntry kMapIndex[%d] = {" % len(index),
        rows(["{%d,%d,%d}" % e for e in index], 12),
        "};",
        "constexpr uint32_t kMapPool[%d] = {" % len(pool),
        rows(pool, 24),
        "};",
        "struct CccRange { uint32_t first, last; uint8_t ccc; };",
        "constexpr CccRange kCombiningClass[%d] = {" % len(ccc_ranges),
        rows(["{%d,%d,%d}" % tuple(r) for r in ccc_ranges], 8),
        "};",
        "",
    ]
    with open(out_path, "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(lines))
    print("%s: %d blocks, %d mapped code points, pool %d, %d ccc ranges, %d bytes" %
          (out_path, len(blocks), len(index), len(pool), len(ccc_ranges), os.path.getsize(out_path)))


if __name__ == "__main__":
    main()
