//! The alpha-beta cost model: collective times on groups of devices, compute times from FLOPs.
//!
//! Collectives follow the ring formulas nccl-tests uses to turn algorithm bandwidth into bus
//! bandwidth (all-reduce moves `2(n-1)/n` of the buffer per device, all-gather, reduce-scatter
//! and all-to-all `(n-1)/n`), so a link's `bandwidth_gbyte_s` is the busbw nccl-tests would
//! report on it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::desc::ClusterDesc;

/// A collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Coll {
    /// Sum across the group, result everywhere.
    AllReduce,
    /// Concatenate shards.
    AllGather,
    /// Sum and scatter shards.
    ReduceScatter,
    /// Personalised exchange.
    AllToAll,
}

impl Coll {
    /// The same collective in `ironweave-units`, where the factors are defined once.
    fn unit(self) -> ironweave_units::Coll {
        match self {
            Coll::AllReduce => ironweave_units::Coll::AllReduce,
            Coll::AllGather => ironweave_units::Coll::AllGather,
            Coll::ReduceScatter => ironweave_units::Coll::ReduceScatter,
            Coll::AllToAll => ironweave_units::Coll::AllToAll,
        }
    }

    /// Bytes each device moves per byte of buffer, for a group of `n`.
    pub fn bus_factor(self, n: u32) -> f64 {
        self.unit().bus_factor(n)
    }

    /// Latency terms (ring steps) for a group of `n`.
    pub fn steps(self, n: u32) -> f64 {
        self.unit().steps(n)
    }
}

/// A group of devices laid out as `members_per_node` devices on each of `size /
/// members_per_node` nodes, and the path its collectives take.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupPath {
    /// Devices in the group.
    pub size: u32,
    /// Devices of the group on one node.
    pub members_per_node: u32,
    /// Bus bandwidth in bytes/s (the bottleneck along the path).
    pub bytes_per_s: f64,
    /// Per-step latency, seconds.
    pub latency_s: f64,
    /// Names of the links used, bottleneck first.
    pub links: Vec<String>,
}

impl GroupPath {
    /// Time of `coll` on a buffer of `bytes` (the full buffer: all-reduce's vector, all-gather's output).
    pub fn time(&self, coll: Coll, bytes: f64) -> f64 {
        if self.size <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        coll.steps(self.size) * self.latency_s + bytes * coll.bus_factor(self.size) / self.bytes_per_s
    }
}

/// Measured compute throughput per op kind, overriding `peak × efficiency`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileTable {
    /// Op kind (`attn`, `mlp`, `expert`, `head`) → one measurement.
    #[serde(default)]
    pub ops: BTreeMap<String, MeasuredOp>,
}

/// One measured op: it did `flops` in `seconds`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredOp {
    /// FLOPs of the measured call.
    pub flops: f64,
    /// Its duration.
    pub seconds: f64,
}

/// Costs on one cluster.
#[derive(Debug, Clone)]
pub struct CostModel<'a> {
    /// The cluster.
    pub cluster: &'a ClusterDesc,
    /// Measured throughputs, if any.
    pub profile: Option<&'a ProfileTable>,
}

impl<'a> CostModel<'a> {
    /// Analytic cost model for `cluster`.
    pub fn new(cluster: &'a ClusterDesc) -> Self {
        CostModel { cluster, profile: None }
    }

    /// Seconds to run `flops` of op kind `op` on one device.
    pub fn compute_time(&self, op: &str, flops: f64) -> f64 {
        if let Some(m) = self.profile.and_then(|p| p.ops.get(op)) {
            if m.flops > 0.0 && m.seconds > 0.0 {
                return flops * m.seconds / m.flops;
            }
        }
        flops / self.cluster.flops()
    }

    /// Path of a group with `size` devices, `members_per_node` of them on each node it touches.
    /// Every such group in the cluster is assumed active at once (they are, by symmetry, in
    /// data/tensor parallelism), so a node's NICs are shared by `devices_per_node /
    /// members_per_node` groups.
    pub fn group(&self, size: u32, members_per_node: u32) -> GroupPath {
        self.group_via(size, members_per_node, self.cluster.inter_link())
    }

