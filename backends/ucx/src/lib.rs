//! # ironweave-ucx
//!
//! A transport backend over UCX (feature `ucx` of the `ironweave` facade and CLI). Each link is one
//! UCX context and worker restricted to a set of UCX transports, so that shared memory
//! (`posix,sysv,cma,self`) and TCP (`tcp`) show up as separate links a communicator can stripe
//! over or the planner can price separately. Messages are UCX active messages; matching,
//! reassembly and failure propagation are the shared [`Mailbox`](ironweave_transport::Mailbox)'s.
//!
//! UCX is loaded at run time by `ironweave-ucx-sys`: a machine without it builds the same
//! binary and gets [`Error::Config`] naming the libraries tried. Worker addresses are exchanged
//! through the job's rendezvous (the same one the TCP backend uses).
//!
//! Environment: `IRONWEAVE_UCX_LINKS` (comma-separated `shm`, `tcp`, `default` or
//! `name:tl+tl`; default `shm,tcp` when every rank runs on one host — same host name and
//! network namespace — else `tcp`),
//! `IRONWEAVE_UCX_SPIN_US` (busy-poll time after activity before sleeping, default 50),
//! `IRONWEAVE_UCX_LINGER_S`, `IRONWEAVE_TIMEOUT_S`.
//!
//! ```
//! // libucp is loaded at run time: where it is missing this says so, naming what was tried
//! match ironweave_ucx::available() {
//!     Ok(version) => println!("UCX {version}"),
//!     Err(e) => println!("no UCX here: {e}"),
//! }
//! ```

mod link;
pub mod ucp;

use std::sync::Arc;
use std::time::Duration;

use ironweave_transport::rendezvous::{JobEnv, Rendezvous};
use ironweave_transport::shm::ShmConfig;
use ironweave_transport::{CommOptions, Communicator, Error, Link, Result};

pub use link::{UcxLink, UcxLinkSpec};

/// Which links to open and how the progress threads behave.
#[derive(Debug, Clone, PartialEq)]
pub struct UcxConfig {
    /// Links in order; empty means `shm,tcp` on a single host, `tcp` across hosts.
    pub links: Vec<UcxLinkSpec>,
    /// Busy-polling time after activity before a progress thread sleeps.
    pub spin: Duration,
    /// How long closing waits for peers' goodbyes.
    pub linger: Duration,
    /// Deadline for setup.
    pub timeout: Duration,
    /// The intra-host shared-memory path for whole-world collectives when every rank is on
    /// one host (`IRONWEAVE_SHM*`); the UCX links then carry point-to-point traffic.
    pub shm: ShmConfig,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            links: Vec::new(),
            spin: Duration::from_micros(50),
            linger: Duration::from_secs(10),
            timeout: ironweave_transport::DEFAULT_TIMEOUT,
            shm: ShmConfig::default(),
        }
    }
}

/// Parses a link list: `shm`, `tcp`, `default` (UCX's own choice, honouring `UCX_TLS`) or
/// `name:tl+tl+...` for any UCX transport list.
pub fn parse_links(v: &str) -> Result<Vec<UcxLinkSpec>> {
    let mut out: Vec<UcxLinkSpec> = Vec::new();
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let spec = if let Some((name, tls)) = item.split_once(':') {
            if name.is_empty() || tls.is_empty() {
                return Err(Error::Config(format!("UCX link {item:?}: expected name:tl+tl")));
            }
            UcxLinkSpec { name: name.to_string(), tls: Some(tls.replace('+', ",")) }
        } else if item == "default" {
            UcxLinkSpec { name: "default".into(), tls: None }
        } else if let Some(tls) = ucp::preset_tls(item) {
            UcxLinkSpec { name: item.to_string(), tls: Some(tls.to_string()) }
        } else {
            return Err(Error::Config(format!("UCX link {item:?}: use shm, tcp, default or name:tl+tl (e.g. rc:rc_verbs+self)")));
        };
        if out.iter().any(|s| s.name == spec.name) {
            return Err(Error::Config(format!("UCX link {:?} is listed twice", spec.name)));
        }
        out.push(spec);
    }
    if out.is_empty() {
        return Err(Error::Config(format!("IRONWEAVE_UCX_LINKS={v:?} names no link")));
    }
    Ok(out)
}

