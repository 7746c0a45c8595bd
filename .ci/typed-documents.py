#!/usr/bin/env python3
"""Hold the typed-documents rule: few `json!` in product code, few string-key lookups in tests.

Documents are typed end to end (docs/testing.md, "Typed documents"): the product builds its
journal rows, error bodies and control bodies from serde types, and tests read documents through
typed readers (the shared document types and the test kit's), not by `v["key"]`. A `json!` is
left in product code only where the document is genuinely open (an engine's answer being
merged, the client's body copied into an engine request, a JSON Schema); a string-key lookup is
left in a test only where the test is about the wire shape itself. This script counts both so
that the count cannot creep back up unnoticed. Python 3, standard library only.

What it counts:

* `json!` in product code: every `json!(` / `json! (` in the `.rs` files of the product crates
  (`shared/`, `router/` with `router/relay/` and `router/lease/`, `engine-agent/`), leaving out
  test code: files under a `tests/` folder, files named `tests.rs` or ending `_tests.rs`, and
  every item marked `#[cfg(test)]` (its braces matched; strings, chars and comments skipped).
* String-key lookups in tests: every `x["key"]` indexing (an identifier, `)` or `]` directly
  before `["name"]`) in the integration tests, the `.rs` files under `tests/tests/` and under
  each product crate's `tests/` folder. Array literals such as `&["a", "b"]` and `args(["x"])`
  are not lookups and are not counted.

Output: the two totals, after every place when a total is over its bound or with `--list`. Exit status 1 when a total is above its bound
(`--max-json`, `--max-lookups`), 0 otherwise.

    python3 .ci/typed-documents.py --max-json 20 --max-lookups 20   # what CI runs
    python3 .ci/typed-documents.py --list       # every place
    python3 .ci/typed-documents.py --self-test
"""

import argparse
import os
import re
import sys
import tempfile

PRODUCT = ["shared", "router", "engine-agent"]
TEST_ROOTS = ["tests/tests", "shared/tests", "router/tests", "router/relay/tests",
              "router/lease/tests", "engine-agent/tests"]
JSON_MACRO = re.compile(r"\bjson!\s*\(")
LOOKUP = re.compile(r'(?<=[\w\)\]])\[\s*"[A-Za-z_][A-Za-z0-9_]*"\s*\]')
CFG_TEST = re.compile(r"#\[cfg\(test\)\]")


