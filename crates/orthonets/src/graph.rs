//! Interned identifiers and an undirected network in compressed sparse rows.

use std::collections::HashMap;

/// Names to dense ids `0..len` and back.
#[derive(Debug, Clone, Default)]
pub struct Interner {
    names: Vec<Box<str>>,
    ids: HashMap<Box<str>, u32>,
}

impl Interner {
    /// The id of `name`, given a new one if it has none.
    pub fn intern(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.ids.get(name) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(name.into());
        self.ids.insert(name.into(), i);
        i
    }

    /// The id of `name`, if it has one.
    pub fn get(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The name of id `i`.
    pub fn name(&self, i: u32) -> &str {
        &self.names[i as usize]
    }

    /// Names interned.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether nothing was interned.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// What building a network dropped or merged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BuildCounts {
    /// Input pairs seen.
    pub pairs: usize,
    /// Pairs of a protein with itself, dropped.
    pub self_loops: usize,
    /// Pairs seen again (either orientation), merged into one edge keeping the highest score.
    pub duplicates: usize,
}

/// An undirected network: every edge once per end in `adj`, scores in `[0, 1]`.
#[derive(Debug, Clone, Default)]
pub struct Network {
    /// Node names.
    pub nodes: Interner,
    offsets: Vec<u32>,
    adj: Vec<u32>,
    score: Vec<f32>,
}

impl Network {
    /// Builds from interned `nodes` and `(a, b, score)` pairs: self-loops dropped, duplicates
    /// (in either orientation) merged keeping the highest score.
    pub fn build(nodes: Interner, mut pairs: Vec<(u32, u32, f32)>) -> (Network, BuildCounts) {
        let mut counts = BuildCounts { pairs: pairs.len(), ..Default::default() };
        pairs.retain(|&(a, b, _)| {
            let keep = a != b;
            counts.self_loops += usize::from(!keep);
            keep
        });
        for p in &mut pairs {
            if p.0 > p.1 {
                (p.0, p.1) = (p.1, p.0);
            }
        }
        // by pair, the highest score first, so dedup keeps it
        pairs.sort_unstable_by(|x, y| (x.0, x.1).cmp(&(y.0, y.1)).then(y.2.total_cmp(&x.2)));
        let before = pairs.len();
        pairs.dedup_by_key(|p| (p.0, p.1));
        counts.duplicates = before - pairs.len();
        let n = nodes.len();
        let mut degree = vec![0u32; n + 1];
        for &(a, b, _) in &pairs {
            degree[a as usize + 1] += 1;
            degree[b as usize + 1] += 1;
        }
        for i in 0..n {
            degree[i + 1] += degree[i];
        }
        let offsets = degree;
        let mut fill = offsets.clone();
        let mut adj = vec![0u32; 2 * pairs.len()];
        let mut score = vec![0f32; 2 * pairs.len()];
        for &(a, b, s) in &pairs {
            for (x, y) in [(a, b), (b, a)] {
                let k = fill[x as usize] as usize;
                adj[k] = y;
                score[k] = s;
                fill[x as usize] += 1;
            }
        }
        // Each node's neighbours come out ascending: the pairs are sorted with a < b, so a node
        // x first receives its smaller neighbours (pairs (y, x), y ascending) and then its
        // larger ones (pairs (x, z), z ascending); `edge` binary-searches them.
        let net = Network { nodes, offsets, adj, score };
        (net, counts)
    }

    fn range(&self, v: u32) -> std::ops::Range<usize> {
        self.offsets[v as usize] as usize..self.offsets[v as usize + 1] as usize
    }

    /// Nodes (every name interned, isolated ones included).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Undirected edges.
    pub fn edge_count(&self) -> usize {
        self.adj.len() / 2
    }

    /// Nodes with at least one edge.
    pub fn connected_nodes(&self) -> usize {
        (0..self.node_count() as u32).filter(|&v| self.degree(v) > 0).count()
    }

    /// The neighbours of `v`, ascending, with the edges' scores.
    pub fn neighbours(&self, v: u32) -> impl Iterator<Item = (u32, f32)> + '_ {
        let r = self.range(v);
        self.adj[r.clone()].iter().copied().zip(self.score[r].iter().copied())
    }

    /// The degree of `v`.
    pub fn degree(&self, v: u32) -> usize {
        self.range(v).len()
    }

    /// The score of edge `a`–`b`, if there is one.
    pub fn edge(&self, a: u32, b: u32) -> Option<f32> {
        let (a, b) = if self.degree(a) <= self.degree(b) { (a, b) } else { (b, a) };
        let r = self.range(a);
        self.adj[r.clone()].binary_search(&b).ok().map(|k| self.score[r.start + k])
    }

    /// Every edge once, `a < b`.
    pub fn edges(&self) -> impl Iterator<Item = (u32, u32, f32)> + '_ {
        (0..self.node_count() as u32)
            .flat_map(move |a| self.neighbours(a).filter(move |&(b, _)| a < b).map(move |(b, s)| (a, b, s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_merge_to_the_highest_score_and_self_loops_are_dropped() {
        let mut ids = Interner::default();
        let (a, b, c) = (ids.intern("A"), ids.intern("B"), ids.intern("C"));
        assert_eq!(ids.intern("A"), a);
        let (net, counts) = Network::build(ids, vec![(a, b, 0.5), (b, a, 0.9), (c, c, 1.0), (b, c, 0.2), (a, b, 0.1)]);
        assert_eq!(counts, BuildCounts { pairs: 5, self_loops: 1, duplicates: 2 });
        assert_eq!((net.node_count(), net.edge_count(), net.connected_nodes()), (3, 2, 3));
        assert_eq!(net.edge(b, a), Some(0.9));
        assert_eq!(net.edge(a, c), None);
        assert_eq!(net.edges().collect::<Vec<_>>(), vec![(a, b, 0.9), (b, c, 0.2)]);
        assert_eq!(net.neighbours(b).map(|p| p.0).collect::<Vec<_>>(), vec![a, c]);
    }
}
