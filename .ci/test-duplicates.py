#!/usr/bin/env python3
"""Count the runs of repeated lines between the end-to-end test files.

CI (`.ci/run`) keeps the code that the end-to-end tests write again low: a helper that two test
files both need belongs in the test kit (`tests/src/`), not pasted into each. This script reads
every `*.rs` file under `tests/tests/` (recursively) and counts the runs of at least six
consecutive significant lines that two different files share. Python 3, standard library only.

The rule:

* Lines are normalized first: white space is stripped at both ends and folded inside; blank
  lines, comment lines (starting with `//` or `/*`), `use ...;` items (also spread over several
  lines) and lines of punctuation only (`}`, `});`, `)`, `],`, `})?;` ...) are dropped. What is
  left are a file's significant lines, each keeping its line number for the report.
* By default lines are compared by shape: string and char literals become `S`, numbers `N` and
  every identifier that is not a Rust keyword `I`, so `.dialect("vllm")` and `.dialect(name)`
  are different, but `fleet_with("a", 1)` and `start_with("b", 2)` are the same. `--exact`
  compares the normalized lines to the letter instead.
* A run is a maximal stretch of at least 6 (`--min-lines`) consecutive significant lines that
  stands, line for line, in two different files. Each maximal run counts once per pair of files;
  a file repeating itself is not counted, and where one file repeats itself, a stretch of the
  other that matches both copies counts once (the longest of overlapping runs is kept).
* Runs that are too common to mean anything are skipped, as the developers' `duplicates` tool
  does: a window of 6 lines that stands in more than 8 places (`--max-places`, all files and
  positions together) does not start a run, so a run made only of such windows is not counted;
  a longer run goes on over up to 5 of them in a row and still counts once, whole.

Output: one line per pair of files with the line ranges of its runs (`a.rs:10-24~b.rs:40-54`),
most runs first, then the total. Exit status 1 when the total is above `--max N`, 0 otherwise
(also when `--max` is not given). Deterministic: files, pairs and runs are sorted.

Run it locally from the repository root:

    python3 .ci/test-duplicates.py --max 40     # what CI runs
    python3 .ci/test-duplicates.py --exact      # identical lines only
    python3 .ci/test-duplicates.py --self-test  # the script's own check

The developers' `duplicates` tool, where it is installed, gives the fuller picture (all of the
tree, same-file repeats, boilerplate marked): `duplicates --repo tests --most 200`.
"""

import argparse
import os
import re
import sys
import tempfile
from collections import defaultdict

MIN_LINES = 6
MAX_PLACES = 8

_USE = re.compile(r"^(pub(\([^)]*\))?\s+)?use\s")
_WORDY = re.compile(r"[\w\"']")
_SPACE = re.compile(r"\s+")
# Shape tokens, in order: strings (with escapes), char literals, numbers, identifiers.
_TOKEN = re.compile(
    r'"(?:\\.|[^"\\])*"?'
    r"|'(?:\\.|[^'\\])'"
    r"|\b\d[\w.]*"
    r"|\b[A-Za-z_]\w*"
)
_KEYWORDS = frozenset(
    "as async await break const continue crate dyn else enum extern false fn for if impl in "
    "let loop match mod move mut pub ref return self Self static struct super trait true type "
    "unsafe use where while".split()
)


def _shape_token(match):
    tok = match.group(0)
    if tok[0] in "\"'":
        return "S"
    if tok[0].isdigit():
        return "N"
    return tok if tok in _KEYWORDS else "I"


def significant_lines(text, shape):
    """The (line number, normalized line) pairs of a file that take part in runs."""
    out = []
    in_use = False
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _SPACE.sub(" ", raw.strip())
        if in_use:
            in_use = not line.endswith(";")
            continue
        if not line or line.startswith("//") or line.startswith("/*"):
            continue
        if _USE.match(line):
            in_use = not line.endswith(";")
            continue
        if not _WORDY.search(line):
            continue
        if shape:
            line = _TOKEN.sub(_shape_token, line)
        out.append((number, line))
    return out


def find_runs(files, min_lines=MIN_LINES, max_places=MAX_PLACES):
    """Maximal shared runs between different files.

    `files` maps a name to its significant lines. Returns {(name_a, name_b): [run, ...]} with
    name_a < name_b and each run (a_first, a_last, b_first, b_last) in original line numbers.
    """
    names = sorted(files)
    places = defaultdict(list)  # window of min_lines lines -> [(file index, position)]
    for fi, name in enumerate(names):
        lines = [text for _, text in files[name]]
        for pos in range(len(lines) - min_lines + 1):
            places[tuple(lines[pos:pos + min_lines])].append((fi, pos))

    # Matching window starts, per pair of files and per diagonal (pos_b - pos_a).
    hits = defaultdict(list)
    for spots in places.values():
        if len(spots) < 2 or len(spots) > max_places:
            continue
        for i, (fa, pa) in enumerate(spots):
            for fb, pb in spots[i + 1:]:
                if fa != fb:
                    hits[(fa, fb, pb - pa)].append(pa)

    runs = defaultdict(list)
    for (fa, fb, diag), starts in hits.items():
        starts.sort()
        # Windows on one diagonal at most min_lines apart overlap or touch: every line between
        # them matches too, so they belong to one run.
        first = last = starts[0]
        for pos in starts[1:] + [None]:
            if pos is not None and pos - last <= min_lines:
                last = pos
                continue
            a, b = files[names[fa]], files[names[fb]]
            end = last + min_lines - 1
            runs[(names[fa], names[fb])].append(
                (a[first][0], a[end][0], b[first + diag][0], b[end + diag][0])
            )
            if pos is not None:
                first = last = pos
    return {pair: _once_per_place(found) for pair, found in runs.items()}


