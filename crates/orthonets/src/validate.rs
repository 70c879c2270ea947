//! The interolog test: a new interaction A–B of organism 1 is supported when an ortholog of A
//! interacts with an ortholog of B in organism 2. Its score is the best
//! `weight(A, A') × weight(B, B') × score(A'–B')` over the ortholog pairs, in [0, 1] and the
//! same whichever way round the pair is written. How unusual a list's support rate is comes
//! from degree-preserving randomisations of organism 2's network (seeded, so reproducible).

use std::collections::{HashMap, HashSet};

use crate::graph::Network;
use crate::ortho::Orthology;
/// The workspace's one seeded generator: the randomisations are the same for the same seed on
/// every machine.
pub use ironweave_units::SplitMix64;

/// The interolog test's outcome for one pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Support {
    /// An ortholog pair interacts in organism 2.
    Supported,
    /// Both proteins have orthologs in organism 2's network; none of their pairs interact.
    Unsupported,
    /// A protein without an ortholog in organism 2's network: the test cannot say.
    Untestable,
}

impl Support {
    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Support::Supported => "supported",
            Support::Unsupported => "testable, unsupported",
            Support::Untestable => "untestable",
        }
    }
}

/// One pair's interolog evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct Evidence {
    /// The outcome.
    pub support: Support,
    /// The best ortholog pair's product (0 when unsupported or untestable).
    pub score: f32,
    /// Every interacting ortholog pair (organism 2's nodes) with its product, best first.
    pub pairs: Vec<(u32, u32, f32)>,
}

/// Organism 1's names → their orthologs among organism 2's network nodes.
#[derive(Debug, Clone, Default)]
pub struct OrthologIndex {
    map: HashMap<String, Vec<(u32, f32)>>,
}

impl OrthologIndex {
    /// Indexes `o`'s relations whose organism-2 protein is a node of `net2`.
    pub fn new(o: &Orthology, net2: &Network) -> OrthologIndex {
        let mut map: HashMap<String, Vec<(u32, f32)>> = HashMap::new();
        for r in &o.relations {
            if let Some(y) = net2.nodes.get(o.b.name(r.b)) {
                map.entry(o.a.name(r.a).to_owned()).or_default().push((y, r.weight));
            }
        }
        OrthologIndex { map }
    }

    /// The orthologs of organism 1's `name` in organism 2's network.
    pub fn get(&self, name: &str) -> &[(u32, f32)] {
        self.map.get(name).map_or(&[], Vec::as_slice)
    }

    /// [`OrthologIndex::get`], or for a complex without orthologs of its own
    /// ([`crate::overlay::complex_parts`]) its subunits' orthologs together.
    pub fn orthologs(&self, name: &str) -> std::borrow::Cow<'_, [(u32, f32)]> {
        match (self.map.get(name), crate::overlay::complex_parts(name)) {
            (Some(v), _) => v.as_slice().into(),
            (None, Some(parts)) => parts.iter().flat_map(|p| self.get(p)).copied().collect::<Vec<_>>().into(),
            (None, None) => (&[][..]).into(),
        }
    }
}

/// The interolog test of `a`–`b` (organism 1's names; a complex stands for its subunits)
/// against `net2`.
pub fn evidence(net2: &Network, idx: &OrthologIndex, a: &str, b: &str) -> Evidence {
    let (oa, ob) = (idx.orthologs(a), idx.orthologs(b));
    let (oa, ob) = (&oa[..], &ob[..]);
    if oa.is_empty() || ob.is_empty() {
        return Evidence { support: Support::Untestable, score: 0.0, pairs: Vec::new() };
    }
    let pairs = crate::conserved::interologs(net2, oa, ob);
    match pairs.first() {
        Some(&(_, _, s)) => Evidence { support: Support::Supported, score: s, pairs },
        None => Evidence { support: Support::Unsupported, score: 0.0, pairs },
    }
}

/// Supported over testable pairs of `pairs` against `net2` (`None` if none is testable).
pub fn support_rate(net2: &Network, idx: &OrthologIndex, pairs: &[(&str, &str)]) -> Option<f64> {
    let (mut testable, mut supported) = (0usize, 0usize);
    for (a, b) in pairs {
        match evidence(net2, idx, a, b).support {
            Support::Supported => {
                testable += 1;
                supported += 1;
            }
            Support::Unsupported => testable += 1,
            Support::Untestable => {}
        }
    }
    (testable > 0).then(|| supported as f64 / testable as f64)
}

/// The list's support rate beside the same rate on randomised organism-2 networks.
#[derive(Debug, Clone, PartialEq)]
pub struct NullTest {
    /// The rate on the real network.
    pub observed: f64,
    /// The rate on each randomisation.
    pub null: Vec<f64>,
    /// `(1 + randomisations at least as high) / (1 + randomisations)`.
    pub p_value: f64,
    /// The seed the randomisations were drawn with.
    pub seed: u64,
}

