//! Bad input gives an error that names the file and the line and says what to do; small
//! hand-checked networks give the conserved edges and the warnings they should.

use std::io::Write;
use std::path::PathBuf;

use ironweave_orthonets::edges::{self, Col, Columns};
use ironweave_orthonets::{conserved, ortho, Error};

fn file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("orthonets-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn err(name: &str, bytes: &[u8]) -> String {
    let e = edges::load(&file(name, bytes), &Columns::Auto).unwrap_err();
    e.to_string()
}

#[test]
fn empty_one_column_non_utf8_and_bad_scores_are_errors_naming_file_and_line() {
    assert!(err("empty.tsv", b"").contains("empty.tsv: no records"));
    assert!(err("comments.tsv", b"# only\n\n").contains("no records"));
    assert!(err("one.tsv", b"A\nB\n").contains("one column"));
    let e = err("latin1.tsv", b"A\tB\t0.5\nC\t\xe9t\xe9\t0.7\n");
    assert!(e.contains("latin1.tsv:2: not UTF-8"), "{e}");
    let e = err("nan.tsv", b"A\tB\t0.5\nC\tD\tNaN\n");
    assert!(e.contains("nan.tsv:2: score \"NaN\" is outside [0, 1]"), "{e}");
    let e = err("neg.csv", b"gene1,gene2,score\nA,B,-0.1\n");
    assert!(e.contains("neg.csv:2: score \"-0.1\""), "{e}");
    let e = err("big.tsv", b"protein1 protein2 combined_score\nA B 1200\n");
    assert!(e.contains("after dividing STRING's combined_score by 1000"), "{e}");
    let e = err("short.tsv", b"A\tB\t0.5\nC\n");
    assert!(e.contains("short.tsv:2: 1 fields"), "{e}");
    let e = err("quote.csv", b"a,b\n\"A,B\n");
    assert!(e.contains("quote.csv:2: a quoted field is not closed"), "{e}");
}

#[test]
fn a_truncated_gz_is_an_error_not_a_panic_and_a_whole_one_reads() {
    let body: String = (0..2000).map(|i| format!("P{i}\tP{}\t0.{}\n", i + 1, i % 9 + 1)).collect();
    let whole = gz(body.as_bytes());
    let ok = edges::load(&file("whole.tsv.gz", &whole), &Columns::Auto).unwrap();
    assert_eq!(ok.net.edge_count(), 2000);
    let e = edges::load(&file("cut.tsv.gz", &whole[..whole.len() / 2]), &Columns::Auto).unwrap_err();
    assert!(matches!(e, Error::Io { .. }) && e.to_string().contains("truncated or corrupt .gz"), "{e}");
}

#[test]
fn columns_are_found_by_header_or_given() {
    // STRING's own links: spaces, a header, scores 0-1000
    let s = edges::load(
        &file("links.txt", b"protein1 protein2 combined_score\n9606.A 9606.B 950\n9606.B 9606.A 900\n9606.C 9606.C 999\n"),
        &Columns::Auto,
    )
    .unwrap();
    assert_eq!((s.net.edge_count(), s.counts.duplicates, s.counts.self_loops), (1, 1, 1));
    assert_eq!(s.net.edge(0, 1), Some(0.95));
    let given = Columns::Given { a: Col::Name("x".into()), b: Col::Index(2), score: None };
    let g = edges::load(&file("given.tsv", b"x\ty\tz\nA\t-\tB\nC\tD\t\n"), &given).unwrap();
    // a row without an identifier is skipped and counted
    assert_eq!((g.net.edge_count(), g.blank), (1, 1));
    let e = edges::load(
        &file("given2.tsv", b"x\ty\nA\tB\n"),
        &Columns::Given { a: Col::Name("nope".into()), b: Col::Index(1), score: None },
    )
    .unwrap_err();
    assert!(e.to_string().contains("no column named \"nope\""), "{e}");
}

/// Human triangle A-B-C with a tail C-D; mouse a-b-c triangle. A-B, B-C, A-C are conserved,
/// C-D is not testable (D has no ortholog).
#[test]
fn a_conserved_triangle_is_found_both_ways_with_symmetric_scores() {
    let h = edges::load(&file("h.tsv", b"A\tB\t0.9\nB\tC\t0.8\nA\tC\t0.7\nC\tD\t0.6\n"), &Columns::Auto).unwrap();
    let m = edges::load(&file("m.tsv", b"a\tb\t1\nb\tc\t0.5\nc\ta\t0.25\nc\te\t1\n"), &Columns::Auto).unwrap();
    let o =
        ortho::load(&file("o.csv", b"a,b,type,weight\nA,a,one2one,1\nB,b,one2one,0.5\nC,c,one2one,1\n"), &h.net, &m.net).unwrap();
    let o_p = conserved::Projection::new(&o.orthology, &h.net, &m.net);
    let c = conserved::conservation(&h.net, &m.net, &o_p);
    assert_eq!((c.edges, c.testable, c.conserved), (4, 3, 3));
    let id = |n: &ironweave_orthonets::graph::Network, s: &str| n.nodes.get(s).unwrap();
    let (a, b) = (id(&h.net, "A"), id(&h.net, "B"));
    // weight(A,a) × weight(B,b) × score(a-b) = 1 × 0.5 × 1, the same asked either way round
    let ab = conserved::best_interolog(&m.net, &o_p, a, b).unwrap();
    let ba = conserved::best_interolog(&m.net, &o_p, b, a).unwrap();
    assert_eq!((ab.2, ba.2), (0.5, 0.5));
    let back = conserved::conservation(&m.net, &h.net, &o_p.reversed());
    assert_eq!((back.edges, back.testable, back.conserved), (4, 3, 3));
    for (x, y, _) in h.net.edges() {
        if let Some((_, _, v)) = conserved::best_interolog(&m.net, &o_p, x, y) {
            assert!((0.0..=1.0).contains(&v));
        }
    }
}