def _once_per_place(found):
    """Longest first, drop the runs that overlap a kept one on either side: where one file
    repeats itself, a stretch of the other matching it twice counts once."""
    kept = []
    for run in sorted(found, key=lambda r: (r[0] - r[1], r)):
        a1, a2, b1, b2 = run
        if not any(a1 <= k[1] and k[0] <= a2 or b1 <= k[3] and k[2] <= b2 for k in kept):
            kept.append(run)
    return sorted(kept)


def test_files(root):
    """Every *.rs file under root/tests/tests, as paths relative to root, sorted."""
    found = []
    for folder, dirs, names in os.walk(os.path.join(root, "tests", "tests")):
        dirs.sort()
        for name in names:
            if name.endswith(".rs"):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


def count(root, shape=True, min_lines=MIN_LINES, max_places=MAX_PLACES, out=None):
    """Print the report for the tree at root and return the total number of runs."""
    files = {}
    for rel in test_files(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            files[rel] = significant_lines(f.read(), shape)
    runs = find_runs(files, min_lines, max_places)
    total = sum(len(r) for r in runs.values())
    if out is not None:
        for (a, b), found in sorted(runs.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            ranges = ", ".join(f"{a}:{a1}-{a2}~{b}:{b1}-{b2}" for a1, a2, b1, b2 in found)
            print(f"{len(found)} run{'s' if len(found) > 1 else ''}: {ranges}", file=out)
        mode = "same shape" if shape else "identical"
        print(
            f"{total} runs of {min_lines}+ {mode} lines in {len(runs)} pairs of files "
            f"({len(files)} files under tests/tests)",
            file=out,
        )
    return total


def self_test():
    """Two files sharing one run of 8 significant lines (around blank, comment, use and
    punctuation lines that must not matter) count 1, in either mode; a shared 5-line stretch counts nothing; a run standing in 9
    places counts nothing."""
    shared = [
        "let f = Fleet::builder()",
        "    .dialect(\"vllm\")",
        "    .prefill(1)",
        "",
        "    // a comment that only one side has",
        "    .decode(1)",
        "    .start()",
        "    .await;",
        "assert_eq!(f.engines().len(), 2);",
    ]
    short = ["let a = 1;", "let b = 2;", "let c = 3;", "let d = 4;", "let e = 5;"]
    common = ["x();", "y();", "z();", "w();", "v();", "u();"]

    # Between the parts a line of a different shape on each side, so no run goes on past them.
    def body(own, cut):
        lines = ["use std::time::Duration;", "use foo::{", "    a, b,", "};", "", cut]
        lines += ["fn shared() {"] + shared + ["}", "", cut] + short + [cut] + common
        return "\n".join(lines) + "\n"

    with tempfile.TemporaryDirectory() as root:
        folder = os.path.join(root, "tests", "tests", "e2e")
        os.makedirs(folder)
        with open(os.path.join(folder, "a.rs"), "w", encoding="utf-8") as f:
            f.write(body("alpha", "let alpha = 1;"))
        with open(os.path.join(folder, "b.rs"), "w", encoding="utf-8") as f:
            f.write(body("beta", "if beta { return; }"))
        for i in range(7):  # with a.rs and b.rs, `common` stands in 9 places
            with open(os.path.join(folder, f"c{i}.rs"), "w", encoding="utf-8") as f:
                f.write("\n".join(common) + "\n")
        for shape in (False, True):
            total = count(root, shape=shape)
            assert total == 1, f"self-test: {total} runs with shape={shape}, expected 1"
        files = {
            rel: significant_lines(open(os.path.join(root, rel), encoding="utf-8").read(), False)
            for rel in test_files(root)
        }
        runs = find_runs(files)
        expected = {("tests/tests/e2e/a.rs", "tests/tests/e2e/b.rs"): [(7, 16, 7, 16)]}
        assert runs == expected, f"self-test: runs {runs}, expected {expected}"
    print("self-test: ok")


def main():
    parser = argparse.ArgumentParser(
        description="Count runs of 6+ shared lines between the end-to-end test files "
        "(tests/tests/**/*.rs); see the docstring for the rule."
    )
    parser.add_argument("--max", type=int, help="exit 1 when the total is above this")
    parser.add_argument("--exact", action="store_true", help="identical lines only, no shape")
    parser.add_argument("--min-lines", type=int, default=MIN_LINES, help="default %(default)s")
    parser.add_argument(
        "--max-places", type=int, default=MAX_PLACES,
        help="skip windows standing in more places (default %(default)s)",
    )
    parser.add_argument(
        "--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
        help="repository root (default: the one holding this script)",
    )
    parser.add_argument("--self-test", action="store_true", help="run the script's own check")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return 0
    total = count(
        os.path.normpath(args.root), not args.exact, args.min_lines, args.max_places, sys.stdout
    )
    if args.max is not None and total > args.max:
        print(
            f"error: {total} repeated runs between end-to-end test files, at most {args.max}: "
            "move what the files share into the test kit (tests/src/)"
        )
        return 1
    if args.max is not None:
        print(f"ok: at most {args.max}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
