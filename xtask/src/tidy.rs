//! `cargo xtask tidy`: the architecture invariants that a reading of the source can check, as
//! rust-analyzer's tidy tests do. The tests at the bottom run them on the workspace in CI; each
//! check also runs on synthetic sources there, so a check that could never fail is caught.
//!
//! - **No cycle between modules**: inside every crate, at every level of its module tree, the
//!   sibling modules' references (`use` trees and `crate::`/`super::`/`self::` paths, through
//!   the parents' `pub use` re-exports) form no cycle. A child's references to its own
//!   ancestors do not count (a folder module and its parts are one unit one level up).
//! - **No upward import**: crates depend only on crates of lower layers ([`CRATE_LAYERS`]), and
//!   `ironweave-ops`'s modules only on modules of lower layers ([`OPS_LAYERS`]).
//! - **The binary parses and dispatches**: `crates/cli/src` starts no ranks, reads no JSON and
//!   prints no tables ([`cli_violations`]), and lists no dependency it does not use.
//! - **Backends only through the facade**: `crates/ops` and `crates/cli` name no backend crate.
//!
//! The reading is textual (comments, strings and `#[cfg(test)] mod` blocks are left out): a
//! macro that builds a path is not seen.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from its crate's root (`[]`: the root; `["comm", "stripe"]`).
pub type ModPath = Vec<String>;

/// One reference from a module to another.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub from: ModPath,
    pub to: ModPath,
    /// Where: file and line.
    pub at: String,
}

/// A crate's modules (path → source, comments and tests left out) and the references between
/// them.
#[derive(Debug, Default)]
pub struct ModGraph {
    pub modules: BTreeMap<ModPath, (PathBuf, String)>,
    pub edges: Vec<Edge>,
}

/// The crates in layers, lowest first: a crate may depend on crates of lower layers only.
pub const CRATE_LAYERS: &[&[&str]] = &[
    &["ironweave-units"],
    &["ironweave-transport", "ironweave-profile", "ironweave-plan"],
    &["ironweave-ucx-sys"],
    &["ironweave-tcp", "ironweave-ucx", "ironweave-verbs", "ironweave-overlap", "ironweave-ckpt"],
    // NCCL's host traffic goes over the TCP backend
    &["ironweave-nccl", "ironweave-sdp", "ironweave-sim"],
    &["ironweave-train", "ironweave"],
    &["ironweave-testkit"],
    // the Python package's native part: above the facade only
    &["ironweave-ops", "ironweave-airq", "ironweave-orthonets", "ironweave-py"],
    &["ironweave-cli", "ironweave-benches", "xtask"],
];

/// `ironweave-ops`'s top-level modules in layers, lowest first (its `lib.rs` says why).
pub const OPS_LAYERS: &[&[&str]] = &[
    &["error"],
    &["progress", "backend", "topology", "rundir"],
    &["launch"],
    &["cluster"],
    &["plan", "report"],
    &["train"],
    &["simulate", "ckpt"],
    &["bench", "chaos"],
    &["selftest"],
];