#[test]
fn an_ortholog_table_for_other_species_is_refused_and_a_translated_network_warned() {
    let h = edges::load(&file("h2.tsv", b"A\tB\nB\tC\nA\tC\n"), &Columns::Auto).unwrap();
    let m = edges::load(&file("m2.tsv", b"a\tb\nb\tc\n"), &Columns::Auto).unwrap();
    let e = ortho::load(&file("fly.csv", b"a,b\nX1,x1\nX2,x2\n"), &h.net, &m.net).unwrap_err();
    assert!(e.to_string().contains("fly.csv: its names match 0.0% of network 1's nodes"), "{e}");
    // network 2 with network 1's own identifiers: the interolog test would be circular
    let same = edges::load(&file("same.tsv", b"A\tB\nB\tC\n"), &Columns::Auto).unwrap();
    let o = ortho::load(&file("id.csv", b"a,b\nA,A\nB,B\nC,C\n"), &h.net, &same.net).unwrap();
    let o_p = ironweave_orthonets::conserved::Projection::new(&o.orthology, &h.net, &same.net);
    let w = conserved::translation_warning(&h.net, &same.net, &o_p).unwrap();
    assert!(w.contains("looks translated"), "{w}");
    // a measured pair is not warned about
    let o = ortho::load(&file("ok.csv", b"a,b\nA,a\nB,b\nC,c\n"), &h.net, &m.net).unwrap();
    let o_p = ironweave_orthonets::conserved::Projection::new(&o.orthology, &h.net, &m.net);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    assert_eq!(conserved::translation_warning(&h.net, &m.net, &o_p), None);
    let e = ortho::load(&file("w.csv", b"a,b,type,weight\nA,a,one2one,2\n"), &h.net, &m.net).unwrap_err();
    assert!(e.to_string().contains("w.csv:2: weight \"2\" is outside (0, 1]"), "{e}");
}

/// PSI-MITAB 2.5 as IntAct writes it (a `#` header, `uniprotkb:` identifiers, gene names among
/// the aliases, `intact-miscore`) and as BioGRID does (`entrez gene/locuslink:SYMBOL`).
const MITAB: &str = "#ID(s) interactor A\tID(s) interactor B\tAlt. ID(s) interactor A\tAlt. ID(s) interactor B\tAlias(es) interactor A\tAlias(es) interactor B\tInteraction detection method(s)\tPublication 1st author(s)\tPublication Identifier(s)\tTaxid interactor A\tTaxid interactor B\tInteraction type(s)\tSource database(s)\tInteraction identifier(s)\tConfidence value(s)
uniprotkb:P04637\tuniprotkb:Q00987\tintact:EBI-366083\tintact:EBI-389668\tpsi-mi:p53_human(display_long)|uniprotkb:TP53(gene name)\tuniprotkb:MDM2(gene name)\tpsi-mi:\"MI:0018\"(two hybrid)\tMomand et al. (1992)\tpubmed:1535557\ttaxid:9606(human)|taxid:9606(Homo sapiens)\ttaxid:9606(human)\tpsi-mi:\"MI:0915\"(physical association)\tpsi-mi:\"MI:0469\"(IntAct)\tintact:EBI-1\tintact-miscore:0.87
uniprotkb:Q00987\tuniprotkb:P04637\t-\t-\tuniprotkb:MDM2(gene name)\tuniprotkb:TP53(gene name)\tpsi-mi:\"MI:0006\"(anti bait coimmunoprecipitation)\t-\tpubmed:8875929\ttaxid:9606\ttaxid:9606\t-\t-\tintact:EBI-2\tintact-miscore:0.5
entrez gene/locuslink:4193\tentrez gene/locuslink:7157\tbiogrid:110358|entrez gene/locuslink:MDM2\tbiogrid:112967|entrez gene/locuslink:TP53\t-\t-\tpsi-mi:\"MI:0004\"(affinity chromatography technology)\t-\tpubmed:1\ttaxid:9606\ttaxid:9606\t-\tpsi-mi:\"MI:0463\"(biogrid)\tbiogrid:1\tscore:-
uniprotkb:P04637\tuniprotkb:P38398\t-\t-\tuniprotkb:TP53(gene name)\t-\t-\t-\t-\ttaxid:9606\ttaxid:9606\t-\t-\t-\t-
uniprotkb:P04637\tuniprotkb:P02340\t-\t-\tuniprotkb:TP53(gene name)\tuniprotkb:Trp53(gene name)\t-\t-\t-\ttaxid:9606\ttaxid:10090\t-\t-\t-\t-
uniprotkb:P04637\tuniprotkb:P04637\t-\t-\tuniprotkb:TP53(gene name)\tuniprotkb:TP53(gene name)\t-\t-\t-\ttaxid:9606\ttaxid:9606\t-\t-\t-\t-
";

