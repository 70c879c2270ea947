//! The loaders on the real files (installed by name by `scripts/deps.sh`; the mouse network is
//! committed): exact counts, checked independently with Python's csv module when written.

use ironweave_orthonets::edges::{self, Columns};
use ironweave_orthonets::ortho::{self, Kind};
use ironweave_orthonets::{conserved, data};

fn need(s: data::Shipped) -> std::path::PathBuf {
    s.require().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn string_human_biogrid_mouse_and_biomart_orthologs_load_with_their_exact_counts() {
    let human = edges::load(&need(data::STRING_HUMAN), &Columns::Auto).unwrap();
    assert_eq!((human.net.node_count(), human.net.edge_count()), (12_173, 97_928));
    assert_eq!((human.counts.self_loops, human.counts.duplicates, human.blank), (0, 0, 0));
    // STRING's high-confidence cut: every score at least 0.9
    assert!(human.net.edges().all(|(_, _, s)| (0.9..=1.0).contains(&s)));
    assert!(human.seconds < 2.0, "the human network took {:.2} s to load", human.seconds);
    let mouse = edges::load(&data::biogrid_mouse(), &Columns::Auto).unwrap();
    assert_eq!((mouse.net.node_count(), mouse.net.edge_count()), (5_288, 11_695));
    let map = ortho::load(&need(data::BIOMART_HUMAN_MOUSE), &human.net, &mouse.net).unwrap();
    let map_p = ironweave_orthonets::conserved::Projection::new(&map.orthology, &human.net, &mouse.net);
    assert!(!map.swapped && map.warnings.is_empty(), "{:?}", map.warnings);
    assert_eq!(map.orthology.relations.len(), 24_970);
    assert_eq!(map.orthology.kinds(), [(Kind::OneToOne, 17_060), (Kind::OneToMany, 2_746), (Kind::ManyToMany, 5_164)]);
    assert_eq!((map_p.mapped1(), map_p.mapped2()), (4_226, 4_193));
    let c = conserved::conservation(&human.net, &mouse.net, &map_p);
    assert_eq!((c.edges, c.testable, c.conserved), (97_928, 31_552, 2_240));
}

#[test]
fn hcop_weights_count_the_supporting_databases() {
    let human = edges::load(&need(data::STRING_HUMAN), &Columns::Auto).unwrap();
    let mouse = edges::load(&data::biogrid_mouse(), &Columns::Auto).unwrap();
    let map = ortho::load(&need(data::HCOP_HUMAN_MOUSE), &human.net, &mouse.net).unwrap();
    assert_eq!(map.orthology.relations.len(), 66_790);
    assert_eq!(map.blank, 1_062);
    let w: Vec<f32> = map.orthology.relations.iter().map(|r| r.weight).collect();
    assert!(w.iter().all(|&x| x > 0.0 && x <= 1.0) && w.contains(&1.0));
    // TP53's one mouse ortholog is Trp53
    let tp53 = map.orthology.a.get("TP53").unwrap();
    let to: Vec<&str> = map.orthology.relations.iter().filter(|r| r.a == tp53).map(|r| map.orthology.b.name(r.b)).collect();
    assert_eq!(to, ["Trp53"]);
}

#[test]
fn the_orthologs_read_the_other_way_round_are_swapped_to_match_the_networks() {
    let human = edges::load(&need(data::STRING_HUMAN), &Columns::Auto).unwrap();
    let mouse = edges::load(&data::biogrid_mouse(), &Columns::Auto).unwrap();
    let map = ortho::load(&need(data::BIOMART_HUMAN_MOUSE), &mouse.net, &human.net).unwrap();
    let map_p = ironweave_orthonets::conserved::Projection::new(&map.orthology, &mouse.net, &human.net);
    assert!(map.swapped);
    assert_eq!((map_p.mapped1(), map_p.mapped2()), (4_193, 4_226));
}

#[test]
fn liana_s_pairs_read_as_a_network_keyed_by_gene_symbol() {
    let pairs = edges::load(&need(data::LIANA_PAIRS), &Columns::Auto).unwrap();
    assert!(pairs.layout.contains("source_genesymbol"), "{}", pairs.layout);
    assert!(pairs.net.edge_count() > 1_000);
}

#[test]
fn the_annotations_load_from_bioconductor_s_and_hpo_s_files() {
    let a = ironweave_orthonets::annot::Annotations::load(&data::annotation_sources().unwrap()).unwrap();
    // counts checked independently with Python's csv module
    assert_eq!(a.annotated_genes(), 20_791);
    let p = a.protein("TP53");
    assert_eq!((p.entrez, p.full_name), (Some("7157"), Some("tumor protein p53")));
    assert_eq!((p.go.len(), p.diseases.len()), (184, 19));
    assert!(p.diseases.iter().any(|d| d.id == "OMIM:151623" && d.name == "Li-Fraumeni syndrome"), "{:?}", p.diseases);
    assert_eq!(a.shared_go("TP53", "BRCA1").len(), 22);
    assert_eq!(a.shared_go("BRCA1", "TP53").len(), 22);
}