fn env_f64(k: &str) -> Result<Option<f64>> {
    match std::env::var(k) {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .map(Some)
            .ok_or_else(|| Error::Config(format!("{k}={v:?} is not a non-negative number"))),
    }
}

impl UcxConfig {
    /// Reads `IRONWEAVE_UCX_LINKS`, `IRONWEAVE_UCX_SPIN_US`, `IRONWEAVE_UCX_LINGER_S`,
    /// `IRONWEAVE_TIMEOUT_S` and the shared-memory path's `IRONWEAVE_SHM*`.
    pub fn from_env() -> Result<Self> {
        let mut c = UcxConfig::default();
        if let Ok(v) = std::env::var("IRONWEAVE_UCX_LINKS") {
            c.links = parse_links(&v)?;
        }
        if let Some(us) = env_f64("IRONWEAVE_UCX_SPIN_US")? {
            c.spin = Duration::from_secs_f64(us.min(1e6) / 1e6);
        }
        if let Some(s) = env_f64("IRONWEAVE_UCX_LINGER_S")? {
            c.linger = Duration::from_secs_f64(s.min(3600.0));
        }
        c.timeout = CommOptions::from_env()?.timeout;
        c.shm = ShmConfig::from_env()?;
        Ok(c)
    }
}

/// Whether UCX can be used here: `Ok` with its version, or why not.
pub fn available() -> Result<String> {
    let lib = ucp::lib()?;
    let (mut major, mut minor, mut release) = (0u32, 0u32, 0u32);
    // SAFETY: writes three integers.
    unsafe { lib.ucp_get_version(&mut major, &mut minor, &mut release) };
    Ok(format!("UCX {major}.{minor}.{release}"))
}

/// Tries to open each link of `specs` on this machine alone (context and worker, no peers):
/// what `ironweave doctor` reports.
pub fn probe_links(specs: &[UcxLinkSpec]) -> Vec<(String, Result<()>)> {
    specs
        .iter()
        .map(|s| {
            let r = std::thread::scope(|sc| {
                // On a scratch thread, as UCX objects belong to the thread that made them.
                sc.spawn(|| ucp::Context::new(s.tls.as_deref()).and_then(|c| ucp::Worker::new(&c).map(drop)))
                    .join()
                    .unwrap_or_else(|_| Err(Error::Config("UCX probe panicked".into())))
            });
            (format!("ucx:{}", s.name), r)
        })
        .collect()
}

/// Joins the job described by the environment over UCX.
pub fn init_from_env() -> Result<Communicator> {
    let env = JobEnv::from_env()?;
    connect(&env, &UcxConfig::from_env()?, CommOptions::from_env()?)
}

/// Joins the job: rendezvous, one UCX link per spec, the world communicator.
pub fn connect(env: &JobEnv, cfg: &UcxConfig, opts: CommOptions) -> Result<Communicator> {
    let links = join(env, cfg)?;
    let intra = links.first().and_then(|l| l.intra_host());
    Ok(Communicator::new(links.into_iter().map(|l| l as Arc<dyn Link>).collect(), with_ucx_segments(opts))?
        .with_intra_host(intra))
}

/// Segment size of collectives over UCX unless the caller chose one (`IRONWEAVE_SEGMENT_BYTES`
/// or a non-default [`CommOptions::segment_bytes`]): every UCX message costs a few thread
/// hand-offs and a rendezvous handshake (tens of microseconds), so fewer, larger messages win
/// (measured in docs/BENCHMARKS.md); the TCP backend's 1 MiB favours pipelining instead.
pub const SEGMENT_BYTES: usize = 8 << 20;

