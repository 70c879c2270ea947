//! What `orthonets view` shows and `orthonets export` writes: a seed protein's k-hop
//! neighbourhood in organism 1, its orthologs' neighbourhoods in organism 2, the orthology
//! between the two, the edges of each that the other conserves, the overlaid pairs that touch
//! it with their interolog evidence, and the annotations of what is shown. One model, three
//! renderings (`html`, GraphML and CX2 in `export`), so Cytoscape opens what the page shows.

use std::collections::{HashMap, HashSet};

use crate::annot::Annotations;
use crate::conserved::{best_interolog, interologs, Projection};
use crate::graph::Network;
use crate::overlay::{members, Overlay};
use crate::validate::{evidence, OrthologIndex};
use crate::{Error, Result};

/// What to show.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Organism 1's seed protein.
    pub seed: String,
    /// Hops around the seed (and around its orthologs in organism 2).
    pub hops: usize,
    /// At most this many nodes per organism: a level that would pass it keeps its nodes with
    /// the strongest edges to what is already shown.
    pub max_nodes: usize,
    /// The organisms' names, for titles.
    pub organisms: [String; 2],
}

/// A node of the view.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// 1 or 2.
    pub organism: u8,
    /// Its name in its network (or in the overlaid list).
    pub name: String,
    /// Hops from the seed (organism 2: from the seed's orthologs; `None` when it is only there
    /// as an ortholog of a shown node or as an overlaid pair's protein).
    pub hop: Option<usize>,
    /// Whether the node's network has it (an overlaid pair's new protein does not).
    pub in_network: bool,
    /// The gene's full name (organism 1, from the annotations).
    pub full_name: String,
    /// Its GO terms (`id name`), at most [`MAX_TERMS`].
    pub go: Vec<String>,
    /// All its GO terms, counted.
    pub go_count: usize,
    /// Its diseases (`id name`), at most [`MAX_TERMS`].
    pub diseases: Vec<String>,
    /// All its diseases, counted.
    pub disease_count: usize,
}

/// Terms listed per node; the counts say how many there are in all.
pub const MAX_TERMS: usize = 25;

/// What an edge is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An interaction of the node's own network.
    Interaction,
    /// Orthology between the organisms.
    Ortholog,
    /// An overlaid pair of the user's list (organism 1).
    Overlay,
}

impl Kind {
    /// The name in exports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Interaction => "interaction",
            Kind::Ortholog => "ortholog",
            Kind::Overlay => "overlay",
        }
    }
}

/// An edge of the view, between indices of [`View::nodes`].
#[derive(Debug, Clone, PartialEq)]
pub struct Edge {
    /// One end.
    pub source: usize,
    /// The other.
    pub target: usize,
    /// What it is.
    pub kind: Kind,
    /// The interaction's score, the ortholog relation's weight, or the overlaid row's score.
    pub score: f32,
    /// Interactions: whether the other organism has an interolog.
    pub conserved: bool,
    /// Overlaid pairs: their class (known, new between known proteins, new protein).
    pub status: Option<&'static str>,
    /// Overlaid pairs: the interolog test's outcome and score.
    pub interolog: Option<(&'static str, f32)>,
    /// Organism 1's pairs: the GO terms both ends carry (`id name`).
    pub shared_go: Vec<String>,
}

/// A view, ready to render.
#[derive(Debug, Clone)]
pub struct View {
    /// What was asked.
    pub spec: Spec,
    /// Nodes: organism 1's first.
    pub nodes: Vec<Node>,
    /// Edges.
    pub edges: Vec<Edge>,
    /// Whether [`Spec::max_nodes`] cut a neighbourhood.
    pub truncated: bool,
    /// The GO terms most of organism 1's shown proteins carry (`id name`, count).
    pub top_go: Vec<(String, usize)>,
    /// The diseases most of them are linked to.
    pub top_diseases: Vec<(String, usize)>,
    /// Where the inputs came from (files, versions, row counts).
    pub provenance: Vec<String>,
}

/// The view's inputs.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// Organism 1's network.
    pub net1: &'a Network,
    /// Organism 2's network.
    pub net2: &'a Network,
    /// Orthology between their nodes.
    pub proj: &'a Projection,
    /// Organism 1's names → orthologs in organism 2 (for overlaid pairs' new proteins).
    pub idx: &'a OrthologIndex,
    /// A classified list to overlay, if any.
    pub overlay: Option<&'a Overlay>,
    /// Organism 1's annotations, if any.
    pub annotations: Option<&'a Annotations>,
}

