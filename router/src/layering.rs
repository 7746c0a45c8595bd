//! The module graph check: the router's modules depend on each other in one direction.
//!
//! This checks what Cargo cannot. The leaf cores are crates of their own (`narwhal-relay` in
//! router/relay, `narwhal-lease` in router/lease), so Cargo already keeps them from naming the
//! router; inside this crate any module may name any other, and only this test holds the layers
//! of the design note in `lib.rs`. It reads every file under `router/src` (binaries aside),
//! parses it with `syn`, collects the module paths it names (`use` trees, and `crate::` /
//! `super::` / `self::` paths in code and in macro bodies), resolves them to the crate's
//! modules and fails when
//! - the top-level modules (`fleet`, `lifecycle`, `ha`, ..., and the crate root) form a cycle,
//! - or, inside one top-level module, its files do (edges between a module and its own
//!   ancestors are structure, not layering: a parent re-exports its children's items).
//!
//! Test code may use any layer: items under `#[cfg(test)]`, and the files of test modules
//! (`#[cfg(test)] mod tests;`), make no edge. The failure names every module of the cycle and,
//! for each edge, the file and line that makes it.
//!
//! A second test holds the design note's limit on shared mutable state: no struct with more
//! than eight fields whose types name a lock, an atomic, a cell or a metric handle.
//!
//! The parsing is syn's (a dev-dependency; proc-macro2's `span-locations` gives the lines), so
//! comments and literals never name a module. Ours are the module resolution, the cycle search
//! and the shared-state rule.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use proc_macro2::{Spacing, TokenStream, TokenTree};
use syn::punctuated::Punctuated;
use syn::visit::{self, Visit};
use syn::{Attribute, Fields, ImplItem, Item, Meta, Token, UseTree};

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

/// One file under `src/`: its path there and its text.
struct Source {
    file: String,
    text: String,
}

/// A file's syntax tree; a file syn cannot parse fails the check.
fn parse(source: &Source) -> syn::File {
    syn::parse_file(&source.text).unwrap_or_else(|e| {
        let line = e.span().start().line;
        panic!("{}:{line}: {e}", source.file)
    })
}

/// Whether `attrs` hold a `#[cfg(test)]` (or `#[cfg(all(test, ..))]`).
fn under_test(attrs: &[Attribute]) -> bool {
    fn needs_test(meta: &Meta) -> bool {
        match meta {
            Meta::Path(p) => p.is_ident("test"),
            Meta::List(l) if l.path.is_ident("all") => l
                .parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
                .is_ok_and(|all| all.iter().any(needs_test)),
            _ => false,
        }
    }
    attrs
        .iter()
        .any(|a| a.path().is_ident("cfg") && a.parse_args::<Meta>().is_ok_and(|m| needs_test(&m)))
}

/// An item's attributes (syn's `Item` has no accessor for them).
fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// Expands a `use` tree (`a::{b, c::{d as e, *}}`) into full paths, each with the line of its
/// last name.
fn expand_use(tree: &UseTree) -> Vec<(Vec<String>, usize)> {
    fn walk(tree: &UseTree, prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, usize)>) {
        let mut leaf = |name: &syn::Ident, prefix: &[String]| {
            let mut path = prefix.to_vec();
            if name != "self" {
                path.push(name.to_string());
            }
            out.push((path, name.span().start().line));
        };
        match tree {
            UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                walk(&p.tree, prefix, out);
                prefix.pop();
            }
            UseTree::Name(n) => leaf(&n.ident, prefix),
            UseTree::Rename(r) => leaf(&r.ident, prefix),
            UseTree::Glob(g) => out.push((prefix.clone(), g.star_token.span.start().line)),
            UseTree::Group(g) => g.items.iter().for_each(|t| walk(t, prefix, out)),
        }
    }
    let mut out = Vec::new();
    walk(tree, &mut Vec::new(), &mut out);
    out
}

/// The first names of the paths in code that may name a module of this crate.
const ANCHORS: [&str; 3] = ["crate", "super", "self"];

/// One path a file names: from where (the inline modules around it), what, and on which line.
struct Named {
    inline: Vec<String>,
    path: Vec<String>,
    line: usize,
}

/// Collects the paths a file names, skipping items under `#[cfg(test)]`.
#[derive(Default)]
struct Paths {
    /// The inline modules (`mod docs { .. }`) the walk is in.
    inline: Vec<String>,
    found: Vec<Named>,
    /// The modules under `#[cfg(test)]` (`mod tests;` and inline), from the file's module.
    test_modules: Vec<Vec<String>>,
}

