//! `ironweave cluster probe`: every link's latency and bandwidth between hosts 0 and 1 of an
//! emulated cluster (and between two ranks of host 0), measured by ranks inside the hosts'
//! namespaces; the rows planners read with `--probe`.

use std::path::PathBuf;
use std::time::Duration;

use ironweave::transport::probe::{probe_link, LinkProbe};

use crate::error::{bail, Context, Result};

/// `ironweave cluster probe`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ProbeArgs {
    #[arg(long)]
    pub topology: PathBuf,
    /// Seconds of streaming per link.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Write the measurements as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Ranks per host: with 2 or more, the path between two ranks of host 0 is measured
    /// too (reported as link `host`, the intra-node link of a planner's cluster).
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
}

/// What each probe rank is told: its command line is [`ProbeWorkerArgs::to_argv`], parsed back
/// by the hidden `probe-worker` subcommand.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct ProbeWorkerArgs {
    #[arg(long)]
    pub seconds: f64,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
}

impl ProbeWorkerArgs {
    /// The hidden subcommand that runs it.
    pub const SUBCOMMAND: &'static str = "probe-worker";

    /// The rank's command line: the subcommand, then these options as clap parses them.
    pub fn to_argv(&self) -> Vec<String> {
        vec![
            Self::SUBCOMMAND.into(),
            "--seconds".into(),
            self.seconds.to_string(),
            "--out".into(),
            self.out.display().to_string(),
            "--ranks-per-host".into(),
            self.ranks_per_host.to_string(),
        ]
    }
}

/// Runs the probe ranks on the emulated cluster (it must be up), prints the table and writes
/// the JSON; returns the command's exit status.
pub fn probe(a: &ProbeArgs) -> Result<i32> {
    let rph = a.ranks_per_host.max(1);
    let t = super::Topology::load(&a.topology)?;
    if t.hosts < 2 {
        bail!("probing needs at least two hosts");
    }
    if !super::status(&t)? {
        bail!("cluster {:?} is not up: run `ironweave cluster up --topology {}`", t.name, a.topology.display());
    }
    let out = std::env::temp_dir().join(format!("ironweave-probe-{}.json", std::process::id()));
    eprintln!(
        "probing {} links between host 0 and host 1{}, {} s of streaming each",
        t.links.len(),
        if rph > 1 { " and the path between two ranks of host 0" } else { "" },
        a.seconds
    );
    let w = ProbeWorkerArgs { seconds: a.seconds, out: out.clone(), ranks_per_host: rph };
    crate::launch::helpers(t.hosts * rph, w.to_argv(), Some((t.clone(), rph)), "probe")?;
    let text = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
    let _ = std::fs::remove_file(&out);
    let probes: Vec<LinkProbe> = serde_json::from_slice(&text)?;
    print!("{}", table(&probes));
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&probes)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(0)
}

/// The Markdown table of the probes.
pub fn table(probes: &[LinkProbe]) -> String {
    let mut md = String::from(
        "| link | declared (Mbit/s) | measured (Mbit/s) | measured / declared | latency (us) |\n|---|---:|---:|---:|---:|\n",
    );
    for p in probes {
        let m = p.bandwidth_bytes_per_s * 8.0 / 1e6;
        let (d, ratio) = match p.declared_bytes_per_s {
            Some(d) => (format!("{:.0}", d * 8.0 / 1e6), format!("{:.3}", m / (d * 8.0 / 1e6))),
            None => ("-".into(), "-".into()),
        };
        md.push_str(&format!("| {} | {d} | {m:.0} | {ratio} | {:.1} |\n", p.name, p.latency_s * 1e6));
    }
    md
}

/// A probe rank: host 0's and host 1's first ranks measure every link; with several ranks per
/// host, two ranks of host 0 measure the path between them. Rank 0 writes the rows.
pub fn probe_worker(a: &ProbeWorkerArgs) -> Result<()> {
    let comm = crate::backend::connect("tcp")?;
    let mut probes = Vec::new();
    let (rph, stream) = (a.ranks_per_host.max(1), Duration::from_secs_f64(a.seconds));
    for i in 0..comm.links().len() {
        let p = probe_link(&comm, i, 0, rph, stream)?;
        probes.extend(p.filter(|_| comm.rank() == 0));
    }
    if rph > 1 {
        // two ranks of host 0: the path between them never leaves the host
        let p = probe_link(&comm, 0, 0, 1, stream)?;
        probes.extend(p.filter(|_| comm.rank() == 0).map(|p| LinkProbe { name: "host".into(), declared_bytes_per_s: None, ..p }));
    }
    if comm.rank() == 0 {
        std::fs::write(&a.out, serde_json::to_vec_pretty(&probes)?).with_context(|| format!("writing {}", a.out.display()))?;
    }
    comm.barrier()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_parses_back_what_the_parent_wrote() {
        let a = ProbeWorkerArgs { seconds: 0.25, out: "/tmp/x y.json".into(), ranks_per_host: 2 };
        let b: ProbeWorkerArgs = crate::parse_back(&a.to_argv());
        assert_eq!(a, b);
    }
}
