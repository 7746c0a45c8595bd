//! The module graph check: the router's modules depend on each other in one direction. It reads
//! every file under `router/src` (binaries aside), collects the module paths each one names (`use`
//! trees and inline `crate::` / `super::` / `self::` paths, test modules left out), and fails when
//! - the top-level modules (`fleet`, `lifecycle`, `ha`, ..., and the crate root) form a cycle,
//! - or, inside one top-level module, its files do (edges between a module and its own
//!   ancestors are structure, not layering: a parent re-exports its children's items).
//!
//! The failure names every module of the cycle and, for each edge, the file and line that
//! makes it. The design note in `lib.rs` lists the intended layers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One `a -> b` dependency and where it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Edge {
    from: String,
    to: String,
    at: String,
}

/// The module path of a file under `src/` (`lib.rs` is the crate root, `""`).
fn module_of(rel: &str) -> String {
    let rel = rel.trim_end_matches(".rs");
    let rel = rel.strip_suffix("/mod").unwrap_or(rel);
    if rel == "lib" {
        return String::new();
    }
    rel.replace('/', "::")
}

/// The source with comments, string and char literals blanked (line breaks kept, so line
/// numbers stay right).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'"' | b'#')) && !ident_before(b, i) {
            // Raw string r"..." / r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let end = b[j + 1..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |p| j + 1 + p + close.len());
            for &x in &b[i..end] {
                blank(&mut out, x);
            }
            i = end;
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if c == b'\'' && (b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\')) {
            // A char literal ('x', '\n', '\u{..}'); a lifetime has no closing quote.
            let end = b[i + 1..]
                .iter()
                .skip(1)
                .position(|&x| x == b'\'')
                .map_or(b.len(), |p| i + 3 + p);
            for &x in &b[i..end.min(b.len())] {
                blank(&mut out, x);
            }
            i = end;
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Blanks every `#[cfg(test)] mod <name> { ... }` block (test code may use any layer).
fn drop_test_modules(src: &str) -> String {
    let mut s = src.to_string();
    while let Some(at) = find_test_module(&s) {
        let Some(open) = s[at..].find('{').map(|p| at + p) else {
            break;
        };
        let mut depth = 0;
        let mut end = s.len();
        for (k, ch) in s[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        let blanked: String = s[at..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        s.replace_range(at..end, &blanked);
    }
    s
}

fn find_test_module(s: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(p) = s[from..].find("#[cfg(test)]") {
        let at = from + p;
        let rest = s[at + "#[cfg(test)]".len()..].trim_start();
        let rest = rest
            .strip_prefix("pub(crate)")
            .or_else(|| rest.strip_prefix("pub"))
            .unwrap_or(rest)
            .trim_start();
        if rest.starts_with("mod ")
            && rest
                .split(['{', ';'])
                .next()
                .is_some_and(|h| rest.len() > h.len() && rest.as_bytes()[h.len()] == b'{')
        {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// Expands a `use` tree (`a::{b, c::{d as e, *}}`) into full paths.
fn expand_use(tree: &str) -> Vec<Vec<String>> {
    fn parse(s: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
        let s = s.trim();
        if s.is_empty() {
            return;
        }
        // Split at the first top-level `{`.
        if let Some(open) = s.find('{') {
            let head: Vec<String> = s[..open]
                .split("::")
                .map(str::trim)
                .filter(|x| !x.is_empty())
                .map(String::from)
                .collect();
            let close = s.rfind('}').unwrap_or(s.len());
            let inner = &s[open + 1..close];
            let mut base = prefix.to_vec();
            base.extend(head);
            let mut depth = 0;
            let mut start = 0;
            for (k, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        parse(&inner[start..k], &base, out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            parse(&inner[start..], &base, out);
        } else {
            let s = s.split(" as ").next().unwrap_or(s);
            let mut path = prefix.to_vec();
            path.extend(
                s.split("::")
                    .map(str::trim)
                    .filter(|x| !x.is_empty() && *x != "*" && *x != "self")
                    .map(String::from),
            );
            out.push(path);
        }
    }
    let mut out = Vec::new();
    parse(tree, &[], &mut out);
    out
}

/// The module a path names, from module `here`; `None` for paths outside the crate.
fn resolve(here: &str, path: &[String], modules: &BTreeSet<String>) -> Option<String> {
    let mut base: Vec<String> = if here.is_empty() {
        Vec::new()
    } else {
        here.split("::").map(String::from).collect()
    };
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        Some("self") => rest = &rest[1..],
        Some(first) => {
            // A child module named without `self::` (`use machine::Lifecycle` in
            // `lifecycle.rs`); anything else is another crate.
            let mut child = base.clone();
            child.push(first.to_string());
            if !modules.contains(&child.join("::")) {
                return None;
            }
        }
        None => return None,
    }
    // The longest prefix that is a module.
    let mut target = base.join("::");
    for seg in rest {
        let mut next = if target.is_empty() {
            String::new()
        } else {
            format!("{target}::")
        };
        next.push_str(seg);
        if modules.contains(&next) {
            target = next;
        } else {
            break;
        }
    }
    Some(target)
}

/// Every edge the sources (module path → text) make.
fn edges(sources: &BTreeMap<String, String>) -> Vec<Edge> {
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    let mut out = Vec::new();
    for (module, text) in sources {
        let code = drop_test_modules(&strip(text));
        let line_of = |pos: usize| code[..pos].matches('\n').count() + 1;
        let mut push = |path: &[String], pos: usize| {
            if let Some(to) = resolve(module, path, &modules)
                && to != *module
            {
                out.push(Edge {
                    from: module.clone(),
                    to,
                    at: format!("{}:{}", file_of(module), line_of(pos)),
                });
            }
        };
        // `use` trees.
        let mut uses = Vec::new();
        let mut from = 0;
        while let Some(p) = code[from..].find("use ") {
            let at = from + p;
            from = at + 4;
            if ident_before(code.as_bytes(), at) {
                continue;
            }
            let Some(end) = code[at..].find(';').map(|e| at + e) else {
                break;
            };
            for path in expand_use(&code[at + 4..end]) {
                push(&path, at);
            }
            uses.push(at..end);
        }
        // Inline paths outside `use` statements.
        for anchor in ["crate::", "super::", "self::"] {
            let mut from = 0;
            while let Some(p) = code[from..].find(anchor) {
                let at = from + p;
                from = at + anchor.len();
                if ident_before(code.as_bytes(), at) || uses.iter().any(|r| r.contains(&at)) {
                    continue;
                }
                let path: Vec<String> = code[at..]
                    .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .next()
                    .unwrap_or("")
                    .split("::")
                    .filter(|x| !x.is_empty())
                    .map(String::from)
                    .collect();
                push(&path, at);
            }
        }
    }
    out
}

fn file_of(module: &str) -> String {
    if module.is_empty() {
        "lib.rs".into()
    } else {
        format!("{}.rs", module.replace("::", "/"))
    }
}

/// A cycle in `edges` over nodes named by `node`, if any: the nodes in order and the edge
/// locations that close it. Edges `keep` rejects are ignored.
fn find_cycle(
    edges: &[Edge],
    node: impl Fn(&str) -> String,
    keep: impl Fn(&str, &str) -> bool,
) -> Option<Vec<String>> {
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for e in edges {
        let (a, b) = (node(&e.from), node(&e.to));
        if a != b && keep(&e.from, &e.to) {
            graph.entry(a).or_default().entry(b).or_insert(e.at.clone());
        }
    }
    // Depth-first search with colours; report the first back edge's cycle.
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeMap<String, String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for (m, _) in graph.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                0 => {
                    if let Some(c) = visit(m, graph, state, stack) {
                        return Some(c);
                    }
                }
                1 => {
                    let from = stack.iter().position(|x| x == m).unwrap_or(0);
                    let mut cycle: Vec<String> = stack[from..].to_vec();
                    cycle.push(m.clone());
                    return Some(
                        cycle
                            .windows(2)
                            .map(|w| {
                                let at = &graph[&w[0]][&w[1]];
                                format!("{} -> {} ({at})", show(&w[0]), show(&w[1]))
                            })
                            .collect(),
                    );
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            let mut stack = Vec::new();
            if let Some(c) = visit(n, &graph, &mut state, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

fn show(module: &str) -> &str {
    if module.is_empty() { "crate" } else { module }
}

fn top(module: &str) -> String {
    module.split("::").next().unwrap_or("").to_string()
}

fn is_ancestor(a: &str, b: &str) -> bool {
    a.is_empty() || b == a || b.starts_with(&format!("{a}::"))
}

/// Checks the sources; `Err` lists each cycle found, one edge per line.
fn check(sources: &BTreeMap<String, String>) -> Result<(), Vec<String>> {
    let edges = edges(sources);
    let mut cycles = Vec::new();
    if let Some(c) = find_cycle(&edges, top, |_, _| true) {
        cycles.push(format!("top-level modules:\n  {}", c.join("\n  ")));
    }
    let tops: BTreeSet<String> = sources.keys().map(|m| top(m)).collect();
    for t in tops.iter().filter(|t| !t.is_empty()) {
        let inside: Vec<Edge> = edges
            .iter()
            .filter(|e| top(&e.from) == *t && top(&e.to) == *t)
            .cloned()
            .collect();
        let keep = |a: &str, b: &str| !is_ancestor(a, b) && !is_ancestor(b, a);
        if let Some(c) = find_cycle(&inside, str::to_string, keep) {
            cycles.push(format!("inside {t}:\n  {}", c.join("\n  ")));
        }
    }
    if cycles.is_empty() {
        Ok(())
    } else {
        Err(cycles)
    }
}

/// Reads `router/src` (without `bin/`) as module path → text.
fn read_tree(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<String, String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .expect("read src dir")
            .filter_map(Result::ok)
            .collect();
        entries.sort_by_key(|e| e.path());
        for e in entries {
            let p = e.path();
            let rel = p
                .strip_prefix(root)
                .expect("under src")
                .to_string_lossy()
                .replace('\\', "/");
            if p.is_dir() {
                if rel != "bin" {
                    walk(&p, root, out);
                }
            } else if rel.ends_with(".rs") {
                let text = std::fs::read_to_string(&p).expect("read source");
                out.insert(module_of(&rel), text);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, src, &mut out);
    out
}

#[test]
fn the_router_modules_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let sources = read_tree(&src);
    assert!(sources.len() > 30, "read {} files", sources.len());
    assert!(sources.contains_key("lifecycle::driver"));
    let edges = edges(&sources);
    assert!(
        edges
            .iter()
            .any(|e| e.from == "serve::leg" && e.to == "fleet"),
        "the checker sees serve's imports"
    );
    if let Err(cycles) = check(&sources) {
        panic!(
            "import cycles among router modules (the design note in lib.rs gives the layers):\n{}",
            cycles.join("\n")
        );
    }
}

/// Most fields of shared mutable state one struct may hold (the design note in lib.rs: no
/// struct in the router with more than about 8 fields of shared mutable state; a struct of
/// owned handles is fine).
const MAX_SHARED_STATE_FIELDS: usize = 8;

/// Type words that make a field shared mutable state: locks, atomics, cells, watch senders and
/// Prometheus metric handles (each an `Arc` over atomics; `HistFamily` is `metrics.rs`'s alias).
const SHARED_STATE_TYPES: [&str; 12] = [
    "Mutex",
    "RwLock",
    "AtomicU64",
    "AtomicUsize",
    "AtomicBool",
    "AtomicU32",
    "Cell",
    "Family",
    "HistFamily",
    "Counter",
    "Gauge",
    "Histogram",
];

/// Per struct (`module::Name`), its fields whose type names one of [`SHARED_STATE_TYPES`] as a
/// whole word, in order. Reads braced `struct` bodies of the stripped source; test modules
/// count too.
fn shared_state_fields(sources: &BTreeMap<String, String>) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for (module, text) in sources {
        let text = strip(text);
        let mut rest = text.as_str();
        while let Some(i) = rest.find("struct ") {
            let before = rest[..i].chars().next_back();
            rest = &rest[i + "struct ".len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let Some(open) = rest.find(['{', ';', '(']) else {
                break;
            };
            if rest.as_bytes()[open] != b'{' {
                continue;
            }
            let mut depth = 0usize;
            let mut end = open;
            for (k, c) in rest[open..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = open + k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let body = &rest[open + 1..end];
            let mut fields = Vec::new();
            // Fields are split at top-level commas (generic arguments nest in `<>`).
            let (mut angle, mut start) = (0i32, 0);
            let bytes = body.as_bytes();
            for k in 0..=bytes.len() {
                let c = bytes.get(k).copied().unwrap_or(b',');
                match c {
                    b'<' | b'(' | b'[' => angle += 1,
                    b'>' | b')' | b']' => angle -= 1,
                    b',' if angle == 0 => {
                        let field = body[start..k.min(body.len())].trim();
                        start = k + 1;
                        let Some((fname, ty)) = field.split_once(':') else {
                            continue;
                        };
                        let words = ty
                            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                            .collect::<Vec<_>>();
                        if words.iter().any(|w| SHARED_STATE_TYPES.contains(w)) {
                            let fname = fname.split_whitespace().last().unwrap_or("");
                            fields.push(fname.to_string());
                        }
                    }
                    _ => {}
                }
            }
            out.insert(format!("{module}::{name}"), fields);
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn no_router_struct_holds_more_than_eight_pieces_of_shared_mutable_state() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = shared_state_fields(&read_tree(&src));
    let metrics = found
        .get("metrics::Legs")
        .expect("the checker sees metrics::Legs");
    assert!(metrics.contains(&"ttft".to_string()), "{metrics:?}");
    let over: Vec<String> = found
        .iter()
        .filter(|(_, f)| f.len() > MAX_SHARED_STATE_FIELDS)
        .map(|(s, f)| format!("{s}: {} fields ({})", f.len(), f.join(", ")))
        .collect();
    assert!(
        over.is_empty(),
        "structs holding more than {MAX_SHARED_STATE_FIELDS} fields of shared mutable state \
         (split them into parts that own their data, as the design note in lib.rs says):\n{}",
        over.join("\n")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_state_fields_are_counted_per_struct() {
        let src = BTreeMap::from([(
            "m".to_string(),
            "pub(crate) struct A {\n    a: Mutex<u8>,\n    b: Family<Labels, Gauge>,\n    \
             c: BTreeMap<String, u8>,\n    /// a Counter in a comment\n    d: u8,\n}\n\
             struct B(u8);\nstruct C;\nstruct D { e: Arc<AtomicU64> }\n"
                .to_string(),
        )]);
        let f = shared_state_fields(&src);
        assert_eq!(f["m::A"], ["a", "b"]);
        assert_eq!(f["m::D"], ["e"]);
        assert!(!f.contains_key("m::B") && !f.contains_key("m::C"), "{f:?}");
    }

    fn tree(files: &[(&str, &str)]) -> BTreeMap<String, String> {
        files
            .iter()
            .map(|(m, t)| (m.to_string(), t.to_string()))
            .collect()
    }

    /// The checker fails on a cycle between top-level modules and names its edges.
    #[test]
    fn a_cycle_between_top_level_modules_fails() {
        let t = tree(&[
            ("", "mod a;\nmod b;\nmod c;\n"),
            ("a", "use crate::b::Thing;\n"),
            ("b", "use crate::{c::{self, Other}, config};\n"),
            ("c", "fn f() {\n    crate::a::g();\n}\n"),
        ]);
        let err = check(&t).unwrap_err().join("\n");
        assert!(err.contains("a -> b (a.rs:1)"), "{err}");
        assert!(err.contains("b -> c (b.rs:1)"), "{err}");
        assert!(err.contains("c -> a (c.rs:2)"), "{err}");
    }

    /// Inside a module tree siblings must not import each other in a circle; a parent and
    /// its children may (re-exports), and test modules, comments and strings do not count.
    #[test]
    fn sibling_cycles_fail_and_structure_does_not() {
        let ok = tree(&[
            ("", "pub mod lease;\n"),
            (
                "lease",
                "pub mod driver;\npub use driver::Driver;\npub struct Error;\n",
            ),
            (
                "lease::driver",
                "use super::Error;\n// use super::machine::X;\nconst S: &str = \"crate::x::y\";\n\
                 #[cfg(test)]\nmod tests {\n    use crate::other::Thing;\n}\n",
            ),
            ("other", "use narwhal_lease::driver::Driver;\n"),
        ]);
        assert_eq!(check(&ok), Ok(()));
        let bad = tree(&[
            ("", "mod ha;\n"),
            ("ha", "mod primary;\nmod standby;\n"),
            ("ha::primary", "use super::standby::run;\n"),
            ("ha::standby", "fn f() { super::primary::renew(); }\n"),
        ]);
        let err = check(&bad).unwrap_err().join("\n");
        assert!(err.starts_with("inside ha:"), "{err}");
        assert!(err.contains("ha::primary -> ha::standby"), "{err}");
    }

    /// A root re-export used from inside the crate hides a dependency: it counts as an edge
    /// to the root, which depends on what it re-exports.
    #[test]
    fn reaching_through_the_crate_root_is_an_edge_to_it() {
        let t = tree(&[
            (
                "",
                "mod cli;\nmod ha;\npub use cli::main;\npub use ha::Options;\n",
            ),
            ("cli", "fn f() -> crate::Options { todo!() }\n"),
            ("ha", ""),
        ]);
        let err = check(&t).unwrap_err().join("\n");
        assert!(err.contains("cli -> crate"), "{err}");
    }

    #[test]
    fn use_trees_expand_and_literals_are_blanked() {
        assert_eq!(
            expand_use("crate::{a::{self, B as C}, d::*}"),
            vec![
                vec!["crate".to_string(), "a".into()],
                vec!["crate".to_string(), "a".into(), "B".into()],
                vec!["crate".to_string(), "d".into()],
            ]
        );
        let s = strip("let a = 'x'; let r = r#\"crate::a\"#; fn f<'a>() {} // crate::b\n");
        assert!(!s.contains("crate::"), "{s}");
        assert!(s.contains("fn f<'a>()"), "{s}");
    }
}