fn with_ucx_segments(mut opts: CommOptions) -> CommOptions {
    if std::env::var_os("IRONWEAVE_SEGMENT_BYTES").is_none() && opts.segment_bytes == CommOptions::default().segment_bytes {
        opts.segment_bytes = SEGMENT_BYTES;
    }
    opts
}

/// Joins the job and returns its links (rendezvous opened and closed here).
pub fn join(env: &JobEnv, cfg: &UcxConfig) -> Result<Vec<Arc<UcxLink>>> {
    available()?;
    let mut rv = Rendezvous::connect(env, cfg.timeout)?;
    let links = connect_links(env, &mut rv, cfg)?;
    if let Some(first) = links.first() {
        if let Some(g) = ironweave_transport::shm::join_job(env, &mut rv, &cfg.shm, first.health())? {
            first.set_intra_host(Arc::new(g));
        }
    }
    rv.close()?;
    Ok(links)
}

/// What identifies "the same host" for shared memory: the host name plus the network
/// namespace (ranks of the emulated cluster share a kernel and a host name but stand for
/// different hosts, one namespace each; shared memory between them would bypass the emulated
/// links).
fn host_key() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name}/{netns}")
}

/// Opens every link of `cfg` to every peer, exchanging worker addresses through `rv`.
pub fn connect_links(env: &JobEnv, rv: &mut Rendezvous, cfg: &UcxConfig) -> Result<Vec<Arc<UcxLink>>> {
    let specs = if cfg.links.is_empty() {
        let hosts = rv.all_gather("ucx-hosts", host_key().as_bytes())?;
        let one_host = hosts.iter().all(|h| h == &hosts[0]);
        parse_links(if one_host { "shm,tcp" } else { "tcp" })?
    } else {
        cfg.links.clone()
    };
    let tuning = link::Tuning { spin: cfg.spin, linger: cfg.linger };
    let mut out = Vec::new();
    for spec in &specs {
        let (l, addr, wiring) = UcxLink::start(spec, env.rank, env.world_size, tuning.clone())?;
        let table = rv.all_gather(&format!("ucx-addr-{}", spec.name), &addr)?;
        if let Some(r) = table.iter().position(Vec::is_empty) {
            return Err(Error::Protocol { from: format!("rank {r}"), detail: "empty UCX worker address".into() });
        }
        wiring.finish(table, cfg.timeout)?;
        out.push(Arc::new(l));
    }
    Ok(out)
}

/// An `n`-rank UCX job inside this process (one thread per rank joins it through a loopback
/// rendezvous): tests, benchmarks, single-host tools. Communicators in rank order.
pub fn local_world(n: usize, cfg: &UcxConfig, opts: CommOptions) -> Result<Vec<Communicator>> {
    local_links(n, cfg)?
        .into_iter()
        .map(|links| {
            let intra = links.first().and_then(|l| l.intra_host());
            Ok(Communicator::new(links.into_iter().map(|l| l as Arc<dyn Link>).collect(), opts.clone())?.with_intra_host(intra))
        })
        .collect()
}

/// Like [`local_world`] but returns each rank's links themselves.
pub fn local_links(n: usize, cfg: &UcxConfig) -> Result<Vec<Vec<Arc<UcxLink>>>> {
    available()?;
    let cfg = cfg.clone();
    ironweave_transport::rendezvous::local_job(n, "ucx", move |env| join(&env, &cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_lists_parse_and_bad_ones_say_why() {
        let l = parse_links("shm, tcp,rc:rc_verbs+self").unwrap();
        assert_eq!(l.len(), 3);
        assert_eq!(l[0].tls.as_deref(), Some("posix,sysv,cma,self"));
        assert_eq!(l[2].tls.as_deref(), Some("rc_verbs,self"));
        assert_eq!(parse_links("default").unwrap()[0].tls, None);
        for bad in ["", "carrier-pigeon", "shm,shm", "x:"] {
            assert!(matches!(parse_links(bad), Err(Error::Config(_))), "{bad}");
        }
    }
}
