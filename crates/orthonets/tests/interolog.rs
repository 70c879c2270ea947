//! Overlay and the interolog test on hand-checked networks, and on the real data.

use std::path::PathBuf;

use ironweave_orthonets::edges::{self, Columns};
use ironweave_orthonets::overlay::{self, Status};
use ironweave_orthonets::validate::{self, OrthologIndex, SplitMix64, Support};
use ironweave_orthonets::{data, ortho};

fn file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("orthonets-interolog-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn every_row_of_a_list_gets_its_class() {
    let h = edges::load(&file("h.tsv", b"A\tB\t0.9\nB\tC\t0.8\n"), &Columns::Auto).unwrap();
    let list = edges::read_pairs(&file("l.tsv", b"B\tA\t0.3\nA\tC\nC\tX\nD\tD\nA\tC\nC\tA\n"), &Columns::Auto).unwrap();
    let ov = overlay::overlay(&h.net, &list);
    let st: Vec<Status> = ov.rows.iter().map(|r| r.status).collect();
    assert_eq!(
        st,
        [Status::Known, Status::NewBetweenKnown, Status::NewProtein, Status::SelfPair, Status::Duplicate, Status::Duplicate]
    );
    assert_eq!(ov.rows[0].db_score, Some(0.9));
    assert_eq!(ov.rows.iter().map(|r| r.pair.line).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    assert_eq!((ov.proteins, ov.proteins_known), (5, 3));
}

#[test]
fn a_list_in_other_identifiers_is_warned_with_the_type_it_seems_to_use() {
    let h = edges::load(&file("h2.tsv", b"TP53\tMDM2\nEGFR\tGRB2\n"), &Columns::Auto).unwrap();
    let list = edges::read_pairs(&file("u.tsv", b"P04637\tQ00987\nP00533\tP62993\n"), &Columns::Auto).unwrap();
    let w = overlay::overlay(&h.net, &list).warning.unwrap();
    assert!(w.contains("look like UniProt accessions, the network's like gene symbols"), "{w}");
    let mouse_case = edges::read_pairs(&file("m.tsv", b"Tp53\tMdm2\nEgfr\tGrb2\n"), &Columns::Auto).unwrap();
    let w = overlay::overlay(&h.net, &mouse_case).warning.unwrap();
    assert!(w.contains("upper-casing them would match"), "{w}");
}

#[test]
fn a_complex_is_classified_and_tested_by_its_subunits() {
    let h = edges::load(&file("hc.tsv", b"A\tB\t0.7\nC\tD\n"), &Columns::Auto).unwrap();
    let list = edges::read_pairs(&file("lc.tsv", b"A\tB_C\nD\tB_X\nD\tA_B\nA_B\tC\n"), &Columns::Auto).unwrap();
    let ov = overlay::overlay(&h.net, &list);
    let st: Vec<Status> = ov.rows.iter().map(|r| r.status).collect();
    // A with B_C: A-B is an edge; D with B_X: X unknown; D with A_B: neither D-A nor D-B
    assert_eq!(st, [Status::Known, Status::NewProtein, Status::NewBetweenKnown, Status::NewBetweenKnown]);
    assert_eq!(ov.rows[0].db_score, Some(0.7));
    assert!(ov.rows.iter().all(|r| r.complex));
    assert_eq!((ov.complexes(), ov.proteins, ov.proteins_known), (4, 5, 4));
    // the interolog test of a complex: its subunits' orthologs together
    let m = edges::load(&file("mc.tsv", b"a\tc\t0.5\n"), &Columns::Auto).unwrap();
    let o = ortho::load(&file("oc.csv", b"a,b\nA,a\nC,c\n"), &h.net, &m.net).unwrap();
    let idx = OrthologIndex::new(&o.orthology, &m.net);
    let ev = validate::evidence(&m.net, &idx, "B_C", "A");
    assert_eq!((ev.support, ev.score), (Support::Supported, 0.5));
    assert_eq!(validate::evidence(&m.net, &idx, "B_X", "A").support, Support::Untestable);
}

/// Organism 1: A, B, C, D; organism 2: a-b (1.0), b-c (0.5); orthologs A→a (1), B→b (0.5),
/// B→b2 (1, b2 isolated), C→c (1); D has none.
#[test]
fn the_interolog_score_is_the_best_ortholog_pair_symmetric_and_in_0_1() {
    let h = edges::load(&file("h3.tsv", b"A\tD\n"), &Columns::Auto).unwrap();
    let m = edges::load(&file("m3.tsv", b"a\tb\t1\nb\tc\t0.5\nb2\tz\t1\n"), &Columns::Auto).unwrap();
    let o = ortho::load(&file("o3.csv", b"a,b,type,weight\nA,a,,1\nB,b,,0.5\nB,b2,,1\nC,c,,1\n"), &h.net, &m.net).unwrap();
    let idx = OrthologIndex::new(&o.orthology, &m.net);
    let ab = validate::evidence(&m.net, &idx, "A", "B");
    // A-B: a-b scores 1 × 0.5 × 1; a-b2 does not interact
    assert_eq!((ab.support, ab.score, ab.pairs.len()), (Support::Supported, 0.5, 1));
    assert_eq!(validate::evidence(&m.net, &idx, "B", "A"), ab);
    // B-C: b-c 0.5 × 1 × 0.5
    assert_eq!(validate::evidence(&m.net, &idx, "C", "B").score, 0.25);
    // A-C: both have orthologs, a and c do not interact
    assert_eq!(validate::evidence(&m.net, &idx, "A", "C").support, Support::Unsupported);
    assert_eq!(validate::evidence(&m.net, &idx, "A", "D").support, Support::Untestable);
    assert_eq!(validate::support_rate(&m.net, &idx, &[("A", "B"), ("A", "C"), ("A", "D")]), Some(0.5));
}

#[test]
fn rewiring_keeps_every_degree_and_is_reproducible_from_its_seed() {
    let m = edges::load(&data::biogrid_mouse(), &Columns::Auto).unwrap();
    let r1 = validate::rewire(&m.net, &mut SplitMix64::new(7));
    let r2 = validate::rewire(&m.net, &mut SplitMix64::new(7));
    assert_eq!(r1.edge_count(), m.net.edge_count());
    for v in 0..m.net.node_count() as u32 {
        assert_eq!(r1.degree(v), m.net.degree(v));
    }
    let e1: Vec<_> = r1.edges().collect();
    assert_eq!(e1, r2.edges().collect::<Vec<_>>());
    let kept = e1.iter().filter(|&&(a, b, _)| m.net.edge(a, b).is_some()).count();
    assert!(kept * 10 < e1.len(), "{kept} of {} edges survived the rewiring", e1.len());
}

#[test]
fn liana_s_consensus_pairs_on_string_and_their_interologs_in_biogrid_mouse() {
    let human = edges::load(&data::STRING_HUMAN.require().unwrap(), &Columns::Auto).unwrap();
    let mouse = edges::load(&data::biogrid_mouse(), &Columns::Auto).unwrap();
    let o = ortho::load(&data::BIOMART_HUMAN_MOUSE.require().unwrap(), &human.net, &mouse.net).unwrap();
    let path = data::LIANA_PAIRS.require().unwrap();
    let list = edges::read_pairs_where(&path, &Columns::Auto, Some(("resource", "consensus"))).unwrap();
    assert_eq!(list.pairs.len(), 4_620);
    let ov = overlay::overlay(&human.net, &list);
    let counts: Vec<usize> = ov.counts().iter().map(|c| c.1).collect();
    // 1,097 rows name a complex (`ITGA1_ITGB1`): classified by their subunits (checked
    // independently with Python's csv module)
    assert_eq!(counts, [2_097, 2_115, 388, 0, 20]);
    assert_eq!(ov.complexes(), 1_097);
    let idx = OrthologIndex::new(&o.orthology, &mouse.net);
    let known: Vec<(&str, &str)> =
        ov.rows.iter().filter(|r| r.status == Status::Known).map(|r| (r.pair.a.as_str(), r.pair.b.as_str())).collect();
    let nt = validate::null_test(&mouse.net, &idx, &known, 5, 1).unwrap();
    // 84 of the 557 testable known pairs have an interolog in mouse; rewired mouse networks
    // support almost none
    assert!((nt.observed - 84.0 / 557.0).abs() < 1e-12, "{}", nt.observed);
    assert!(nt.null.iter().all(|&x| x < nt.observed));
    assert_eq!(nt.p_value, 1.0 / 6.0);
}
