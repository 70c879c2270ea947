//! A [`View`] as GraphML (typed keys; networkx, Cytoscape and yEd read it) and as Cytoscape's
//! CX2 JSON (NDEx and Cytoscape 3.10+), so what `orthonets view` shows opens in Cytoscape.

use serde_json::{json, Map, Value};

use crate::view::{Edge, Node, View};

/// Attributes of nodes: (name, GraphML type), in [`node_values`]' order.
const NODE_KEYS: [(&str, &str); 7] = [
    ("name", "string"),
    ("organism", "int"),
    ("hop", "int"),
    ("in_network", "boolean"),
    ("full_name", "string"),
    ("go_terms", "int"),
    ("diseases", "string"),
];

fn node_values(n: &Node) -> [Value; 7] {
    [
        json!(n.name),
        json!(n.organism),
        json!(n.hop.map_or(-1, |h| h as i64)),
        json!(n.in_network),
        json!(n.full_name),
        json!(n.go_count),
        json!(n.diseases.join("; ")),
    ]
}

/// Attributes of edges, in [`edge_values`]' order.
const EDGE_KEYS: [(&str, &str); 7] = [
    ("kind", "string"),
    ("score", "double"),
    ("conserved", "boolean"),
    ("status", "string"),
    ("interolog", "string"),
    ("interolog_score", "double"),
    ("shared_go", "int"),
];

fn edge_values(e: &Edge) -> [Value; 7] {
    [
        json!(e.kind.name()),
        json!(e.score),
        json!(e.conserved),
        json!(e.status.unwrap_or("")),
        json!(e.interolog.map_or("", |i| i.0)),
        json!(e.interolog.map_or(0.0, |i| i.1)),
        json!(e.shared_go.len()),
    ]
}

/// `keys`' names with `values` as a JSON object.
fn object(keys: &[(&str, &str); 7], values: [Value; 7]) -> Map<String, Value> {
    keys.iter().map(|k| k.0.to_owned()).zip(values).collect()
}

fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            // characters XML 1.0 cannot carry
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => xml(s),
        v => v.to_string(),
    }
}

/// The view as GraphML: an undirected graph, node ids `n0..`, edge ids `e0..`, one typed key
/// per attribute, the provenance in the graph's `description` key.
pub fn graphml(v: &View) -> String {
    let mut o = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<graphml xmlns=\"http://graphml.graphdrawing.org/xmlns\" xmlns:xsi=\"http://www.w3.org/2001/XMLSchema-instance\" xsi:schemaLocation=\"http://graphml.graphdrawing.org/xmlns http://graphml.graphdrawing.org/xmlns/1.0/graphml.xsd\">\n",
    );
    o += "  <key id=\"g_description\" for=\"graph\" attr.name=\"description\" attr.type=\"string\"/>\n";
    for (k, t) in NODE_KEYS {
        o += &format!("  <key id=\"n_{k}\" for=\"node\" attr.name=\"{k}\" attr.type=\"{t}\"/>\n");
    }
    for (k, t) in EDGE_KEYS {
        o += &format!("  <key id=\"e_{k}\" for=\"edge\" attr.name=\"{k}\" attr.type=\"{t}\"/>\n");
    }
    o += "  <graph id=\"G\" edgedefault=\"undirected\">\n";
    o += &format!("    <data key=\"g_description\">{}</data>\n", xml(&description(v)));
    for (i, n) in v.nodes.iter().enumerate() {
        o += &format!("    <node id=\"n{i}\">\n");
        for ((k, _), val) in NODE_KEYS.iter().zip(node_values(n)) {
            o += &format!("      <data key=\"n_{k}\">{}</data>\n", text(&val));
        }
        o += "    </node>\n";
    }
    for (i, e) in v.edges.iter().enumerate() {
        o += &format!("    <edge id=\"e{i}\" source=\"n{}\" target=\"n{}\">\n", e.source, e.target);
        for ((k, _), val) in EDGE_KEYS.iter().zip(edge_values(e)) {
            o += &format!("      <data key=\"e_{k}\">{}</data>\n", text(&val));
        }
        o += "    </edge>\n";
    }
    o += "  </graph>\n</graphml>\n";
    o
}

/// One line saying what the view is and where its inputs came from.
pub fn description(v: &View) -> String {
    let mut d = format!(
        "OrthoNets view: {} ({}), {} hop(s), {} nodes of {} and {} of {}{}",
        v.spec.seed,
        v.spec.organisms[0],
        v.spec.hops,
        v.count(1),
        v.spec.organisms[0],
        v.count(2),
        v.spec.organisms[1],
        if v.truncated { format!(" (neighbourhoods cut at {} nodes)", v.spec.max_nodes) } else { String::new() }
    );
    for p in &v.provenance {
        d += "; ";
        d += p;
    }
    d
}

/// CX2's data type names for GraphML's.
fn cx2_type(t: &str) -> &'static str {
    match t {
        "int" => "integer",
        "double" => "double",
        "boolean" => "boolean",
        _ => "string",
    }
}

/// The view as CX2 (Cytoscape Exchange 2.0): the descriptor, metadata with the element
/// counts, attribute declarations, network attributes, nodes, edges and a status aspect.
/// Organism 1's nodes sit left of organism 2's (`x`, `y` from a grid per organism, so the two
/// networks open side by side before any layout).
pub fn cx2(v: &View) -> Value {
    let decl = |keys: &[(&str, &str)]| -> Map<String, Value> {
        keys.iter().map(|(k, t)| ((*k).to_owned(), json!({ "d": cx2_type(t) }))).collect()
    };
    let mut nodes = Vec::new();
    let mut seen = [0usize; 2];
    for (i, n) in v.nodes.iter().enumerate() {
        let side = usize::from(n.organism == 2);
        let k = seen[side];
        seen[side] += 1;
        let per_row = 12;
        let attrs = object(&NODE_KEYS, node_values(n));
        nodes.push(json!({
            "id": i,
            "x": (side as f64) * 1600.0 + (k % per_row) as f64 * 110.0,
            "y": (k / per_row) as f64 * 110.0,
            "v": attrs,
        }));
    }
    let edges: Vec<Value> = v
        .edges
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let attrs = object(&EDGE_KEYS, edge_values(e));
            json!({ "id": i, "s": e.source, "t": e.target, "v": attrs })
        })
        .collect();
    let (node_decl, edge_decl) = (decl(&NODE_KEYS), decl(&EDGE_KEYS));
    json!([
        { "CXVersion": "2.0", "hasFragments": false },
        { "metaData": [
            { "name": "attributeDeclarations", "elementCount": 1 },
            { "name": "networkAttributes", "elementCount": 1 },
            { "name": "nodes", "elementCount": nodes.len() },
            { "name": "edges", "elementCount": edges.len() },
        ]},
        { "attributeDeclarations": [{
            "networkAttributes": { "name": { "d": "string" }, "description": { "d": "string" } },
            "nodes": node_decl,
            "edges": edge_decl,
        }]},
        { "networkAttributes": [{ "name": format!("OrthoNets: {}", v.spec.seed), "description": description(v) }] },
        { "nodes": nodes },
        { "edges": edges },
        { "status": [{ "error": "", "success": true }] },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_text_is_escaped() {
        assert_eq!(xml("a<b & \"c\"\u{1}"), "a&lt;b &amp; &quot;c&quot; ");
    }
}