/// Compares the support rate of `pairs` with `rounds` degree-preserving randomisations of
/// `net2` (each `10 × edges` double-edge swaps, seeded by `seed`); `None` if no pair is
/// testable.
pub fn null_test(net2: &Network, idx: &OrthologIndex, pairs: &[(&str, &str)], rounds: usize, seed: u64) -> Option<NullTest> {
    let observed = support_rate(net2, idx, pairs)?;
    let mut rng = SplitMix64::new(seed);
    let null: Vec<f64> = (0..rounds).map(|_| support_rate(&rewire(net2, &mut rng), idx, pairs).unwrap_or(0.0)).collect();
    let above = null.iter().filter(|&&x| x >= observed).count();
    Some(NullTest { observed, p_value: (1 + above) as f64 / (1 + rounds) as f64, null, seed })
}

/// `net` with its edges rewired by double-edge swaps (A–B, C–D → A–D, C–B) that keep every
/// node's degree and never make a self-loop or a second copy of an edge; scores travel with
/// the swapped edges.
pub fn rewire(net: &Network, rng: &mut SplitMix64) -> Network {
    let mut e: Vec<(u32, u32, f32)> = net.edges().collect();
    let mut have: HashSet<(u32, u32)> = e.iter().map(|&(a, b, _)| (a, b)).collect();
    let key = |a: u32, b: u32| (a.min(b), a.max(b));
    let n = e.len();
    if n < 2 {
        return net.clone();
    }
    for _ in 0..10 * n {
        let (i, j) = (rng.below(n as u64) as usize, rng.below(n as u64) as usize);
        let ((a, b, s), (c, d, t)) = (e[i], e[j]);
        let (a, b) = if rng.next_u64() & 1 == 0 { (a, b) } else { (b, a) };
        if a == d || c == b || have.contains(&key(a, d)) || have.contains(&key(c, b)) || i == j {
            continue;
        }
        have.remove(&key(a, b));
        have.remove(&key(c, d));
        have.insert(key(a, d));
        have.insert(key(c, b));
        let (x, y) = key(a, d);
        e[i] = (x, y, s);
        let (x, y) = key(c, b);
        e[j] = (x, y, t);
    }
    Network::build(net.nodes.clone(), e).0
}

/// The interolog test of a group of an overlay's rows (its known or its new pairs).
#[derive(Debug, Clone)]
pub struct GroupReport {
    /// `known` or `new`.
    pub label: &'static str,
    /// Rows tested.
    pub rows: usize,
    /// Rows per outcome.
    pub outcomes: Vec<(Support, usize)>,
    /// The support rate against randomisations (`None`: no row testable).
    pub null: Option<NullTest>,
    /// One TSV line per row: line, a, b, overlay status, outcome, score, up to five
    /// supporting pairs of network 2.
    pub tsv: String,
}

/// The interolog test of `ov`'s known rows and of its new rows against `net2`.
pub fn validate_overlay(
    ov: &crate::overlay::Overlay,
    net2: &Network,
    idx: &OrthologIndex,
    rounds: usize,
    seed: u64,
) -> Vec<GroupReport> {
    use crate::overlay::Status;
    [("known", true), ("new", false)]
        .into_iter()
        .map(|(label, known)| {
            let rows: Vec<&crate::overlay::Row> =
                ov.rows.iter().filter(|r| if known { r.status == Status::Known } else { r.status.is_new() }).collect();
            let mut by = std::collections::BTreeMap::<Support, usize>::new();
            let mut tsv = String::new();
            for r in &rows {
                let ev = evidence(net2, idx, &r.pair.a, &r.pair.b);
                *by.entry(ev.support).or_default() += 1;
                let support: Vec<String> = ev
                    .pairs
                    .iter()
                    .take(5)
                    .map(|&(x, y, s)| format!("{}-{} ({s:.3})", net2.nodes.name(x), net2.nodes.name(y)))
                    .collect();
                tsv += &format!(
                    "{}\t{}\t{}\t{}\t{}\t{:.4}\t{}\n",
                    r.pair.line,
                    r.pair.a,
                    r.pair.b,
                    r.status.name(),
                    ev.support.name(),
                    ev.score,
                    support.join("; ")
                );
            }
            let pairs: Vec<(&str, &str)> = rows.iter().map(|r| (r.pair.a.as_str(), r.pair.b.as_str())).collect();
            GroupReport {
                label,
                rows: rows.len(),
                outcomes: by.into_iter().collect(),
                null: null_test(net2, idx, &pairs, rounds, seed),
                tsv,
            }
        })
        .collect()
}

/// The header of [`GroupReport::tsv`]'s lines.
pub const TSV_HEADER: &str = "line\ta\tb\tstatus\tinterolog\tscore\tsupporting pairs in network 2\n";
