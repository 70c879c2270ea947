//! `orthonets view`'s page: one self-contained HTML file (the view's data as JSON, cytoscape.js
//! and the fcose layout embedded; no server, no network). Two panels, organism 1's
//! neighbourhood left and organism 2's right, orthology drawn dashed across them, conserved
//! edges highlighted, overlaid pairs coloured by their class, annotations on hover and in the
//! side panel, search by gene symbol.

use serde_json::json;

use crate::export::description;
use crate::view::View;

/// The page's template (`assets/view.html`).
const TEMPLATE: &str = include_str!("../assets/view.html");

/// The vendored JavaScript (`assets/vendor/`, from npm; versions, licenses and checksums in
/// its README.md and SHA256SUMS).
pub const VENDORED: [(&str, &str); 4] = [
    ("cytoscape.min.js", include_str!("../assets/vendor/cytoscape.min.js")),
    ("layout-base.js", include_str!("../assets/vendor/layout-base.js")),
    ("cose-base.js", include_str!("../assets/vendor/cose-base.js")),
    ("cytoscape-fcose.js", include_str!("../assets/vendor/cytoscape-fcose.js")),
];

/// The view's data as the page reads it.
pub fn data(v: &View) -> serde_json::Value {
    let nodes: Vec<_> = v
        .nodes
        .iter()
        .map(|n| {
            json!({
                "organism": n.organism, "name": n.name, "hop": n.hop, "in_network": n.in_network,
                "full_name": n.full_name, "go": n.go, "go_count": n.go_count,
                "diseases": n.diseases, "disease_count": n.disease_count,
            })
        })
        .collect();
    let edges: Vec<_> = v
        .edges
        .iter()
        .map(|e| {
            json!({
                "source": e.source, "target": e.target, "kind": e.kind.name(), "score": e.score,
                "conserved": e.conserved, "status": e.status, "interolog": e.interolog, "shared_go": e.shared_go,
            })
        })
        .collect();
    json!({
        "seed": v.spec.seed, "hops": v.spec.hops, "organisms": v.spec.organisms, "description": description(v),
        "nodes": nodes, "edges": edges, "top_go": v.top_go, "top_diseases": v.top_diseases,
    })
}

fn escape_html(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The page of `v`.
pub fn render(v: &View) -> String {
    // `<` escaped so no string in the data can close the script element
    let data = data(v).to_string().replace('<', "\\u003c");
    let title = escape_html(&format!("{} in {} and {}", v.spec.seed, v.spec.organisms[0], v.spec.organisms[1]));
    let fills = [
        ("__TITLE__", title.as_str()),
        ("__DATA__", data.as_str()),
        ("__CYTOSCAPE__", VENDORED[0].1),
        ("__LAYOUT_BASE__", VENDORED[1].1),
        ("__COSE_BASE__", VENDORED[2].1),
        ("__FCOSE__", VENDORED[3].1),
    ];
    // one pass over the template, so nothing filled in is searched again
    let mut out = String::with_capacity(TEMPLATE.len() + fills.iter().map(|f| f.1.len()).sum::<usize>());
    let mut rest = TEMPLATE;
    while let Some((at, key, val)) = fills.iter().filter_map(|&(k, val)| rest.find(k).map(|i| (i, k, val))).min_by_key(|f| f.0) {
        out.push_str(&rest[..at]);
        out.push_str(val);
        rest = &rest[at + key.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn the_vendored_files_are_the_ones_recorded() {
        let sums = include_str!("../assets/vendor/SHA256SUMS");
        for (name, text) in VENDORED {
            let want = sums
                .lines()
                .find_map(|l| l.strip_suffix(name).map(str::trim))
                .unwrap_or_else(|| panic!("{name} not in SHA256SUMS"));
            let got: String = Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(got, want, "{name} differs from the copy recorded in assets/vendor/SHA256SUMS");
        }
    }

    #[test]
    fn every_placeholder_is_filled_once() {
        for key in ["__TITLE__", "__DATA__", "__CYTOSCAPE__", "__LAYOUT_BASE__", "__COSE_BASE__", "__FCOSE__"] {
            assert!(TEMPLATE.contains(key), "{key}");
        }
        assert_eq!(TEMPLATE.matches("__DATA__").count(), 1);
    }
}
