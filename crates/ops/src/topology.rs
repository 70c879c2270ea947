//! The emulated cluster's file format (`topologies/*.toml`), owned by the code that reads it:
//! hosts, each with the same named links, each link with a rate and a /24. It gives every
//! host's `IRONWEAVE_TCP_LINKS` (what the TCP backend reads) and the namespace names of the
//! emulated cluster (`ironweave cluster up`). Parsing and validation are pure and fuzzed
//! (`fuzz/`, target `configs`).

use std::path::Path;

use ironweave::transport::{Error, Result};
use serde::{Deserialize, Serialize};

/// A topology file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Short name (letters, digits; at most 8), used in namespace names.
    pub name: String,
    /// Number of hosts.
    pub hosts: usize,
    /// The links every host has.
    pub links: Vec<LinkDef>,
}

/// One link of a topology.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LinkDef {
    /// Interface name inside each host (letters, digits; at most 6).
    pub name: String,
    /// Rate as `tc` writes it: `1gbit`, `300mbit`.
    pub rate: String,
    /// The link's /24 as `A.B.C.0/24` (default `10.231.<index+1>.0/24`).
    #[serde(default)]
    pub subnet: Option<String>,
}

impl Topology {
    /// Reads and validates a topology file.
    pub fn load(path: &Path) -> Result<Topology> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::Config(format!("reading topology {}: {e}", path.display())))?;
        Self::from_toml_str(&text).map_err(|e| Error::Config(format!("topology {}: {e}", path.display())))
    }

    /// Parses and validates a topology.
    pub fn from_toml_str(text: &str) -> Result<Topology> {
        let t: Topology = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        t.validate()?;
        Ok(t)
    }

    fn validate(&self) -> Result<()> {
        let bad = |s: String| Err(Error::Config(s));
        let ok = |s: &str, max: usize| !s.is_empty() && s.len() <= max && s.chars().all(|c| c.is_ascii_alphanumeric());
        if !ok(&self.name, 8) {
            return bad(format!("name {:?}: use 1 to 8 letters or digits", self.name));
        }
        if !(1..=16).contains(&self.hosts) {
            return bad(format!("hosts = {}: use 1 to 16", self.hosts));
        }
        if self.links.is_empty() || self.links.len() > 8 {
            return bad(format!("{} links: use 1 to 8", self.links.len()));
        }
        for (i, l) in self.links.iter().enumerate() {
            if !ok(&l.name, 6) {
                return bad(format!("link {:?}: use 1 to 6 letters or digits", l.name));
            }
            if self.links[..i].iter().any(|m| m.name == l.name) {
                return bad(format!("link {:?} appears twice", l.name));
            }
            ironweave_units::parse_rate(&l.rate).map_err(|e| Error::Config(format!("link {:?}: {e}", l.name)))?;
            self.prefix(i)?;
        }
        Ok(())
    }

    /// The first three octets of link `l`'s subnet.
    pub fn prefix(&self, l: usize) -> Result<String> {
        let link = self.links.get(l).ok_or_else(|| Error::Config(format!("no link {l}")))?;
        match &link.subnet {
            None => Ok(format!("10.231.{}", l + 1)),
            Some(s) => {
                let bad = || Error::Config(format!("subnet {s:?}: give a /24 as A.B.C.0/24"));
                let p = s.strip_suffix(".0/24").ok_or_else(bad)?;
                let octets: Vec<&str> = p.split('.').collect();
                if octets.len() != 3 || octets.iter().any(|o| o.parse::<u8>().is_err()) {
                    return Err(bad());
                }
                Ok(p.to_string())
            }
        }
    }

    /// Namespace of host `h`.
    pub fn host_ns(&self, h: usize) -> String {
        format!("iw-{}-h{h}", self.name)
    }

    /// Namespace of the switch joining the hosts.
    pub fn switch_ns(&self) -> String {
        format!("iw-{}-sw", self.name)
    }

    /// Address of host `h` on link `l`.
    pub fn addr(&self, h: usize, l: usize) -> String {
        format!("{}.{}", self.prefix(l).unwrap_or_default(), h + 1)
    }

    /// `IRONWEAVE_TCP_LINKS` for a rank on host `h`.
    pub fn tcp_links_env(&self, h: usize) -> String {
        self.links
            .iter()
            .enumerate()
            .map(|(l, d)| format!("{}={}@{}", d.name, self.addr(h, l), d.rate))
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topology_parses_and_bad_ones_say_why() {
        let t = Topology::from_toml_str(
            "name = \"t\"\nhosts = 2\n[[links]]\nname = \"a\"\nrate = \"1gbit\"\n[[links]]\nname = \"b\"\nrate = \"300mbit\"\nsubnet = \"10.9.8.0/24\"\n",
        )
        .unwrap();
        assert_eq!(t.tcp_links_env(1), "a=10.231.1.2@1gbit,b=10.9.8.2@300mbit");
        for (text, why) in [
            ("name = \"t\"\nhosts = 0\nlinks = []", "hosts = 0"),
            ("name = \"t\"\nhosts = 2\nlinks = []", "0 links"),
            ("name = \"t t\"\nhosts = 2\nlinks = []", "letters or digits"),
            ("name = \"t\"\nhosts = 2\n[[links]]\nname = \"a\"\nrate = \"fast\"\n", "rate"),
            ("name = \"t\"\nhosts = 2\n[[links]]\nname = \"a\"\nrate = \"1gbit\"\nsubnet = \"10.0.0.0/16\"\n", "A.B.C.0/24"),
        ] {
            let e = Topology::from_toml_str(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    /// A topology's name prefixes its namespaces (`iw-<name>-h<i>`): two files with one name
    /// would bring up, and tear down, each other's hosts.
    #[test]
    fn every_topology_has_its_own_name() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../topologies");
        let mut seen = std::collections::BTreeMap::new();
        for e in std::fs::read_dir(&root).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let t = Topology::load(&p).unwrap();
                if let Some(other) = seen.insert(t.name.clone(), p.clone()) {
                    panic!("{} and {} are both named {:?}", other.display(), p.display(), t.name);
                }
            }
        }
        assert!(seen.len() >= 10, "{seen:?}");
    }

    /// The emulated beds are described twice, once for `cluster up` (a topology) and once for
    /// the planners (a cluster description): the planner's inter-node links must be the
    /// topology's links at the topology's rates, or plans are made for a bed that is not there.
    #[test]
    fn emulated_cluster_descriptions_match_their_topologies() {
        use ironweave_plan::{ClusterDesc, Scope};
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        // every configs/clusters/emulated-*.toml and the topology it describes
        // (cluster, topology, dilation): the emu-* descriptions are the published hardware an
        // emulated-accelerator bed stands for, its links D times the topology's rates
        let beds = [
            ("emulated-2host.toml", "2host-2link.toml", 1.0),
            ("emulated-2host-2link.toml", "2host-2link.toml", 1.0),
            ("emu-2host-2link-a100.toml", "2host-2link-emu.toml", 200.0),
            // the same A100 bed at twice the dilation
            ("emu-2host-2link-a100.toml", "2host-2link-emu-half.toml", 400.0),
            ("emu-2host-2link-h100.toml", "2host-2link-emu.toml", 400.0),
            ("emu-2host-a100.toml", "2host-tp-emu.toml", 200.0),
            ("emu-2host-a100.toml", "2host-tp-emu-half.toml", 400.0),
            ("emu-2host-h100.toml", "2host-tp-emu.toml", 400.0),
        ];
        let mut found: Vec<String> = std::fs::read_dir(root.join("configs/clusters"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("emulated-") || n.starts_with("emu-"))
            .collect();
        found.sort();
        let mut listed: Vec<String> = beds.iter().map(|(c, _, _)| c.to_string()).collect();
        listed.sort();
        listed.dedup();
        assert_eq!(found, listed, "a new emulated cluster description: name its topology in this test");
        for (cluster, topology, dilation) in beds {
            let c = ClusterDesc::from_toml_str(&std::fs::read_to_string(root.join("configs/clusters").join(cluster)).unwrap())
                .unwrap();
            let t = Topology::load(&root.join("topologies").join(topology)).unwrap();
            assert_eq!(c.nodes as usize, t.hosts, "{cluster} vs {topology}: hosts");
            let inter: Vec<_> = c.links.iter().filter(|l| l.scope == Scope::InterNode).collect();
            assert!(!inter.is_empty(), "{cluster}: no inter-node link");
            for l in inter {
                let def = t.links.iter().find(|d| d.name == l.name);
                let def = def.unwrap_or_else(|| panic!("{cluster}: link {} is not in {topology}", l.name));
                let rate = ironweave_units::parse_rate(&def.rate).unwrap() as f64 * dilation;
                assert!(
                    (l.bytes_per_s() - rate).abs() <= 1e-9 * rate,
                    "{cluster}: link {} at {} B/s, {topology} says {} x dilation {dilation} ({rate} B/s)",
                    l.name,
                    l.bytes_per_s(),
                    def.rate
                );
            }
        }
    }
}
