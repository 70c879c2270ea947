//! Conserved edges: an edge A–B of one network is conserved when an ortholog of A interacts
//! with an ortholog of B in the other network (an interolog).

use crate::graph::Network;
use crate::ortho::Orthology;

/// Every interacting pair of orthologs of two proteins: for `x` among `oa` and `y` among `ob`
/// (organism 2's nodes with their ortholog weights), `x ≠ y` and `x`–`y` an edge of `net2`,
/// the product `weight(x) × weight(y) × score(x–y)`. Each unordered pair once (lower id first,
/// its highest product), best first. Conserved edges and the interolog test both ask this.
pub fn interologs(net2: &Network, oa: &[(u32, f32)], ob: &[(u32, f32)]) -> Vec<(u32, u32, f32)> {
    let mut pairs = Vec::new();
    for &(x, wa) in oa {
        for &(y, wb) in ob {
            if x == y {
                continue;
            }
            if let Some(s) = net2.edge(x, y) {
                pairs.push((x.min(y), x.max(y), wa * wb * s));
            }
        }
    }
    // one entry per pair, its highest product; then best first
    pairs.sort_unstable_by(|p, q| (p.0, p.1).cmp(&(q.0, q.1)).then(q.2.total_cmp(&p.2)));
    pairs.dedup_by_key(|p| (p.0, p.1));
    pairs.sort_by(|p, q| q.2.total_cmp(&p.2).then((p.0, p.1).cmp(&(q.0, q.1))));
    pairs
}

/// The best interolog of `a`–`b` (network 1's nodes) in network 2: the ortholog pair with the
/// highest `weight(a, a') × weight(b, b') × score(a'–b')`, as `(lower id, higher id, product)`.
pub fn best_interolog(net2: &Network, p: &Projection, a: u32, b: u32) -> Option<(u32, u32, f32)> {
    interologs(net2, p.to2(a), p.to2(b)).into_iter().next()
}

/// How many of network 1's edges are conserved in network 2.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Conservation {
    /// Network 1's edges.
    pub edges: usize,
    /// Edges whose two ends both have an ortholog among network 2's nodes (the others cannot
    /// be conserved whatever network 2 holds).
    pub testable: usize,
    /// Edges with an interolog in network 2.
    pub conserved: usize,
}

/// Counts network 1's edges conserved in network 2 through `p`.
pub fn conservation(net1: &Network, net2: &Network, p: &Projection) -> Conservation {
    let mut c = Conservation::default();
    for (a, b, _) in net1.edges() {
        c.edges += 1;
        if p.to2(a).is_empty() || p.to2(b).is_empty() {
            continue;
        }
        c.testable += 1;
        c.conserved += usize::from(best_interolog(net2, p, a, b).is_some());
    }
    c
}

/// Network 1's edges conserved in network 2.
pub fn count(net1: &Network, net2: &Network, p: &Projection) -> usize {
    conservation(net1, net2, p).conserved
}

/// Each network-1 node's orthologs among network 2's nodes.
#[derive(Debug, Clone, Default)]
pub struct Projection {
    to2: Vec<Vec<(u32, f32)>>,
    to1: Vec<Vec<(u32, f32)>>,
}

impl Projection {
    /// Relates the two networks through `o`: only relations whose both proteins are nodes.
    pub fn new(o: &Orthology, net1: &Network, net2: &Network) -> Projection {
        let mut p = Projection { to2: vec![Vec::new(); net1.node_count()], to1: vec![Vec::new(); net2.node_count()] };
        for r in &o.relations {
            if let (Some(x), Some(y)) = (net1.nodes.get(o.a.name(r.a)), net2.nodes.get(o.b.name(r.b))) {
                p.to2[x as usize].push((y, r.weight));
                p.to1[y as usize].push((x, r.weight));
            }
        }
        p
    }

    /// Network 2's nodes related to network 1's node `v`.
    pub fn to2(&self, v: u32) -> &[(u32, f32)] {
        &self.to2[v as usize]
    }

    /// Network 1's nodes related to network 2's node `v`.
    pub fn to1(&self, v: u32) -> &[(u32, f32)] {
        &self.to1[v as usize]
    }

    /// Network-1 nodes with at least one ortholog in network 2.
    pub fn mapped1(&self) -> usize {
        self.to2.iter().filter(|v| !v.is_empty()).count()
    }

    /// Network-2 nodes with at least one ortholog in network 1.
    pub fn mapped2(&self) -> usize {
        self.to1.iter().filter(|v| !v.is_empty()).count()
    }

    /// The same projection seen from network 2.
    pub fn reversed(&self) -> Projection {
        Projection { to2: self.to1.clone(), to1: self.to2.clone() }
    }
}

/// A warning when network 2 looks made from network 1 by orthology (or the reverse) rather
/// than measured in its own organism: almost all of its edges are interologs of the other's,
/// or it uses the other's identifiers. The interolog test is circular on such a pair.
pub fn translation_warning(net1: &Network, net2: &Network, p: &Projection) -> Option<String> {
    translation_warning_given(net1, net2, &conservation(net2, net1, &p.reversed()))
}

/// [`translation_warning`] with network 2's edges conserved in network 1 already counted.
pub fn translation_warning_given(net1: &Network, net2: &Network, back: &Conservation) -> Option<String> {
    let same_names = (0..net2.node_count() as u32).filter(|&v| net1.nodes.get(net2.nodes.name(v)).is_some()).count();
    let same = same_names as f64 / net2.node_count().max(1) as f64;
    let translated = back.conserved as f64 / back.edges.max(1) as f64;
    if same > 0.5 || (translated > 0.9 && back.edges >= 10) {
        Some(format!(
            "network 2 looks translated from network 1 rather than measured in its organism ({:.0}% of its nodes carry network 1's identifiers, {:.0}% of its edges are interologs of network 1's): the interolog test is circular on this pair",
            same * 100.0,
            translated * 100.0
        ))
    } else {
        None
    }
}