#[test]
fn psi_mitab_reads_gene_names_scores_and_skips_interspecies_rows() {
    let l = edges::read_pairs(&file("intact.mitab", MITAB.as_bytes()), &Columns::Auto).unwrap();
    assert!(l.layout.starts_with("PSI-MITAB 2.5"), "{}", l.layout);
    let got: Vec<(&str, &str, Option<f32>, usize)> =
        l.pairs.iter().map(|p| (p.a.as_str(), p.b.as_str(), p.score, p.line)).collect();
    // BRCA1 has no gene name in its row: its accession stands for it; the TP53-Trp53 row is
    // between two species
    assert_eq!(
        got,
        [
            ("TP53", "MDM2", Some(0.87), 2),
            ("MDM2", "TP53", Some(0.5), 3),
            ("MDM2", "TP53", None, 4),
            ("TP53", "P38398", None, 5),
            ("TP53", "TP53", None, 7)
        ]
    );
    assert_eq!(l.interspecies, 1);
    let n = edges::load(&file("intact2.mitab", MITAB.as_bytes()), &Columns::Auto).unwrap();
    assert_eq!((n.net.node_count(), n.net.edge_count(), n.counts.self_loops, n.counts.duplicates), (3, 2, 1, 2));
    // merged keeping the highest score: the BioGRID row has none, and unscored edges count 1
    assert_eq!(n.net.edge(n.net.nodes.get("TP53").unwrap(), n.net.nodes.get("MDM2").unwrap()), Some(1.0));
    // a header line without `#` is recognised too; a negative confidence and a short row are errors
    let plain = MITAB.replacen('#', "", 1);
    assert_eq!(edges::read_pairs(&file("plain.mitab", plain.as_bytes()), &Columns::Auto).unwrap().pairs.len(), 5);
    let neg = MITAB.replace("intact-miscore:0.5", "intact-miscore:-0.5");
    let e = edges::read_pairs(&file("neg.mitab", neg.as_bytes()), &Columns::Auto).unwrap_err().to_string();
    assert!(e.contains("neg.mitab:3: confidence intact-miscore:-0.5"), "{e}");
    let short = format!("{MITAB}uniprotkb:P1\tuniprotkb:P2\t-\n");
    let e = edges::read_pairs(&file("short.mitab", short.as_bytes()), &Columns::Auto).unwrap_err().to_string();
    assert!(e.contains("short.mitab:8: 3 fields: PSI-MITAB 2.5 has 15"), "{e}");
}

#[test]
fn annotation_tables_with_missing_columns_or_short_rows_are_errors_naming_the_file() {
    use ironweave_orthonets::annot::{Annotations, Sources};
    let go = file("go.tsv", b"symbol\tgo_id\tontology\nTP53\tGO:1\tBP\nMDM2\tGO:1\tBP\nTP53\tGO:2\tCC\n");
    let terms = file("terms.tsv", b"go_id\tterm\tontology\nGO:1\tapoptosis\tBP\n");
    let a = Annotations::load(&Sources { go: Some(go.clone()), go_terms: Some(terms), ..Default::default() }).unwrap();
    let p = a.protein("TP53");
    // a term without a name keeps its id as its name
    assert_eq!(
        p.go.iter().map(|t| (t.id.as_str(), t.name.as_str())).collect::<Vec<_>>(),
        [("GO:1", "apoptosis"), ("GO:2", "GO:2")]
    );
    assert_eq!(a.shared_go("TP53", "MDM2").len(), 1);
    assert_eq!(a.top(&["TP53", "MDM2"], 5).0[0].1, 2);
    let bad = file("bad.tsv", b"gene\tgo\nTP53\tGO:1\n");
    let e = Annotations::load(&Sources { go: Some(bad), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("bad.tsv: no column \"symbol\""), "{e}");
    let short = file("short.tsv", b"symbol\tgo_id\tontology\nTP53\tGO:1\n");
    let e = Annotations::load(&Sources { go: Some(short), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("short.tsv:2: 2 fields"), "{e}");
}