/// Breadth-first from `start`, `hops` levels, at most `max` nodes: `(node, hop)`; whether a
/// level was cut.
fn neighbourhood(net: &Network, start: &[u32], hops: usize, max: usize) -> (Vec<(u32, usize)>, bool) {
    let mut seen: HashSet<u32> = start.iter().copied().collect();
    let mut out: Vec<(u32, usize)> = start.iter().map(|&s| (s, 0)).take(max).collect();
    let mut frontier: Vec<u32> = start.to_vec();
    let mut cut = start.len() > max;
    for level in 1..=hops {
        // each new node's strongest edge to what is shown, for cutting the level
        let mut best: HashMap<u32, f32> = HashMap::new();
        for &u in &frontier {
            for (v, s) in net.neighbours(u) {
                if !seen.contains(&v) {
                    let b = best.entry(v).or_insert(s);
                    *b = b.max(s);
                }
            }
        }
        let mut next: Vec<(u32, f32)> = best.into_iter().collect();
        next.sort_by(|x, y| y.1.total_cmp(&x.1).then_with(|| net.nodes.name(x.0).cmp(net.nodes.name(y.0))));
        let room = max.saturating_sub(out.len());
        if next.len() > room {
            cut = true;
            next.truncate(room);
        }
        frontier.clear();
        for (v, _) in next {
            seen.insert(v);
            out.push((v, level));
            frontier.push(v);
        }
    }
    (out, cut)
}