impl Paths {
    fn push(&mut self, path: Vec<String>, line: usize) {
        let inline = self.inline.clone();
        self.found.push(Named { inline, path, line });
    }

    /// `crate::` / `super::` / `self::` paths in a macro's tokens (syn leaves macro bodies
    /// unparsed; comments are gone and literals are tokens of their own).
    fn scan_tokens(&mut self, tokens: TokenStream) {
        let tts: Vec<TokenTree> = tokens.into_iter().collect();
        // A `::` at `j`.
        let sep = |j: usize| match (tts.get(j), tts.get(j + 1)) {
            (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) => {
                a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':'
            }
            _ => false,
        };
        let mut k = 0;
        while k < tts.len() {
            match &tts[k] {
                TokenTree::Group(g) => self.scan_tokens(g.stream()),
                TokenTree::Ident(i) if ANCHORS.iter().any(|a| i == a) => {
                    let mut path = vec![i.to_string()];
                    while sep(k + 1) {
                        let Some(TokenTree::Ident(next)) = tts.get(k + 3) else {
                            break;
                        };
                        path.push(next.to_string());
                        k += 3;
                    }
                    if path.len() > 1 {
                        self.push(path, i.span().start().line);
                    }
                }
                _ => {}
            }
            k += 1;
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast Item) {
        if !under_test(item_attrs(item)) {
            visit::visit_item(self, item);
        } else if let Item::Mod(m) = item {
            let mut path = self.inline.clone();
            path.push(m.ident.to_string());
            self.test_modules.push(path);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast ImplItem) {
        let attrs: &[Attribute] = match item {
            ImplItem::Const(i) => &i.attrs,
            ImplItem::Fn(i) => &i.attrs,
            ImplItem::Type(i) => &i.attrs,
            ImplItem::Macro(i) => &i.attrs,
            _ => &[],
        };
        if !under_test(attrs) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        self.inline.push(m.ident.to_string());
        visit::visit_item_mod(self, m);
        self.inline.pop();
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        // `use ::name::..` is another crate.
        if u.leading_colon.is_none() {
            for (path, line) in expand_use(&u.tree) {
                self.push(path, line);
            }
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let anchored = p
            .segments
            .first()
            .is_some_and(|s| ANCHORS.iter().any(|a| s.ident == a));
        if anchored && p.leading_colon.is_none() && p.segments.len() > 1 {
            let path = p.segments.iter().map(|s| s.ident.to_string()).collect();
            self.push(path, p.segments[0].ident.span().start().line);
        }
        visit::visit_path(self, p);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        visit::visit_macro(self, m);
        self.scan_tokens(m.tokens.clone());
    }

    /// `pub(crate)`, `pub(super)`, `pub(in ..)` say who may see an item, not what it uses.
    fn visit_vis_restricted(&mut self, _: &'ast syn::VisRestricted) {}
}

/// The module a path names, from module `here` (a file's module and the inline modules
/// around the path); `None` for paths outside the crate.
fn resolve(here: &[&str], path: &[String], modules: &BTreeSet<String>) -> Option<String> {
    let mut full: Vec<&str> = here.iter().copied().filter(|s| !s.is_empty()).collect();
    let mut rest = path;
    match rest.first()?.as_str() {
        "crate" => {
            full.clear();
            rest = &rest[1..];
        }
        "super" => {
            while rest.first().is_some_and(|s| s == "super") {
                full.pop();
                rest = &rest[1..];
            }
        }
        "self" => rest = &rest[1..],
        first => {
            // A child module named without `self::` (`use machine::Lifecycle` in
            // `lifecycle.rs`); anything else is another crate.
            let mut child = full.clone();
            child.push(first);
            if !modules.contains(&child.join("::")) {
                return None;
            }
        }
    }
    full.extend(rest.iter().map(String::as_str));
    // The longest prefix that is a module (the crate root at least).
    let mut target = String::new();
    for k in 1..=full.len() {
        let prefix = full[..k].join("::");
        if !modules.contains(&prefix) {
            break;
        }
        target = prefix;
    }
    Some(target)
}

/// Every edge the sources (module path → file) make; the files of test modules
/// (`#[cfg(test)] mod tests;`) make none.
fn edges(sources: &BTreeMap<String, Source>) -> Vec<Edge> {
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    let mut named = BTreeMap::new();
    let mut test_modules = BTreeSet::new();
    for (module, source) in sources {
        let mut paths = Paths::default();
        paths.visit_file(&parse(source));
        for inner in paths.test_modules {
            let mut path: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
            path.extend(inner.iter().map(String::as_str));
            test_modules.insert(path.join("::"));
        }
        named.insert(module, paths.found);
    }
    let mut out = Vec::new();
    for (module, found) in named {
        if test_modules.iter().any(|t| is_ancestor(t, module)) {
            continue;
        }
        for n in found {
            let mut here: Vec<&str> = module.split("::").collect();
            here.extend(n.inline.iter().map(String::as_str));
            if let Some(to) = resolve(&here, &n.path, &modules)
                && to != *module
            {
                out.push(Edge {
                    from: module.clone(),
                    to,
                    at: format!("{}:{}", sources[module].file, n.line),
                });
            }
        }
    }
    out
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
fn check(sources: &BTreeMap<String, Source>) -> Result<(), Vec<String>> {
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

/// Reads `router/src` (without `bin/`) as module path → file.
fn read_tree(src: &Path) -> BTreeMap<String, Source> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<String, Source>) {
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
                out.insert(module_of(&rel), Source { file: rel, text });
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

/// The same check over the engine agent's modules (`engine-agent/src`): its configuration and
/// its engine plugins once imported each other (the engine key lived in the configuration).
#[test]
fn the_agent_modules_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine-agent/src");
    let sources = read_tree(&src);
    assert!(sources.contains_key("plugin"), "read {:?}", sources.keys());
    assert!(
        edges(&sources)
            .iter()
            .any(|e| e.from == "plugin" && e.to == "engine_key"),
        "the checker sees the agent's imports"
    );
    if let Err(cycles) = check(&sources) {
        panic!(
            "import cycles among the agent's modules:\n{}",
            cycles.join("\n")
        );
    }
}

/// Most fields of shared mutable state one struct may hold (the design note in lib.rs: no
/// struct in the router with more than about 8 fields of shared mutable state; a struct of
/// owned handles is fine).
const MAX_SHARED_STATE_FIELDS: usize = 8;

/// Type names that make a field shared mutable state: locks, atomics, cells, watch senders and
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

/// Per struct with named fields (`module::Name`), its fields whose type names one of
/// [`SHARED_STATE_TYPES`] anywhere in its path segments (`Arc<Mutex<..>>`,
/// `Family<L, Gauge>`), in order; test modules count too.
fn shared_state_fields(sources: &BTreeMap<String, Source>) -> BTreeMap<String, Vec<String>> {
    /// Every path segment's name in a type, generic arguments included.
    #[derive(Default)]
    struct Names(Vec<String>);
    impl<'ast> Visit<'ast> for Names {
        fn visit_path_segment(&mut self, s: &'ast syn::PathSegment) {
            self.0.push(s.ident.to_string());
            visit::visit_path_segment(self, s);
        }
    }
    struct Structs<'a> {
        module: &'a str,
        out: &'a mut BTreeMap<String, Vec<String>>,
    }
    impl<'ast> Visit<'ast> for Structs<'_> {
        fn visit_item_struct(&mut self, s: &'ast syn::ItemStruct) {
            if let Fields::Named(named) = &s.fields {
                let shared = named.named.iter().filter(|f| {
                    let mut names = Names::default();
                    names.visit_type(&f.ty);
                    names
                        .0
                        .iter()
                        .any(|n| SHARED_STATE_TYPES.contains(&n.as_str()))
                });
                let fields = shared.filter_map(|f| f.ident.as_ref().map(|i| i.to_string()));
                let name = format!("{}::{}", self.module, s.ident);
                self.out.insert(name, fields.collect());
            }
            visit::visit_item_struct(self, s);
        }
    }
    let mut out = BTreeMap::new();
    for (module, source) in sources {
        let mut structs = Structs {
            module,
            out: &mut out,
        };
        structs.visit_file(&parse(source));
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
        let src = tree(&[(
            "m",
            "pub(crate) struct A {\n    a: Mutex<u8>,\n    b: Family<Labels, Gauge>,\n    \
             c: BTreeMap<String, u8>,\n    /// a Counter in a comment\n    d: u8,\n    \
             e: [u8; \"Mutex\".len()],\n    pub(crate) f: std::sync::RwLock<Vec<u8>>,\n}\n\
             struct B(u8);\nstruct C;\nfn g() { struct D { e: Arc<AtomicU64> } }\n",
        )]);
        let f = shared_state_fields(&src);
        assert_eq!(f["m::A"], ["a", "b", "f"]);
        assert_eq!(f["m::D"], ["e"]);
        assert!(!f.contains_key("m::B") && !f.contains_key("m::C"), "{f:?}");
    }

    /// Sources at the paths `read_tree` would give them (`a::b` in `a/b.rs`).
    fn tree(files: &[(&str, &str)]) -> BTreeMap<String, Source> {
        let file = |m: &str| match m {
            "" => "lib.rs".to_string(),
            m => format!("{}.rs", m.replace("::", "/")),
        };
        let source = |m: &str, t: &str| Source {
            file: file(m),
            text: t.to_string(),
        };
        files
            .iter()
            .map(|(m, t)| (m.to_string(), source(m, t)))
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
    /// its children may (re-exports), and test items, comments and strings do not count.
    #[test]
    fn sibling_cycles_fail_and_structure_does_not() {
        let ok = tree(&[
            ("", "pub mod lease;\nmod other;\n"),
            (
                "lease",
                "pub mod driver;\npub use driver::Driver;\npub struct Error;\n\
                 #[cfg(test)]\nmod tests;\n",
            ),
            ("lease::tests", "use crate::other::Thing;\n"),
            (
                "lease::driver",
                "use super::Error;\n// use super::machine::X;\nconst S: &str = \"crate::x::y\";\n\
                 #[cfg(test)]\nmod tests {\n    use crate::other::Thing;\n}\n\
                 pub(crate) struct Driver;\nimpl Driver {\n    #[cfg(test)]\n    \
                 fn probe(&self) { crate::other::poke(self); }\n}\n\
                 #[cfg(all(test, unix))]\nuse crate::other::Unix;\n",
            ),
            (
                "other",
                "use narwhal_lease::driver::Driver;\nuse crate::lease::Error;\n",
            ),
        ]);
        // `other -> lease` is there, so any `lease -> other` would close a cycle.
        let found = edges(&ok);
        assert!(
            found.iter().any(|e| e.from == "other" && e.to == "lease"),
            "{found:?}"
        );
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

    /// `use` trees expand into one path per name, each on its own line; paths inside macro
    /// bodies and inline modules count; comments, literals, visibilities and `self` values
    /// never make an edge.
    #[test]
    fn use_trees_expand_and_literals_and_comments_make_no_edge() {
        let u: syn::ItemUse = syn::parse_str("use crate::{\n    a::{self, B as C},\n    d::*,\n};")
            .expect("a use item");
        assert_eq!(
            expand_use(&u.tree),
            vec![
                (vec!["crate".to_string(), "a".into()], 2),
                (vec!["crate".to_string(), "a".into(), "B".into()], 2),
                (vec!["crate".to_string(), "d".into()], 3),
            ]
        );
        let quiet = "pub(crate) fn f<'a>(x: &'a str) -> char {\n    let _ = 'x';\n    \
                     let _ = r#\"crate::a::x\"#;\n    let _ = b\"super::b\";\n    \
                     /* crate::a /* nested */ crate::b */\n    // crate::c\n    \
                     println!(\"{}\", \"crate::a::f\");\n    '\\''\n}\n\
                     /// [`crate::b`]\npub(super) struct S;\nimpl S {\n    \
                     pub(in crate::m) fn g(&self) -> &Self { self }\n}\n";
        let t = tree(&[
            ("", "mod a;\nmod b;\nmod c;\nmod m;\n"),
            ("a", ""),
            ("b", ""),
            ("c", ""),
            ("m", quiet),
        ]);
        let found = edges(&t);
        assert!(!found.iter().any(|e| e.from == "m"), "{found:?}");
        let loud = "fn f() {\n    assert!(crate::a::ok(), \"{}\", super::b::X);\n}\n\
                    mod docs {\n    use super::super::c::Y;\n}\n";
        let t = tree(&[
            ("", "mod a;\nmod b;\nmod c;\nmod m;\n"),
            ("a", ""),
            ("b", ""),
            ("c", ""),
            ("m", loud),
        ]);
        let found: Vec<(String, String)> = edges(&t)
            .into_iter()
            .filter(|e| e.from == "m")
            .map(|e| (e.to, e.at))
            .collect();
        assert_eq!(
            found,
            [
                ("a".to_string(), "m.rs:2".to_string()),
                ("b".to_string(), "m.rs:2".to_string()),
                ("c".to_string(), "m.rs:5".to_string()),
            ]
        );
    }
}