    /// [`Self::group`] with its inter-node traffic on `inter` (a cluster with several
    /// independent inter-node links can give different groups different links).
    pub fn group_via(&self, size: u32, members_per_node: u32, inter: Option<&crate::desc::LinkDesc>) -> GroupPath {
        let c = self.cluster;
        let dpn = c.devices_per_node;
        let m = members_per_node.clamp(1, dpn).min(size.max(1));
        if size <= 1 {
            return GroupPath { size, members_per_node: m, bytes_per_s: f64::INFINITY, latency_s: 0.0, links: vec![] };
        }
        let intra = if m >= 2 { c.intra_links_covering(m).next() } else { None };
        if size <= m {
            // validate() guarantees an intra link covering the whole node.
            let l = intra.or_else(|| c.intra_links_covering(dpn).next());
            return match l {
                Some(l) => GroupPath {
                    size,
                    members_per_node: m,
                    bytes_per_s: l.bytes_per_s(),
                    latency_s: l.latency_s(),
                    links: vec![l.name.clone()],
                },
                None => GroupPath { size, members_per_node: m, bytes_per_s: f64::INFINITY, latency_s: 0.0, links: vec![] },
            };
        }
        let Some(inter) = inter else {
            return GroupPath { size, members_per_node: m, bytes_per_s: f64::INFINITY, latency_s: 0.0, links: vec![] };
        };
        let nics = inter.instances.unwrap_or(1) as f64;
        let cap = inter.bytes_per_s() * nics * m as f64 / dpn as f64;
        let (mut bw, mut lat, mut links) = (cap, inter.latency_s(), vec![inter.name.clone()]);
        if let Some(l) = intra {
            if l.bytes_per_s() < bw {
                bw = l.bytes_per_s();
                links.insert(0, l.name.clone());
            } else {
                links.push(l.name.clone());
            }
            lat = lat.max(l.latency_s());
        }
        GroupPath { size, members_per_node: m, bytes_per_s: bw, latency_s: lat, links }
    }

    /// The group of `t` consecutive devices (tensor parallel).
    pub fn tp_group(&self, t: u32) -> GroupPath {
        self.group(t, t.min(self.cluster.devices_per_node))
    }

    /// The data-parallel group of a tensor-parallel degree `t`: devices with the same TP rank.
    pub fn dp_group(&self, t: u32) -> GroupPath {
        let dpn = self.cluster.devices_per_node;
        let n = self.cluster.devices() / t.max(1);
        let m = if t < dpn { dpn / t } else { 1 };
        self.group(n, m)
    }

    /// All devices of one node.
    pub fn node_group(&self) -> GroupPath {
        let dpn = self.cluster.devices_per_node;
        self.group(dpn, dpn)
    }

    /// All devices of the cluster.
    pub fn global_group(&self) -> GroupPath {
        self.group(self.cluster.devices(), self.cluster.devices_per_node)
    }

    /// One device per node (a rail).
    pub fn rail_group(&self) -> GroupPath {
        self.group(self.cluster.nodes, 1)
    }

    /// One device per node on the second-fastest inter-node link when the cluster has several
    /// (HSDP keeps both busy: the all-device part on the fastest, the rails on the next), else
    /// on the only one.
    pub fn second_rail_group(&self) -> GroupPath {
        let links = self.cluster.inter_links();
        self.group_via(self.cluster.nodes, 1, links.get(1).or(links.first()).copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::ClusterDesc;

    fn cluster() -> ClusterDesc {
        ClusterDesc::from_toml_str(
            r#"
name = "t"
nodes = 2
devices_per_node = 4
device = { name = "d", peak_tflops = 100.0, efficiency = 0.5, memory_gib = 24.0 }
host = { memory_gib = 256.0, pcie_gbyte_s = 20.0, storage_gbyte_s = 2.0 }
[[links]]
name = "nvlink"
scope = "intra-node"
span = 2
latency_us = 2.0
bandwidth_gbyte_s = 50.0
[[links]]
name = "pcie"
scope = "intra-node"
latency_us = 5.0
bandwidth_gbyte_s = 10.0
[[links]]
name = "ib"
scope = "inter-node"
latency_us = 10.0
bandwidth_gbyte_s = 12.0
instances = 1
"#,
        )
        .unwrap()
    }

    #[test]
    fn paths_pick_the_link_that_joins_the_group() {
        let c = cluster();
        let cm = CostModel::new(&c);
        assert_eq!(cm.tp_group(2).links, vec!["nvlink"]);
        assert_eq!(cm.tp_group(4).links, vec!["pcie"]);
        // 8 devices over 2 nodes: one group per node, NIC shared by nobody: 12 GB/s < pcie 10? no: pcie is the bottleneck.
        let g = cm.tp_group(8);
        assert_eq!(g.bytes_per_s, 10e9);
        assert_eq!(g.links[0], "pcie");
        // DP group of t=1: 8 devices, 4 per node: one group, NIC at 12 GB/s vs pcie 10.
        assert_eq!(cm.dp_group(1).bytes_per_s, 10e9);
        // DP group of t=4: one device per node; four such groups share the NIC.
        let g = cm.dp_group(4);
        assert_eq!(g.size, 2);
        assert_eq!(g.bytes_per_s, 3e9);
        assert_eq!(g.links, vec!["ib"]);
    }

    #[test]
    fn ring_formulas() {
        let c = cluster();
        let g = CostModel::new(&c).tp_group(4);
        let t = g.time(Coll::AllReduce, 1e9);
        let want = 6.0 * 5e-6 + 1e9 * 1.5 / 10e9;
        assert!((t - want).abs() < 1e-12, "{t} vs {want}");
        assert_eq!(g.time(Coll::AllGather, 0.0), 0.0);
        assert_eq!(CostModel::new(&c).tp_group(1).time(Coll::AllReduce, 1e9), 0.0);
    }
}