/// Builds the view of `spec` from `inp`. An error when the seed is not in organism 1's
/// network (with names that differ only in case, if any).
pub fn build(spec: &Spec, inp: Inputs<'_>) -> Result<View> {
    let (net1, net2) = (inp.net1, inp.net2);
    let seed = net1.nodes.get(&spec.seed).ok_or_else(|| {
        let close: Vec<&str> = (0..net1.node_count() as u32)
            .map(|v| net1.nodes.name(v))
            .filter(|n| n.eq_ignore_ascii_case(&spec.seed))
            .take(5)
            .collect();
        Error::Unknown {
            name: spec.seed.clone(),
            detail: if close.is_empty() {
                format!("not a node of network 1 ({} nodes; identifiers like {:?})", net1.node_count(), net1.nodes.name(0))
            } else {
                format!("not a node of network 1; did you mean {}?", close.join(", "))
            },
        }
    })?;
    let (one, cut1) = neighbourhood(net1, &[seed], spec.hops, spec.max_nodes);
    let mut start2: Vec<u32> = inp.proj.to2(seed).iter().map(|o| o.0).collect();
    start2.sort_unstable();
    let (mut two, cut2) = neighbourhood(net2, &start2, spec.hops, spec.max_nodes);
    // the orthologs of organism 1's shown proteins, so conserved edges show on both sides
    let mut shown2: HashSet<u32> = two.iter().map(|t| t.0).collect();
    let mut extra: Vec<u32> =
        one.iter().flat_map(|&(v, _)| inp.proj.to2(v).iter().map(|o| o.0)).filter(|y| !shown2.contains(y)).collect();
    extra.sort_unstable();
    extra.dedup();
    let room = (spec.max_nodes * 2).saturating_sub(two.len());
    let cut3 = extra.len() > room;
    extra.truncate(room);
    for y in extra {
        shown2.insert(y);
        two.push((y, usize::MAX));
    }

    let mut nodes = Vec::new();
    let mut at1: HashMap<String, usize> = HashMap::new();
    let mut at2: HashMap<u32, usize> = HashMap::new();
    let annotated = |name: &str, organism: u8, hop: Option<usize>, in_network: bool| {
        let mut n = Node {
            organism,
            name: name.to_owned(),
            hop,
            in_network,
            full_name: String::new(),
            go: Vec::new(),
            go_count: 0,
            diseases: Vec::new(),
            disease_count: 0,
        };
        if let (1, Some(a)) = (organism, inp.annotations) {
            let p = a.protein(name);
            n.full_name = p.full_name.unwrap_or("").to_owned();
            n.go_count = p.go.len();
            n.go = p.go.iter().take(MAX_TERMS).map(|t| format!("{} {}", t.id, t.name)).collect();
            n.disease_count = p.diseases.len();
            n.diseases = p.diseases.iter().take(MAX_TERMS).map(|t| format!("{} {}", t.id, t.name)).collect();
        }
        n
    };
    for &(v, h) in &one {
        at1.insert(net1.nodes.name(v).to_owned(), nodes.len());
        nodes.push(annotated(net1.nodes.name(v), 1, Some(h), true));
    }
    let shared = |a: &str, b: &str| -> Vec<String> {
        inp.annotations.map_or_else(Vec::new, |an| an.shared_go(a, b).iter().map(|t| format!("{} {}", t.id, t.name)).collect())
    };
    let mut edges = Vec::new();
    for &(u, _) in &one {
        for (v, s) in net1.neighbours(u) {
            let (Some(&i), Some(&j)) = (at1.get(net1.nodes.name(u)), at1.get(net1.nodes.name(v))) else { continue };
            if u < v {
                edges.push(Edge {
                    source: i,
                    target: j,
                    kind: Kind::Interaction,
                    score: s,
                    conserved: best_interolog(net2, inp.proj, u, v).is_some(),
                    status: None,
                    interolog: None,
                    shared_go: shared(net1.nodes.name(u), net1.nodes.name(v)),
                });
            }
        }
    }
    // overlaid pairs touching organism 1's shown proteins; their new proteins join the view
    let mut overlaid = 0usize;
    if let Some(ov) = inp.overlay {
        for r in ov.rows.iter().filter(|r| r.status.is_new() || r.status == crate::overlay::Status::Known) {
            let (ma, mb) = (members(net1, &r.pair.a), members(net1, &r.pair.b));
            if !ma.iter().chain(&mb).any(|m| at1.contains_key(*m)) {
                continue;
            }
            if overlaid >= spec.max_nodes {
                break;
            }
            overlaid += 1;
            let ev = evidence(net2, inp.idx, &r.pair.a, &r.pair.b);
            for a in &ma {
                for b in &mb {
                    if a == b {
                        continue;
                    }
                    for m in [a, b] {
                        if !at1.contains_key(*m) {
                            at1.insert((*m).to_owned(), nodes.len());
                            nodes.push(annotated(m, 1, None, net1.nodes.get(m).is_some()));
                        }
                    }
                    edges.push(Edge {
                        source: at1[*a],
                        target: at1[*b],
                        kind: Kind::Overlay,
                        score: r.pair.score.unwrap_or(1.0),
                        conserved: false,
                        status: Some(r.status.name()),
                        interolog: Some((ev.support.name(), ev.score)),
                        shared_go: shared(a, b),
                    });
                }
            }
        }
    }
    for &(v, h) in &two {
        at2.insert(v, nodes.len());
        nodes.push(annotated(net2.nodes.name(v), 2, (h != usize::MAX).then_some(h), true));
    }
    for &(u, _) in &two {
        for (v, s) in net2.neighbours(u) {
            if let (true, Some(&i), Some(&j)) = (u < v, at2.get(&u), at2.get(&v)) {
                edges.push(Edge {
                    source: i,
                    target: j,
                    kind: Kind::Interaction,
                    score: s,
                    // network 2's edge seen from network 1: its ends' orthologs there
                    conserved: !interologs(net1, inp.proj.to1(u), inp.proj.to1(v)).is_empty(),
                    status: None,
                    interolog: None,
                    shared_go: Vec::new(),
                });
            }
        }
    }
    for &(u, _) in &one {
        for &(y, w) in inp.proj.to2(u) {
            if let Some(&j) = at2.get(&y) {
                edges.push(Edge {
                    source: at1[net1.nodes.name(u)],
                    target: j,
                    kind: Kind::Ortholog,
                    score: w,
                    conserved: false,
                    status: None,
                    interolog: None,
                    shared_go: Vec::new(),
                });
            }
        }
    }
    let (top_go, top_diseases) = match inp.annotations {
        Some(a) => {
            let genes: Vec<&str> = nodes.iter().filter(|n| n.organism == 1).map(|n| n.name.as_str()).collect();
            let (g, d) = a.top(&genes, 10);
            let f =
                |v: Vec<(&crate::annot::Term, usize)>| v.into_iter().map(|(t, c)| (format!("{} {}", t.id, t.name), c)).collect();
            (f(g), f(d))
        }
        None => (Vec::new(), Vec::new()),
    };
    Ok(View { spec: spec.clone(), nodes, edges, truncated: cut1 || cut2 || cut3, top_go, top_diseases, provenance: Vec::new() })
}

impl View {
    /// Nodes of organism `o`.
    pub fn count(&self, o: u8) -> usize {
        self.nodes.iter().filter(|n| n.organism == o).count()
    }

    /// Edges of kind `k`.
    pub fn edges_of(&self, k: Kind) -> usize {
        self.edges.iter().filter(|e| e.kind == k).count()
    }
}
