//! The view on a hand-checked pair of networks, and `orthonets view` / `export` on the real
//! data: the page opened in headless Chromium (two non-empty panels, a screenshot), GraphML
//! read back by networkx and CX2 by ndex2 with the view's counts.

use std::path::PathBuf;
use std::process::Command;

use ironweave_orthonets::edges::{self, Columns};
use ironweave_orthonets::view::{self, Kind, Spec};
use ironweave_orthonets::{conserved, export, ortho, overlay, validate, Error};
use ironweave_testkit::chromium;

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("orthonets-view-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn file(name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn spec(seed: &str, hops: usize, max_nodes: usize) -> Spec {
    Spec { seed: seed.into(), hops, max_nodes, organisms: ["human".into(), "mouse".into()] }
}

/// Human: a triangle A-B-C and C-D; mouse: a-b, b-c, c-a (a conserved triangle) and e-f;
/// orthologs A→a, B→b, C→c. The list adds A-X (X new) and B-D.
#[test]
fn a_conserved_triangle_shows_on_both_sides_with_its_orthology_and_overlay() {
    let h = edges::load(&file("h.tsv", b"A\tB\nB\tC\nC\tA\nC\tD\n"), &Columns::Auto).unwrap();
    let m = edges::load(&file("m.tsv", b"a\tb\nb\tc\nc\ta\ne\tf\n"), &Columns::Auto).unwrap();
    let o = ortho::load(&file("o.csv", b"a,b\nA,a\nB,b\nC,c\n"), &h.net, &m.net).unwrap();
    let proj = conserved::Projection::new(&o.orthology, &h.net, &m.net);
    let idx = validate::OrthologIndex::new(&o.orthology, &m.net);
    let list = edges::read_pairs(&file("l.tsv", b"A\tX\nB\tD\n"), &Columns::Auto).unwrap();
    let ov = overlay::overlay(&h.net, &list);
    let inp = view::Inputs { net1: &h.net, net2: &m.net, proj: &proj, idx: &idx, overlay: Some(&ov), annotations: None };
    let v = view::build(&spec("A", 1, 10), inp).unwrap();
    // human: A, its neighbours B and C, then X and D from the list's pairs; mouse: a, b, c
    assert_eq!((v.count(1), v.count(2)), (5, 3));
    let names = |o: u8| -> Vec<&str> { v.nodes.iter().filter(|n| n.organism == o).map(|n| n.name.as_str()).collect() };
    assert_eq!(names(1), ["A", "B", "C", "X", "D"]);
    assert_eq!(names(2), ["a", "b", "c"]);
    assert!(!v.nodes.iter().find(|n| n.name == "X").unwrap().in_network);
    assert!(v.nodes.iter().find(|n| n.name == "D").unwrap().in_network);
    // three interactions each side, all conserved; three ortholog links; A-X overlaid (B-D
    // touches B; D, not within one hop of A, joins as the pair's protein)
    let inter: Vec<_> = v.edges.iter().filter(|e| e.kind == Kind::Interaction).collect();
    assert_eq!(inter.len(), 6);
    assert!(inter.iter().all(|e| e.conserved));
    assert_eq!(v.edges_of(Kind::Ortholog), 3);
    let ovl: Vec<_> = v.edges.iter().filter(|e| e.kind == Kind::Overlay).collect();
    assert_eq!(ovl.len(), 2);
    assert_eq!(ovl[0].status, Some("new protein"));
    assert_eq!(ovl[0].interolog.unwrap().0, "untestable");
    assert_eq!(ovl[1].status, Some("new between known proteins"));
    assert!(!v.truncated);

    // the cut keeps the seed and the strongest neighbours
    let small = view::build(&spec("A", 2, 2), view::Inputs { overlay: None, ..inp }).unwrap();
    assert!(small.truncated);
    assert_eq!(small.count(1), 2);
    // a seed that differs in case: the error says which name was meant
    match view::build(&spec("a", 1, 10), inp) {
        Err(Error::Unknown { detail, .. }) => assert!(detail.contains("did you mean A?"), "{detail}"),
        other => panic!("{other:?}"),
    }
    // the exports carry every node and edge
    let g = export::graphml(&v);
    assert_eq!((g.matches("<node ").count(), g.matches("<edge ").count()), (8, 11));
    let cx = export::cx2(&v);
    let nodes = cx.as_array().unwrap().iter().find_map(|a| a.get("nodes")).unwrap();
    assert_eq!(nodes.as_array().unwrap().len(), 8);
}

