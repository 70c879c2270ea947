//! `ironweave cluster up|down|status|probe`: an emulated cluster on one machine.
//!
//! Each host is a network namespace `iw-<name>-h<i>`; each link is a bridge `br<l>` in a switch
//! namespace `iw-<name>-sw`, with one veth pair per host (the host end is named after the
//! link, e.g. `a`, and carries `10.231.<l+1>.<i+1>/24` unless the topology gives a subnet). The
//! host end's egress is shaped with `tc tbf` to the link's rate: independent, rate-limited
//! links, so communication, not the CPU, is the bottleneck. `down` deletes exactly the
//! namespaces `up` recorded (deleting a namespace deletes its interfaces).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{bail, Context, Result};
mod probe;

pub use crate::topology::{LinkDef, Topology};
pub use probe::{probe, probe_worker, ProbeArgs, ProbeWorkerArgs};

/// Longest a packet may wait in a host's shaper (`tc tbf ... latency`): the egress queue a
/// sender's writes can run ahead of the wire by.
pub const SHAPER_QUEUE_S: f64 = 0.05;

/// Payload bytes per byte the shaper counts: TCP segments of 1,448 bytes (MTU 1,500 less the
/// IP and TCP headers with timestamps) in 1,514-byte Ethernet frames; the shaper's rate is the
/// frames'.
pub const TCP_PAYLOAD_SHARE: f64 = 1448.0 / 1514.0;

/// `ironweave cluster`'s subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ClusterCmd {
    /// Create the hosts and links (needs root).
    Up {
        #[arg(long)]
        topology: PathBuf,
    },
    /// Remove what `up` created; succeeds when nothing is there.
    Down {
        #[arg(long)]
        topology: PathBuf,
    },
    /// Show the hosts and links.
    Status {
        #[arg(long)]
        topology: PathBuf,
    },
    /// Measure every link's latency and bandwidth between hosts 0 and 1.
    Probe(ProbeArgs),
}

/// `ironweave cluster ...`: returns the command's exit status (`status`: 3 when the cluster is
/// not up).
pub fn command(c: &ClusterCmd) -> Result<i32> {
    match c {
        ClusterCmd::Up { topology } => {
            let t = Topology::load(topology)?;
            up(&t)?;
            status(&t)?;
            Ok(0)
        }
        ClusterCmd::Down { topology } => {
            let t = Topology::load(topology)?;
            down(&t)?;
            println!("cluster {:?}: down", t.name);
            Ok(0)
        }
        ClusterCmd::Status { topology } => {
            let t = Topology::load(topology)?;
            Ok(if status(&t)? { 0 } else { 3 })
        }
        ClusterCmd::Probe(a) => {
            crate::launch::install_signal_handlers();
            probe(a)
        }
    }
}

/// Where `up` records the namespaces it made.
fn state_file(t: &Topology) -> PathBuf {
    PathBuf::from(format!("/run/ironweave/cluster-{}.json", t.name))
}

fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the emulated cluster needs root (network namespaces, veth, tc): run as root or with sudo");
    }
    Ok(())
}

fn sh(args: &[&str]) -> Result<()> {
    let out =
        Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {args:?} (is iproute2 installed?)"))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn existing_namespaces() -> Result<Vec<String>> {
    let out = Command::new("ip").args(["netns", "list"]).output().context("running `ip netns list` (install iproute2)")?;
    Ok(String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect())
}

/// Creates the cluster. Fails (and cleans up what it made) if any part cannot be created.
pub fn up(t: &Topology) -> Result<()> {
    require_root()?;
    let have = existing_namespaces()?;
    let ours: Vec<String> = (0..t.hosts).map(|h| t.host_ns(h)).chain([t.switch_ns()]).collect();
    if let Some(ns) = ours.iter().find(|n| have.contains(n)) {
        bail!("namespace {ns} already exists: cluster {:?} is up (run `ironweave cluster down --topology ...` first)", t.name);
    }
    let mut made = Vec::new();
    let r = build(t, &mut made);
    // Record before checking the result: `down` must find whatever was made.
    std::fs::create_dir_all("/run/ironweave").ok();
    std::fs::write(state_file(t), serde_json::to_vec_pretty(&made)?).ok();
    if let Err(e) = r {
        let _ = down(t);
        return Err(e.context(format!("cluster {:?} could not be created; removed what was made", t.name)));
    }
    Ok(())
}

