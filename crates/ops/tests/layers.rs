//! Architecture invariants as tests (rust-analyzer's "tidy" checks): the operations' modules
//! import each other without a circle, and the binary stays argument parsing, printing and
//! dispatch.

use std::collections::BTreeMap;
use std::path::Path;

/// `crate::NAME` references of each module of crates/ops/src (lib.rs, the root, left out).
fn imports() -> BTreeMap<String, Vec<String>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut names = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.extension().is_some_and(|x| x == "rs") && stem != "lib" {
            names.push(stem);
        }
    }
    let mut g = BTreeMap::new();
    for m in &names {
        let text = std::fs::read_to_string(dir.join(format!("{m}.rs"))).unwrap();
        let mut refs: Vec<String> = Vec::new();
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            let word: String = rest.chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
            // `use crate::{a, b::c}`
            let words: Vec<String> = if rest.starts_with('{') {
                let inner = &rest[1..rest.find('}').unwrap_or(rest.len())];
                inner.split(',').map(|s| s.trim().split("::").next().unwrap_or("").to_string()).collect()
            } else {
                vec![word]
            };
            for w in words {
                if names.contains(&w) && &w != m && !refs.contains(&w) {
                    refs.push(w);
                }
            }
        }
        g.insert(m.clone(), refs);
    }
    g
}

#[test]
fn the_operations_import_each_other_without_a_circle() {
    let g = imports();
    assert!(g.len() > 10, "found the modules: {g:?}");
    // depth-first search; a module met again on the current path closes a circle
    fn visit(m: &str, g: &BTreeMap<String, Vec<String>>, path: &mut Vec<String>, done: &mut Vec<String>) {
        if let Some(at) = path.iter().position(|p| p == m) {
            panic!("the modules of crates/ops import each other in a circle: {} -> {m}", path[at..].join(" -> "));
        }
        if done.iter().any(|d| d == m) {
            return;
        }
        path.push(m.to_string());
        for n in &g[m] {
            visit(n, g, path, done);
        }
        path.pop();
        done.push(m.to_string());
    }
    let mut done = Vec::new();
    for m in g.keys() {
        visit(m, &g, &mut Vec::new(), &mut done);
    }
    // the base layer imports no operation
    for base in ["error", "progress", "cluster", "run", "backend"] {
        let ops: Vec<&String> = g[base].iter().filter(|x| !["error", "cluster", "progress"].contains(&x.as_str())).collect();
        assert!(ops.is_empty(), "{base} is in the base layer but imports {ops:?}");
    }
}

#[test]
fn the_binary_is_parsing_printing_and_dispatch() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cli/src");
    let mut lines = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let text = std::fs::read_to_string(&p).unwrap();
        lines += text.lines().count();
        // commands live in ironweave-ops: a module of the binary would be a command's home
        assert!(!text.lines().any(|l| l.trim_start().starts_with("mod ")), "{} declares a module", p.display());
    }
    assert!(lines <= 2500, "crates/cli/src holds {lines} lines (at most 2,500: capabilities go to crates/ops)");
}