const ORTHONETS: &str = env!("CARGO_BIN_EXE_orthonets");

fn run(args: &[&str]) -> String {
    let o = Command::new(ORTHONETS).args(args).current_dir(dir()).output().unwrap();
    assert!(o.status.success(), "orthonets {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `view of TP53: N + M proteins (human + mouse); I interactions (C conserved), O ortholog
/// links, P overlaid pairs` → (N, M, I + O + P).
fn counts(out: &str) -> (usize, usize, usize) {
    let line = out.lines().find(|l| l.starts_with("view of ")).unwrap_or_else(|| panic!("{out}"));
    let nums: Vec<usize> = line[line.find(": ").unwrap()..]
        .split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().unwrap())
        .collect();
    (nums[0], nums[1], nums[2] + nums[4] + nums[5])
}

#[test]
fn the_view_of_tp53_opens_in_chromium_and_its_exports_read_back_in_networkx_and_ndex2() {
    let d = dir();
    let page = d.join("tp53.html");
    let out = run(&["view", "--seed", "TP53", "--out", page.to_str().unwrap()]);
    let (n1, n2, edges) = counts(&out);
    assert!(n1 > 10 && n2 > 10, "{out}");

    let profile = d.join("chromium-profile");
    let dom = chromium(&profile)
        .args(["--virtual-time-budget=20000", "--window-size=1500,900", "--dump-dom"])
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.contains("data-ready=\"1\""), "the layouts did not finish");
    // both panels drew every protein of their organism; the orthology lines were drawn
    let attr = |id: &str, key: &str| -> usize {
        let at = dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id}"));
        let tail = &dom[at..];
        let v = tail.split(&format!("{key}=\"")).nth(1).unwrap();
        v[..v.find('"').unwrap()].parse().unwrap()
    };
    assert_eq!(attr("count1", "data-nodes"), n1);
    assert_eq!(attr("count2", "data-nodes"), n2);
    assert!(attr("links", "data-lines") > 0);
    assert!(dom.contains("tumor protein p53") || dom.contains("top GO terms"), "the side panel is empty");
    let shot = d.join("tp53.png");
    let o = chromium(&profile)
        .args(["--virtual-time-budget=20000", "--window-size=1500,900"])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    let png = std::fs::read(&shot).unwrap_or_else(|_| panic!("no screenshot: {}", String::from_utf8_lossy(&o.stderr)));
    assert!(png.starts_with(b"\x89PNG") && png.len() > 50_000, "a screenshot of {} bytes", png.len());

    let (gml, cx2) = (d.join("tp53.graphml"), d.join("tp53.cx2"));
    let out2 = run(&["export", "--seed", "TP53", "--graphml", gml.to_str().unwrap(), "--cx2", cx2.to_str().unwrap()]);
    assert_eq!(counts(&out2), (n1, n2, edges));
    let py = r#"
import json, sys
import networkx as nx
from ndex2.cx2 import RawCX2NetworkFactory
g = nx.read_graphml(sys.argv[1])
o1 = sum(1 for _, a in g.nodes(data=True) if a["organism"] == 1)
kinds = sorted({a["kind"] for _, _, a in g.edges(data=True)})
n = RawCX2NetworkFactory().get_cx2network(json.load(open(sys.argv[2])))
seed = [v["v"] for v in n.get_nodes().values() if v["v"]["name"] == "TP53"][0]
print(g.number_of_nodes(), g.number_of_edges(), o1, len(n.get_nodes()), len(n.get_edges()), ",".join(kinds), seed["hop"], seed["full_name"].replace(" ", "_"))
"#;
    let o = Command::new("python3").arg("-c").arg(py).arg(&gml).arg(&cx2).output().unwrap();
    assert!(
        o.status.success(),
        "networkx/ndex2 (pip install networkx ndex2; scripts/deps.sh does): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let got = String::from_utf8_lossy(&o.stdout);
    let want = format!("{} {edges} {n1} {} {edges} interaction,ortholog,overlay 0 tumor_protein_p53", n1 + n2, n1 + n2);
    assert_eq!(got.trim(), want);
}