/// Blanks comments, string and char literals (keeping line breaks, so lines still count) and
/// cuts every `#[cfg(test)] mod NAME { ... }` block.
pub fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) && !ident_before(b, i) {
            // raw string r"..." / r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c as char);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == b'\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                if b[j] == b'\\' {
                    j += 1;
                }
                if b.get(j) == Some(&b'\n') {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j + 1;
        } else if c == b'\'' && b.get(i + 2) == Some(&b'\'') {
            out.push_str("' '");
            i += 3;
        } else if c == b'\'' && b.get(i + 1) == Some(&b'\\') {
            let mut j = i + 2;
            while j < b.len() && b[j] != b'\'' {
                j += 1;
            }
            out.push_str("' '");
            i = j + 1;
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    cut_test_modules(&out)
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Removes `#[cfg(test)]` followed by `mod NAME { ... }` (braces matched), keeping line breaks.
fn cut_test_modules(s: &str) -> String {
    let mut out = s.to_string();
    while let Some(at) = find_test_mod(&out) {
        let open = match out[at..].find('{') {
            Some(o) => at + o,
            None => break,
        };
        let mut depth = 0;
        let mut end = out.len();
        for (k, ch) in out[open..].char_indices() {
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
        let lines = out[at..end].matches('\n').count();
        out.replace_range(at..end, &"\n".repeat(lines));
    }
    out
}

fn find_test_mod(s: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(p) = s[from..].find("#[cfg(test)]") {
        let at = from + p;
        let rest = s[at + "#[cfg(test)]".len()..].trim_start();
        // further attributes may follow
        let mut r = rest;
        while r.starts_with("#[") {
            r = r[r.find(']').map_or(r.len(), |e| e + 1)..].trim_start();
        }
        let r = r.strip_prefix("pub ").unwrap_or(r).trim_start();
        if r.starts_with("mod ") && r.split('\n').next().is_some_and(|l| l.contains('{')) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// The module path of a source file under `src` (None for a file no module tree reaches:
/// `bin/`, `main.rs` beside `lib.rs` is its own tree).
fn mod_path(src: &Path, file: &Path) -> Option<ModPath> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    if parts.first().map(String::as_str) == Some("bin") {
        return None;
    }
    match stem {
        "lib" | "main" if parts.is_empty() => {}
        "mod" => {}
        s => parts.push(s.to_string()),
    }
    Some(parts)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The module graph of the crate whose sources are under `src` (a library's tree from
/// `lib.rs`; a binary-only crate's from `main.rs`).
pub fn graph_of_dir(src: &Path) -> ModGraph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let has_lib = src.join("lib.rs").exists();
    let sources: Vec<(PathBuf, String)> = files
        .into_iter()
        .filter(|f| !(has_lib && f == &src.join("main.rs")))
        .filter_map(|f| std::fs::read_to_string(&f).ok().map(|s| (f, s)))
        .collect();
    graph_of(src, &sources)
}

/// The module graph of sources `(path under src, text)`.
pub fn graph_of(src: &Path, sources: &[(PathBuf, String)]) -> ModGraph {
    let mut g = ModGraph::default();
    for (f, text) in sources {
        if let Some(m) = mod_path(src, f) {
            g.modules.insert(m, (f.clone(), strip(text)));
        }
    }
    // every module's `pub use` re-exports: name -> the module it comes from
    let mut reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>> = BTreeMap::new();
    for (m, (_, text)) in &g.modules {
        for (u, _) in use_trees(text, true) {
            if let Some(name) = u.last() {
                if let Some((target, _)) = resolve(&g.modules, m, &u, &BTreeMap::new()) {
                    reexports.entry(m.clone()).or_default().insert(name.clone(), target);
                }
            }
        }
    }
    let mut edges = BTreeSet::new();
    for (m, (file, text)) in &g.modules {
        let mut paths = use_trees(text, false);
        paths.extend(inline_paths(text));
        for (p, line) in paths {
            if let Some((target, _)) = resolve(&g.modules, m, &p, &reexports) {
                if &target != m {
                    edges.insert(Edge { from: m.clone(), to: target, at: format!("{}:{line}", file.display()) });
                }
            }
        }
    }
    g.edges = edges.into_iter().collect();
    g
}

/// Resolves path `p` (segments as written) used in module `from` to the deepest module it
/// names, following a module's `pub use` of the next segment. Returns None for paths outside
/// the crate (`std::`, other crates).
fn resolve(
    modules: &BTreeMap<ModPath, (PathBuf, String)>,
    from: &ModPath,
    p: &[String],
    reexports: &BTreeMap<ModPath, BTreeMap<String, ModPath>>,
) -> Option<(ModPath, usize)> {
    let mut base: ModPath;
    let mut i = 0;
    match p.first().map(String::as_str) {
        Some("crate") => {
            base = Vec::new();
            i = 1;
        }
        Some("self") => {
            base = from.clone();
            i = 1;
        }
        Some("super") => {
            base = from.clone();
            while p.get(i).map(String::as_str) == Some("super") {
                base.pop()?;
                i += 1;
            }
        }
        Some(first) => {
            // 2018 paths relative to this module: only a child module's name
            let mut child = from.clone();
            child.push(first.to_string());
            if !modules.contains_key(&child) {
                return None;
            }
            base = from.clone();
        }
        None => return None,
    }
    while let Some(seg) = p.get(i) {
        let mut next = base.clone();
        next.push(seg.clone());
        if modules.contains_key(&next) {
            base = next;
            i += 1;
            continue;
        }
        // an item re-exported by this module from another one
        if let Some(t) = reexports.get(&base).and_then(|r| r.get(seg)) {
            if t != &base {
                return Some((t.clone(), i));
            }
        }
        break;
    }
    Some((base, i))
}

/// Every path of every `use` tree in `text` (segments; `{a, b::c}` groups expanded), with its
/// line; only `pub use` ones when `public_only`.
fn use_trees(text: &str, public_only: bool) -> Vec<(Vec<String>, usize)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(p) = find_word(text, "use", from) {
        from = p + 3;
        let before = text[..p].trim_end();
        let public =
            before.ends_with("pub") || before.ends_with(')') && before.rsplit("pub").next().is_some_and(|x| x.len() < 12);
        if public_only && !public {
            continue;
        }
        // a statement start: after `;`, `{`, `}`, an attribute or the file's start
        let prev = before.trim_end_matches("pub(crate)").trim_end_matches("pub(super)").trim_end_matches("pub").trim_end();
        if !(prev.is_empty() || prev.ends_with(';') || prev.ends_with('{') || prev.ends_with('}') || prev.ends_with(']')) {
            continue;
        }
        let Some(end) = text[from..].find(';') else { break };
        // whitespace collapsed, and none around punctuation (`c as d` keeps its spaces)
        let mut tree = text[from..from + end].split_whitespace().collect::<Vec<_>>().join(" ");
        for p in ["::", "{", "}", ","] {
            tree = tree.replace(&format!(" {p}"), p).replace(&format!("{p} "), p);
        }
        let line = text[..p].matches('\n').count() + 1;
        let mut paths = Vec::new();
        expand(&tree, &mut Vec::new(), &mut paths);
        out.extend(paths.into_iter().map(|x| (x, line)));
    }
    out
}

fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    // split at top-level commas
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (k, c) in tree.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&tree[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&tree[start..]);
    for part in parts.into_iter().filter(|x| !x.is_empty()) {
        if let Some(open) = part.find('{') {
            let head = part[..open].trim_end_matches("::");
            let inner = &part[open + 1..part.rfind('}').unwrap_or(part.len())];
            let n = prefix.len();
            prefix.extend(head.split("::").filter(|s| !s.is_empty()).map(String::from));
            expand(inner, prefix, out);
            prefix.truncate(n);
        } else {
            let path = part.split(" as ").next().unwrap_or(part);
            let mut v = prefix.clone();
            v.extend(path.split("::").filter(|s| !s.is_empty() && *s != "*").map(String::from));
            if v.last().map(String::as_str) == Some("self") {
                v.pop();
            }
            out.push(v);
        }
    }
}

/// `crate::a::b`, `super::x` and `self::y` paths written outside `use` statements.
fn inline_paths(text: &str) -> Vec<(Vec<String>, usize)> {
    let mut out = Vec::new();
    for (ln, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("use ") || line.trim_start().starts_with("pub use ") {
            continue;
        }
        for key in ["crate::", "super::", "self::"] {
            let mut from = 0;
            while let Some(p) = line[from..].find(key) {
                let at = from + p;
                from = at + key.len();
                if at > 0 && {
                    let c = line.as_bytes()[at - 1];
                    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
                } {
                    continue;
                }
                let rest = &line[at..];
                let path: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
                let segs: Vec<String> = path.split("::").filter(|s| !s.is_empty()).map(String::from).collect();
                out.push((segs, ln + 1));
            }
        }
    }
    out
}

fn find_word(text: &str, word: &str, from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(p) = text[at..].find(word) {
        let i = at + p;
        let before_ok = i == 0
            || !{
                let c = text.as_bytes()[i - 1];
                c.is_ascii_alphanumeric() || c == b'_'
            };
        let after_ok = text.as_bytes().get(i + word.len()).is_some_and(|c| c.is_ascii_whitespace());
        if before_ok && after_ok {
            return Some(i);
        }
        at = i + 1;
    }
    None
}

/// The sibling-level edges at `parent`: a reference from inside child `a` to inside child `b`.
fn sibling_edges(g: &ModGraph, parent: &ModPath) -> BTreeMap<(String, String), String> {
    let mut out = BTreeMap::new();
    for e in &g.edges {
        let (Some(a), Some(b)) = (child_of(parent, &e.from), child_of(parent, &e.to)) else { continue };
        if a != b {
            out.entry((a, b)).or_insert_with(|| e.at.clone());
        }
    }
    out
}

fn child_of(parent: &ModPath, m: &ModPath) -> Option<String> {
    (m.len() > parent.len() && m.starts_with(parent)).then(|| m[parent.len()].clone())
}

/// Every cycle between sibling modules (at every level), each as the modules around it and
/// where each reference is: `a -> b (file:line) -> c (...) -> a`.
pub fn cycles(g: &ModGraph) -> Vec<String> {
    let mut parents: BTreeSet<ModPath> = BTreeSet::new();
    for m in g.modules.keys() {
        for k in 0..m.len() {
            parents.insert(m[..k].to_vec());
        }
    }
    let mut out = Vec::new();
    for p in &parents {
        let edges = sibling_edges(g, p);
        let mut adj: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (a, b) in edges.keys() {
            adj.entry(a).or_default().push(b);
        }
        for scc in sccs(&adj) {
            if scc.len() < 2 {
                continue;
            }
            // one cycle through the component, said with where each step is
            let set: BTreeSet<&str> = scc.iter().copied().collect();
            let start = scc[0];
            let mut path = vec![start];
            let mut seen = BTreeSet::from([start]);
            let mut cur = start;
            loop {
                let next = adj[cur].iter().copied().find(|n| set.contains(n) && (!seen.contains(n) || *n == start));
                let Some(n) = next else { break };
                path.push(n);
                if n == start {
                    break;
                }
                seen.insert(n);
                cur = n;
            }
            let where_ = |a: &str, b: &str| edges.get(&(a.to_string(), b.to_string())).cloned().unwrap_or_default();
            let said: Vec<String> = path.windows(2).map(|w| format!("{} -> {} ({})", w[0], w[1], where_(w[0], w[1]))).collect();
            out.push(format!("in `{}`: {}", if p.is_empty() { "crate".into() } else { p.join("::") }, said.join(", ")));
        }
    }
    out
}

/// Tarjan's strongly connected components.
fn sccs<'a>(adj: &BTreeMap<&'a str, Vec<&'a str>>) -> Vec<Vec<&'a str>> {
    struct S<'a, 'b> {
        adj: &'b BTreeMap<&'a str, Vec<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(s: &mut S<'a, '_>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for &w in s.adj.get(v).map(Vec::as_slice).unwrap_or(&[]) {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut c = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                c.push(w);
                if w == v {
                    break;
                }
            }
            c.reverse();
            s.out.push(c);
        }
    }
    let mut s = S { adj, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    let nodes: Vec<&str> = adj.keys().copied().collect();
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// References from a top-level module to one of a higher layer (`layers`, lowest first).
pub fn upward(g: &ModGraph, layers: &[&[&str]]) -> Vec<String> {
    let layer = |m: &str| layers.iter().position(|l| l.contains(&m));
    let mut out = Vec::new();
    for ((a, b), at) in sibling_edges(g, &Vec::new()) {
        match (layer(&a), layer(&b)) {
            (Some(la), Some(lb)) if lb > la => out.push(format!("`{a}` (layer {la}) imports `{b}` (layer {lb}) at {at}")),
            (None, _) => out.push(format!("`{a}` is in no layer of the table (add it where it belongs)")),
            (_, None) => out.push(format!("`{b}` is in no layer of the table (add it where it belongs)")),
            _ => {}
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The workspace's crates: (package name, directory, normal and build dependencies' names).
pub fn crates(root: &Path) -> Vec<(String, PathBuf, Vec<String>)> {
    let mut dirs = Vec::new();
    for top in ["crates", "backends"] {
        if let Ok(rd) = std::fs::read_dir(root.join(top)) {
            dirs.extend(rd.flatten().map(|e| e.path()).filter(|p| p.join("Cargo.toml").exists()));
        }
    }
    dirs.push(root.join("benches"));
    dirs.push(root.join("xtask"));
    dirs.sort();
    dirs.into_iter()
        .filter_map(|d| {
            let toml = std::fs::read_to_string(d.join("Cargo.toml")).ok()?;
            let name = toml.lines().find_map(|l| l.strip_prefix("name = ").map(|n| n.trim_matches('"').to_string()))?;
            Some((name, d, deps(&toml)))
        })
        .collect()
}

/// The names in a Cargo.toml's `[dependencies]` and `[build-dependencies]`.
pub fn deps(toml: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut on = false;
    for l in toml.lines() {
        let t = l.trim();
        if t.starts_with('[') {
            on = t == "[dependencies]" || t == "[build-dependencies]";
            continue;
        }
        if on && !t.starts_with('#') {
            if let Some((k, _)) = t.split_once('=') {
                // `name.workspace = true` and `name = { ... }` alike
                out.push(k.trim().split('.').next().unwrap_or_default().to_string());
            }
        }
    }
    out
}

/// Crate dependencies that point up [`CRATE_LAYERS`] (or name a crate the table lacks).
pub fn crate_upward(crates: &[(String, PathBuf, Vec<String>)], layers: &[&[&str]]) -> Vec<String> {
    let layer = |m: &str| layers.iter().position(|l| l.contains(&m));
    let mut out = Vec::new();
    for (name, _, ds) in crates {
        let Some(la) = layer(name) else {
            out.push(format!("crate `{name}` is in no layer of the table (add it where it belongs)"));
            continue;
        };
        for d in ds.iter().filter(|d| d.starts_with("ironweave") || *d == "xtask") {
            match layer(d) {
                Some(lb) if lb >= la => out.push(format!("`{name}` (layer {la}) depends on `{d}` (layer {lb})")),
                None => out.push(format!("`{name}` depends on `{d}`, which is in no layer of the table")),
                _ => {}
            }
        }
    }
    out
}

/// What the command line's sources do that belongs in `ironweave-ops`: start ranks, read
/// JSON, print tables or anything else to stdout (the binary prints only the error line, on
/// stderr), touch files, run other programs. One finding per line, the most specific.
pub fn cli_violations(sources: &[(PathBuf, String)]) -> Vec<String> {
    const FORBIDDEN: [(&str, &str); 11] = [
        ("LaunchSpec", "starts ranks"),
        ("launch::run(", "starts ranks"),
        ("launch::workers(", "starts ranks"),
        ("serde_json::from_", "reads JSON"),
        ("serde_json", "handles JSON"),
        ("println!(\"|", "prints a table"),
        ("fn table(", "formats a table"),
        ("println!(", "prints to stdout"),
        ("print!(", "prints to stdout"),
        ("std::fs::", "reads or writes files"),
        ("Command::new(", "runs a program"),
    ];
    // `pat` where it starts a word (`eprintln!(` is not `println!(`)
    let found = |line: &str, pat: &str| {
        line.match_indices(pat).any(|(i, _)| line[..i].chars().next_back().is_none_or(|c| !(c.is_alphanumeric() || c == '_')))
    };
    // string literals are kept here: a table's row is one; comment lines are not code
    let code = |text: &str| {
        let cut = cut_test_modules(text);
        cut.lines().map(|l| if l.trim_start().starts_with("//") { "" } else { l }).collect::<Vec<_>>().join("\n")
    };
    let pats: Vec<&str> = FORBIDDEN.iter().map(|(p, _)| *p).collect();
    first_hit_per_line(sources, code, &pats, found)
        .into_iter()
        .map(|(f, ln, k)| {
            let (pat, what) = FORBIDDEN[k];
            format!("{}:{ln}: {what} (`{pat}`): move it into ironweave-ops", f.display())
        })
        .collect()
}

/// Each line of each file, as `prepare` leaves the text, on which `hit` finds one of `pats`:
/// (file, 1-based line number, index of the first such pattern). One finding per line.
fn first_hit_per_line<'a>(
    files: &'a [(PathBuf, String)],
    prepare: impl Fn(&str) -> String,
    pats: &[&str],
    hit: impl Fn(&str, &str) -> bool,
) -> Vec<(&'a Path, usize, usize)> {
    let mut out = Vec::new();
    for (f, text) in files {
        for (ln, line) in prepare(text).lines().enumerate() {
            if let Some(k) = pats.iter().position(|p| hit(line, p)) {
                out.push((f.as_path(), ln + 1, k));
            }
        }
    }
    out
}

/// Dependencies a crate lists that its sources never name (`a-b` as `a_b`).
pub fn unused_deps(dir: &Path) -> Vec<String> {
    let Ok(toml) = std::fs::read_to_string(dir.join("Cargo.toml")) else { return Vec::new() };
    let mut files = Vec::new();
    rust_files(&dir.join("src"), &mut files);
    let text: String = files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).collect::<Vec<_>>().join("\n");
    deps(&toml)
        .into_iter()
        .filter(|d| {
            let id = d.replace('-', "_");
            !text.contains(&format!("{id}::")) && !text.contains(&format!("use {id}")) && !text.contains(&format!("{id}!"))
        })
        .collect()
}

/// Where `crates/ops` and `crates/cli` name a backend crate instead of the facade.
pub fn backend_uses(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for c in ["crates/ops/src", "crates/cli/src"] {
        let mut files = Vec::new();
        rust_files(&root.join(c), &mut files);
        for f in files {
            let text = strip(&std::fs::read_to_string(&f).unwrap_or_default());
            for (ln, line) in text.lines().enumerate() {
                for b in ["ironweave_tcp", "ironweave_ucx", "ironweave_verbs", "ironweave_nccl"] {
                    if line.contains(b) {
                        out.push(format!(
                            "{}:{}: names `{b}` (backends only through the facade `ironweave`)",
                            f.display(),
                            ln + 1
                        ));
                    }
                }
            }
        }
    }
    out
}

/// The deterministic cores: sources that may do no IO and read no clock (they take a `Clock`,
/// events or structs), relative to the workspace root; a folder means every file in it.
/// `ironweave-profile`'s `clock.rs` is the one real clock they are handed.
pub const PURE: &[&str] = &[
    "crates/plan/src",
    "crates/sim/src",
    "crates/profile/src",
    "crates/overlap/src/schedule.rs",
    "crates/ckpt/src/partition.rs",
    "crates/ckpt/src/schedule.rs",
];

/// Outside crates some workspace crates may not depend on, and why: the engines own flat
/// buffers and know nothing of a tensor library; no async runtime carries the data path.
pub const FORBIDDEN_DEPS: &[(&str, &[&str], &str)] = &[
    (
        "candle",
        &[
            "ironweave-transport",
            "ironweave-profile",
            "ironweave-ckpt",
            "ironweave-sdp",
            "ironweave-overlap",
            "ironweave-plan",
            "ironweave-sim",
            "ironweave-tcp",
            "ironweave-ucx",
            "ironweave-verbs",
            "ironweave-nccl",
        ],
        "the engines own flat buffers; the model is the caller's",
    ),
    ("candle", &["ironweave-orthonets"], "OrthoNets is an application beside the training runtime"),
    ("ironweave-t", &["ironweave-orthonets"], "OrthoNets is an application beside the training runtime"),
    ("ironweave-c", &["ironweave-orthonets"], "OrthoNets is an application beside the training runtime"),
    ("ironweave-o", &["ironweave-orthonets"], "OrthoNets is an application beside the training runtime"),
    // the Python package is a thin layer: the engine and the runtime are reached through the facade only
    ("ironweave-", &["ironweave-py"], "the Python package binds the facade (ironweave::checkpointer), never an inner crate"),
    ("candle", &["ironweave-py"], "the Python package binds the facade (ironweave::checkpointer), never an inner crate"),
    ("tokio", &["*"], "no async runtime in the data path: progress threads and blocking waits"),
    ("async-std", &["*"], "no async runtime in the data path: progress threads and blocking waits"),
];

/// Dependencies [`FORBIDDEN_DEPS`] rules out (a prefix: `candle` is `candle-core` too).
pub fn forbidden_deps(crates: &[(String, PathBuf, Vec<String>)], rules: &[(&str, &[&str], &str)]) -> Vec<String> {
    let mut out = Vec::new();
    for (name, _, ds) in crates {
        for (dep, who, why) in rules {
            if !(who.contains(&"*") || who.contains(&name.as_str())) {
                continue;
            }
            for d in ds.iter().filter(|d| d.starts_with(dep)) {
                out.push(format!("`{name}` depends on `{d}`: {why}"));
            }
        }
    }
    out
}

/// What a deterministic core may not name: clocks, files, sockets, the environment,
/// processes, printing.
const IMPURE: [&str; 12] = [
    "Instant::now",
    "SystemTime",
    "std::fs",
    "File::",
    "std::net",
    "std::env",
    "std::process",
    "std::io::stdin",
    "println!",
    "eprintln!",
    "print!",
    "thread::sleep",
];

/// Where the sources of `files` (path, text) do IO or read a clock, comments, strings and tests
/// left out.
pub fn impure(files: &[(PathBuf, String)]) -> Vec<String> {
    first_hit_per_line(files, strip, &IMPURE, |line, pat| line.contains(pat))
        .into_iter()
        .map(|(f, ln, k)| {
            format!("{}:{ln}: `{}` in a deterministic core (take a Clock or the bytes instead)", f.display(), IMPURE[k])
        })
        .collect()
}

/// The [`PURE`] sources under `root`, read.
fn pure_sources(root: &Path) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    for p in PURE {
        let path = root.join(p);
        if path.is_dir() {
            rust_files(&path, &mut files);
        } else {
            files.push(path);
        }
    }
    files
        .into_iter()
        .filter(|f| !f.ends_with("profile/src/clock.rs"))
        .filter_map(|f| std::fs::read_to_string(&f).ok().map(|s| (f, s)))
        .collect()
}

/// Every check on the workspace at `root`: the problems found (empty: tidy).
pub fn check(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let cs = crates(root);
    for (name, dir, _) in &cs {
        let g = graph_of_dir(&dir.join("src"));
        out.extend(cycles(&g).into_iter().map(|c| format!("{name}: module cycle {c}")));
        if name == "ironweave-ops" {
            out.extend(upward(&g, OPS_LAYERS).into_iter().map(|u| format!("{name}: upward import: {u}")));
        }
    }
    out.extend(crate_upward(&cs, CRATE_LAYERS).into_iter().map(|u| format!("upward crate dependency: {u}")));
    let mut cli = Vec::new();
    rust_files(&root.join("crates/cli/src"), &mut cli);
    let cli: Vec<(PathBuf, String)> = cli.into_iter().filter_map(|f| std::fs::read_to_string(&f).ok().map(|s| (f, s))).collect();
    out.extend(cli_violations(&cli).into_iter().map(|v| format!("ironweave-cli: {v}")));
    out.extend(unused_deps(&root.join("crates/cli")).into_iter().map(|d| format!("ironweave-cli lists `{d}` and never uses it")));
    out.extend(backend_uses(root));
    out.extend(impure(&pure_sources(root)));
    out.extend(forbidden_deps(&cs, FORBIDDEN_DEPS));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    fn synth(files: &[(&str, &str)]) -> ModGraph {
        let src = Path::new("/src");
        let v: Vec<(PathBuf, String)> = files.iter().map(|(f, t)| (src.join(f), t.to_string())).collect();
        graph_of(src, &v)
    }

    #[test]
    fn the_workspace_is_tidy() {
        let problems = check(&root());
        assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n"));
    }

    #[test]
    fn a_tensor_library_under_an_engine_is_found() {
        let cs = vec![
            ("ironweave-sdp".to_string(), PathBuf::new(), vec!["candle-core".to_string(), "thiserror".to_string()]),
            ("ironweave".to_string(), PathBuf::new(), vec!["candle-core".to_string()]),
            ("ironweave-tcp".to_string(), PathBuf::new(), vec!["tokio".to_string()]),
        ];
        let v = forbidden_deps(&cs, FORBIDDEN_DEPS);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(
            v[0].contains("`ironweave-sdp` depends on `candle-core`") && v[1].contains("`ironweave-tcp` depends on `tokio`"),
            "{v:?}"
        );
    }

    #[test]
    fn io_or_a_clock_in_a_deterministic_core_is_found() {
        let files = vec![(
            PathBuf::from("crates/sim/src/engine.rs"),
            "// Instant::now in a comment is fine\nfn f() -> u64 {\n    let t = std::time::Instant::now();\n    let s = \"std::fs\";\n    std::fs::read(\"x\").map_or(0, |v| v.len() as u64)\n}\n"
                .to_string(),
        )];
        let v = impure(&files);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].contains("engine.rs:3: `Instant::now`") && v[1].contains("engine.rs:5: `std::fs`"), "{v:?}");
        assert!(pure_sources(&root()).len() > 10, "the deterministic cores' sources are found");
    }

    #[test]
    fn an_injected_cycle_is_found_with_where_it_is() {
        // a -> b through a use tree, b -> a through a re-export at the root
        let g = synth(&[
            ("lib.rs", "mod a;\nmod b;\npub use a::Thing;\n"),
            ("a.rs", "use crate::{b::Other, x};\npub struct Thing;\n"),
            ("b.rs", "pub struct Other;\nfn f() -> crate::Thing { todo!() }\n"),
        ]);
        let c = cycles(&g);
        assert_eq!(c.len(), 1, "{c:?}");
        assert!(c[0].contains("a -> b (/src/a.rs:1)") && c[0].contains("b -> a (/src/b.rs:2)"), "{c:?}");
        // without the back reference: none; a child using its parent is no cycle; comments,
        // strings and test modules are not read
        let g = synth(&[
            ("lib.rs", "mod a;\nmod b;\npub use a::Thing;\n"),
            ("a.rs", "use crate::b::Other;\npub struct Thing;\n"),
            (
                "b.rs",
                "// crate::a::Thing\npub struct Other;\nconst S: &str = \"crate::a::Thing\";\n#[cfg(test)]\nmod tests {\n    use crate::a::Thing;\n}\n",
            ),
            ("b/c.rs", "use super::Other;\n"),
        ]);
        assert!(cycles(&g).is_empty(), "{:?}", cycles(&g));
    }

    #[test]
    fn an_injected_upward_import_is_found() {
        let layers: &[&[&str]] = &[&["base"], &["top"]];
        let g =
            synth(&[("lib.rs", "mod base;\nmod top;\n"), ("base.rs", "pub fn f() {}\n"), ("top.rs", "use crate::base::f;\n")]);
        assert!(upward(&g, layers).is_empty());
        let g = synth(&[
            ("lib.rs", "mod base;\nmod top;\n"),
            ("base.rs", "pub fn f() { super::top::g() }\n"),
            ("top.rs", "pub fn g() {}\n"),
        ]);
        let u = upward(&g, layers);
        assert_eq!(u.len(), 1, "{u:?}");
        assert!(u[0].contains("`base` (layer 0) imports `top` (layer 1)"), "{u:?}");
        // between crates
        let cs = vec![
            ("ironweave-units".to_string(), PathBuf::new(), vec![]),
            ("ironweave-transport".to_string(), PathBuf::new(), vec!["ironweave-ckpt".to_string()]),
        ];
        let u = crate_upward(&cs, CRATE_LAYERS);
        assert!(u.len() == 1 && u[0].contains("`ironweave-transport` (layer 1) depends on `ironweave-ckpt`"), "{u:?}");
    }

    #[test]
    fn an_injected_table_in_the_cli_is_found() {
        let src = vec![(
            PathBuf::from("crates/cli/src/main.rs"),
            "fn main() {\n    println!(\"| a | b |\");\n    let x: Vec<u8> = serde_json::from_slice(&[]).unwrap();\n    println!(\"{x:?}\");\n    eprintln!(\"error\");\n    std::fs::write(\"f\", \"\");\n}\n"
                .to_string(),
        )];
        let v = cli_violations(&src);
        assert_eq!(v.len(), 4, "{v:?}");
        assert!(v[0].contains("main.rs:2: prints a table") && v[1].contains("main.rs:3: reads JSON"), "{v:?}");
        assert!(v[2].contains("main.rs:4: prints to stdout") && v[3].contains("main.rs:6: reads or writes files"), "{v:?}");
    }

    #[test]
    fn use_trees_expand_groups_renames_and_self() {
        let t = strip("use crate::{a::{b, c as d}, e::self, f::*};\npub(crate) use super::g;\n");
        let u = use_trees(&t, false);
        let paths: Vec<String> = u.iter().map(|(p, _)| p.join("::")).collect();
        assert_eq!(paths, ["crate::a::b", "crate::a::c", "crate::e", "crate::f", "super::g"]);
        assert_eq!(use_trees(&t, true).len(), 1);
    }
}
