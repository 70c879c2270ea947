//! # ironweave-verbs
//!
//! A transport backend over raw InfiniBand / RoCE verbs (feature `verbs` of the `ironweave` facade and CLI), for
//! those who want the queue pairs under their own control.
//!
//! Per peer, one reliable-connected queue pair and two registered rings of [`SLOTS`] slots of
//! [`SLOT_BYTES`]: a *receive ring* the peer RDMA-writes into and a *staging ring* we write
//! from. A message is cut into slot-sized chunks, each with a 40-byte header (tag, sequence,
//! total, offset, length); each chunk is one RDMA write with immediate (the immediate names the
//! remote slot), which also consumes a posted receive so the peer's completion queue learns of
//! it. The receiver copies the chunk into the shared [`Mailbox`](ironweave_transport::Mailbox)
//! (straight into a posted landing zone when there is one) and returns the slot as a credit
//! with a zero-length send with immediate; goodbye and abort travel the same way. One progress
//! thread per link polls the completion queue.
//!
//! Queue-pair addresses (LID, QPN, PSN, GID) and ring keys are exchanged through the job's
//! rendezvous. On a machine without an RDMA device, [`available`] and every constructor return
//! `Error::Config` naming the reason; nothing panics.
//!
//! Environment: `IRONWEAVE_VERBS_DEVICE` (default: first device with an active port),
//! `IRONWEAVE_VERBS_PORT` (1), `IRONWEAVE_VERBS_GID_INDEX` (0; RoCE v2 often needs 1 or 3).
//!
//! ```
//! // RDMA devices of this machine, or why there are none
//! match ironweave_verbs::available() {
//!     Ok(devices) => println!("{} RDMA device(s)", devices.len()),
//!     Err(e) => println!("no verbs here: {e}"),
//! }
//! ```

mod dev;
mod link;

use std::sync::Arc;
use std::time::Duration;

use ironweave_transport::rendezvous::{JobEnv, Rendezvous};
use ironweave_transport::{CommOptions, Communicator, Error, Link, Result};

pub use dev::{devices, DeviceInfo};
pub use link::{VerbsLink, SLOTS, SLOT_BYTES};

/// Which device and port to use.
#[derive(Debug, Clone, PartialEq)]
pub struct VerbsConfig {
    /// Device name; `None` picks the first device with `port` active.
    pub device: Option<String>,
    pub port: u8,
    /// Local GID index used for routed (RoCE) addressing.
    pub gid_index: u8,
    /// How long closing waits for peers' goodbyes.
    pub linger: Duration,
    /// Deadline for setup.
    pub timeout: Duration,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            port: 1,
            gid_index: 0,
            linger: Duration::from_secs(10),
            timeout: ironweave_transport::DEFAULT_TIMEOUT,
        }
    }
}

impl VerbsConfig {
    /// Reads `IRONWEAVE_VERBS_DEVICE`, `IRONWEAVE_VERBS_PORT`, `IRONWEAVE_VERBS_GID_INDEX`,
    /// `IRONWEAVE_TIMEOUT_S`.
    pub fn from_env() -> Result<Self> {
        let mut c =
            VerbsConfig { device: std::env::var("IRONWEAVE_VERBS_DEVICE").ok().filter(|s| !s.is_empty()), ..Self::default() };
        let num = |k: &str| -> Result<Option<u8>> {
            match std::env::var(k) {
                Err(_) => Ok(None),
                Ok(v) => {
                    v.trim().parse().map(Some).map_err(|_| Error::Config(format!("{k}={v:?} is not a number from 0 to 255")))
                }
            }
        };
        if let Some(p) = num("IRONWEAVE_VERBS_PORT")? {
            c.port = p;
        }
        if let Some(g) = num("IRONWEAVE_VERBS_GID_INDEX")? {
            c.gid_index = g;
        }
        c.timeout = CommOptions::from_env()?.timeout;
        Ok(c)
    }
}

/// The RDMA devices here when at least one has an active port; otherwise why not.
pub fn available() -> Result<Vec<DeviceInfo>> {
    let devs = devices()?;
    if devs.is_empty() {
        return Err(Error::Config(
            "no RDMA device: ibv_get_device_list found none (no RDMA NIC, or its driver is not loaded; \
             soft-RoCE needs the rdma_rxe kernel module: `rdma link add rxe0 type rxe netdev eth0`)"
                .into(),
        ));
    }
    if devs.iter().all(|d| d.active_ports == 0) {
        let names: Vec<String> = devs.iter().map(ToString::to_string).collect();
        return Err(Error::Config(format!("RDMA devices found but no port is ACTIVE: {}", names.join(", "))));
    }
    Ok(devs)
}

/// Joins the job described by the environment over verbs.
pub fn init_from_env() -> Result<Communicator> {
    let env = JobEnv::from_env()?;
    connect(&env, &VerbsConfig::from_env()?, CommOptions::from_env()?)
}

/// Joins the job: rendezvous, one verbs link, the world communicator.
pub fn connect(env: &JobEnv, cfg: &VerbsConfig, opts: CommOptions) -> Result<Communicator> {
    available()?;
    let mut rv = Rendezvous::connect(env, cfg.timeout)?;
    let link = VerbsLink::connect(env, &mut rv, cfg)?;
    rv.close()?;
    Communicator::new(vec![Arc::new(link) as Arc<dyn Link>], opts)
}

/// An `n`-rank verbs job inside this process (one thread per rank, loopback rendezvous).
pub fn local_world(n: usize, cfg: &VerbsConfig, opts: CommOptions) -> Result<Vec<Communicator>> {
    available()?;
    let cfg = cfg.clone();
    ironweave_transport::rendezvous::local_job(n, "verbs", move |env| connect(&env, &cfg, opts.clone()))
}