fn build(t: &Topology, made: &mut Vec<String>) -> Result<()> {
    let sw = t.switch_ns();
    sh(&["ip", "netns", "add", &sw])?;
    made.push(sw.clone());
    sh(&["ip", "-n", &sw, "link", "set", "lo", "up"])?;
    for h in 0..t.hosts {
        let ns = t.host_ns(h);
        sh(&["ip", "netns", "add", &ns])?;
        made.push(ns.clone());
        sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
    }
    for (l, link) in t.links.iter().enumerate() {
        let br = format!("br{l}");
        sh(&["ip", "-n", &sw, "link", "add", "name", &br, "type", "bridge"])?;
        sh(&["ip", "-n", &sw, "link", "set", "dev", &br, "up"])?;
        for h in 0..t.hosts {
            let ns = t.host_ns(h);
            let port = format!("l{l}h{h}");
            sh(&["ip", "link", "add", "name", &link.name, "netns", &ns, "type", "veth", "peer", "name", &port, "netns", &sw])?;
            sh(&["ip", "-n", &sw, "link", "set", "dev", &port, "master", &br])?;
            sh(&["ip", "-n", &sw, "link", "set", "dev", &port, "up"])?;
            sh(&["ip", "-n", &ns, "addr", "add", &format!("{}/24", t.addr(h, l)), "dev", &link.name])?;
            sh(&["ip", "-n", &ns, "link", "set", "dev", &link.name, "up"])?;
            let queue = format!("{}ms", (SHAPER_QUEUE_S * 1e3).round());
            #[rustfmt::skip]
            sh(&["ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", &link.name, "root", "tbf", "rate", &link.rate,
                "burst", "256kb", "latency", &queue])?;
        }
    }
    Ok(())
}

/// Removes what `up` made; succeeds when there is nothing to remove.
pub fn down(t: &Topology) -> Result<()> {
    require_root()?;
    let recorded: Vec<String> =
        std::fs::read(state_file(t)).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    // Without a record (lost /run), our own naming still says what is ours.
    let prefix = format!("iw-{}-", t.name);
    let have = existing_namespaces()?;
    let mut errors = Vec::new();
    for ns in have.iter().filter(|n| recorded.contains(n) || n.starts_with(&prefix)) {
        if let Err(e) = sh(&["ip", "netns", "del", ns]) {
            errors.push(e.to_string());
        }
    }
    let _ = std::fs::remove_file(state_file(t));
    if !errors.is_empty() {
        bail!("could not remove everything: {}", errors.join("; "));
    }
    Ok(())
}

/// Runs `f` on the emulated cluster of `t`: brought up first when it is down, and taken down
/// again afterwards whatever `f` returned (a cluster that was already up is left up). `who`
/// names the caller in the warning when it cannot be taken down.
pub fn with_up<T>(t: &Topology, who: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let brought_up = if status(t)? {
        false
    } else {
        up(t).context("bringing up the emulated cluster")?;
        true
    };
    let result = f();
    if brought_up {
        if let Err(e) = down(t) {
            eprintln!("{who}: could not take the emulated cluster down: {e:#}");
        }
    }
    result
}

/// The topology at `path`, whose emulated cluster must already be up (runs do not bring it up:
/// it needs root and outlives them).
pub fn load_up(path: &Path) -> Result<Topology> {
    let t = Topology::load(path)?;
    if !status(&t)? {
        bail!("cluster {:?} is not up: run `ironweave cluster up --topology {}`", t.name, path.display());
    }
    Ok(t)
}

/// Prints the hosts, their addresses and link rates.
pub fn status(t: &Topology) -> Result<bool> {
    let have = existing_namespaces()?;
    let up = (0..t.hosts).all(|h| have.contains(&t.host_ns(h))) && have.contains(&t.switch_ns());
    println!("cluster {:?}: {}", t.name, if up { "up" } else { "down" });
    for h in 0..t.hosts {
        let links: Vec<String> =
            t.links.iter().enumerate().map(|(l, d)| format!("{}={} ({})", d.name, t.addr(h, l), d.rate)).collect();
        println!("  host {h}: namespace {} {}", t.host_ns(h), links.join("  "));
    }
    Ok(up)
}

/// Bytes every host has sent on each link so far (`tx_bytes` of the host end of the link's
/// veth, read inside the host's namespace): only traffic between hosts crosses it (ranks of
/// one host talk over loopback). `[host][link]`.
pub fn link_tx_bytes(t: &Topology) -> Result<Vec<Vec<u64>>> {
    (0..t.hosts)
        .map(|h| {
            t.links
                .iter()
                .map(|l| {
                    let ns = t.host_ns(h);
                    let path = format!("/sys/class/net/{}/statistics/tx_bytes", l.name);
                    let out = Command::new("ip")
                        .args(["netns", "exec", &ns, "cat", &path])
                        .output()
                        .with_context(|| format!("reading {path} in {ns}"))?;
                    if !out.status.success() {
                        bail!("reading {path} in {ns}: {}", String::from_utf8_lossy(&out.stderr).trim());
                    }
                    String::from_utf8_lossy(&out.stdout).trim().parse::<u64>().with_context(|| format!("{path} in {ns}"))
                })
                .collect()
        })
        .collect()
}