def blank_literals(src):
    """`src` with the insides of comments, strings and chars replaced by spaces (newlines kept),
    so braces and macros in them are not seen."""
    out = list(src)
    i, n = 0, len(src)

    def blank(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:i + 10]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', src[i:]).group(1)
            end = '"' + hashes
            j = src.find(end, i + 2 + len(hashes))
            j = n if j < 0 else j + len(end)
            blank(i + 1, j - 1)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", src[i:i + 4]) or (c == "'" and src.startswith("'\\u{", i)):
            j = src.find("'", i + 1 if src[i + 1] != "\\" else i + 2)
            blank(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def strip_cfg_test(src):
    """`src` without the items marked `#[cfg(test)]` (their text replaced by newlines)."""
    code = blank_literals(src)
    spans = []
    for m in CFG_TEST.finditer(code):
        i = m.end()
        while i < len(code) and code[i] not in "{;":
            i += 1
        if i >= len(code):
            break
        if code[i] == ";":
            spans.append((m.start(), i + 1))
            continue
        depth = 0
        while i < len(code):
            if code[i] == "{":
                depth += 1
            elif code[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        spans.append((m.start(), i + 1))
    out = code
    for a, b in reversed(spans):
        out = out[:a] + "\n" * out[a:b].count("\n") + out[b:]
    return out


def is_test_path(path):
    parts = path.split(os.sep)
    name = parts[-1]
    return "tests" in parts[:-1] or name == "tests.rs" or name.endswith("_tests.rs")


def rust_files(root):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "target" and not x.startswith("."))
        for f in sorted(files):
            if f.endswith(".rs"):
                yield os.path.join(d, f)


CFG_TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")


def test_module_files(path, src):
    """The files of the modules `path` declares `#[cfg(test)] mod name;` (test code)."""
    d, name = os.path.split(path)
    stem = name[:-3]
    base = d if name in ("mod.rs", "lib.rs", "main.rs") else os.path.join(d, stem)
    out = set()
    for m in CFG_TEST_MOD.finditer(blank_literals(src)):
        out.add(os.path.join(base, m.group(1) + ".rs"))
        out.add(os.path.join(base, m.group(1), "mod.rs"))
    return out


def json_places(repo):
    places = []
    for crate in PRODUCT:
        files = list(rust_files(os.path.join(repo, crate)))
        test_files = set()
        for p in files:
            test_files |= test_module_files(p, open(p, encoding="utf-8").read())
        for p in files:
            rel = os.path.relpath(p, repo)
            if is_test_path(rel) or rel.startswith("tests" + os.sep) or p in test_files:
                continue
            code = strip_cfg_test(open(p, encoding="utf-8").read())
            for m in JSON_MACRO.finditer(code):
                places.append(f"{rel}:{code.count(chr(10), 0, m.start()) + 1}")
    return places


def lookup_places(repo):
    places = []
    for root in TEST_ROOTS:
        full = os.path.join(repo, root)
        if not os.path.isdir(full):
            continue
        for p in rust_files(full):
            rel = os.path.relpath(p, repo)
            code = open(p, encoding="utf-8").read()
            for m in LOOKUP.finditer(code):
                places.append(f"{rel}:{code.count(chr(10), 0, m.start()) + 1}")
    return places


def self_test():
    with tempfile.TemporaryDirectory() as repo:
        def write(rel, text):
            p = os.path.join(repo, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "w", encoding="utf-8").write(text)
        write("router/src/a.rs", 'fn f() { json!({"a": 1}); let s = "json!(no)"; }\n'
              '// json!(comment)\n#[cfg(test)]\nmod t { fn g() { json!(1); let c = \'}\'; } }\n'
              'fn h() { json! ({}); }\n')
        write("router/src/tests.rs", "fn x() { json!(1); }\n")
        write("shared/src/b.rs", '#[cfg(test)]\nfn only_test() { json!(2); }\nfn p() { json!(3); }\n'
              '#[cfg(test)]\nmod golden;\n')
        write("shared/src/b/golden.rs", "fn g() { json!(4); }\n")
        write("router/tests/serve.rs", 'fn t() { v["a"]["b"]; args(["x"]); &["y"]; f()["z"]; }\n')
        write("tests/tests/e2e/x.rs", 'fn t() { doc.rows[0]["k"]; m[ "n" ]; let a = ["p"]; }\n')
        j, k = json_places(repo), lookup_places(repo)
        assert sorted(j) == ["router/src/a.rs:1", "router/src/a.rs:5", "shared/src/b.rs:3"], j
        assert len(k) == 5, k
    print("typed-documents self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-json", type=int)
    ap.add_argument("--max-lookups", type=int)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--list", action="store_true", help="print every place, not only the totals")
    ap.add_argument("--repo", default=".")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return 0
    j, k = json_places(a.repo), lookup_places(a.repo)
    over_json = a.max_json is not None and len(j) > a.max_json
    over_lookups = a.max_lookups is not None and len(k) > a.max_lookups
    if a.list or over_json or over_lookups:
        for p in j:
            print(f"json! {p}")
        for p in k:
            print(f"lookup {p}")
    print(f"{len(j)} json! in product code; {len(k)} string-key lookups in tests")
    bad = False
    if over_json:
        print(f"error: {len(j)} json! in product code, at most {a.max_json}: build the document "
              "from a serde type (docs/testing.md, \"Typed documents\")")
        bad = True
    if over_lookups:
        print(f"error: {len(k)} string-key lookups in tests, at most {a.max_lookups}: read the "
              "document through a typed reader (docs/testing.md, \"Typed documents\")")
        bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
