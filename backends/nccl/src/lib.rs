//! # ironweave-nccl
//!
//! A transport backend over NCCL (feature `nccl` of the `ironweave` facade and CLI), through cudarc's maintained
//! bindings with the CUDA driver and NCCL loaded at run time.
//!
//! The link carries two paths: collectives on **device** buffers go to NCCL's own kernels
//! (all-reduce, broadcast, all-gather, reduce-scatter, through
//! [`NativeCollectives`](ironweave_transport::NativeCollectives)); point-to-point and
//! host-buffer traffic (rendezvous, control, the communicator's own algorithms on host memory)
//! go over a TCP link made with the same rendezvous. The NCCL unique id travels through that
//! rendezvous too.
//!
//! cudarc panics when it cannot load a library, so every entry point first checks
//! `is_culib_present()` for the driver and for NCCL and returns `Error::Config` listing the
//! file names looked for ([`available`]). Each rank uses CUDA device `local_rank % devices`;
//! NCCL refuses two ranks of one communicator on one device, so in-process worlds need as many
//! devices as ranks.
//!
//! ```
//! // the CUDA driver and NCCL are loaded at run time: without a GPU this says why
//! match ironweave_nccl::available() {
//!     Ok(info) => println!("{info:?}"),
//!     Err(e) => println!("no NCCL here: {e}"),
//! }
//! ```

mod link;

use std::sync::Arc;

use ironweave_transport::rendezvous::{JobEnv, Rendezvous};
use ironweave_transport::{CommOptions, Communicator, Error, Link, Result};

pub use link::NcclLink;

/// What this machine offers NCCL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclInfo {
    /// NCCL version code (e.g. 22304 for 2.23.4).
    pub nccl_version: i32,
    /// CUDA devices visible.
    pub devices: usize,
}

impl std::fmt::Display for NcclInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.nccl_version;
        let (major, minor, patch) =
            if v >= 10000 { (v / 10000, (v / 100) % 100, v % 100) } else { (v / 1000, (v / 100) % 10, v % 100) };
        write!(f, "NCCL {major}.{minor}.{patch}, {} CUDA device(s)", self.devices)
    }
}

fn candidates(lib: &str) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    cudarc::get_lib_name_candidates(lib).into_iter().filter(|c| seen.insert(c.clone())).collect()
}

/// Whether NCCL can run here: the driver and NCCL libraries load, the driver initialises and
/// at least one device exists. Never panics.
pub fn available() -> Result<NcclInfo> {
    // SAFETY: only tries to dlopen the candidate names; nothing is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        let mut tried = candidates("cuda");
        tried.extend(candidates("nvcuda"));
        return Err(Error::Config(format!(
            "the CUDA driver library was not found (no NVIDIA driver here?); looked for {tried:?} on the loader path (LD_LIBRARY_PATH)"
        )));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(Error::Config(format!(
            "the NCCL library was not found; looked for {:?} (install libnccl2 or put NCCL on LD_LIBRARY_PATH)",
            candidates("nccl")
        )));
    }
    cudarc::driver::result::init().map_err(|e| Error::Config(format!("the CUDA driver did not initialise: {e:?}")))?;
    let devices = cudarc::driver::CudaContext::device_count()
        .map_err(|e| Error::Config(format!("counting CUDA devices failed: {e:?}")))?
        .max(0) as usize;
    if devices == 0 {
        return Err(Error::Config("the CUDA driver loads but reports no device".into()));
    }
    let nccl_version =
        cudarc::nccl::result::get_nccl_version().map_err(|e| Error::Config(format!("ncclGetVersion failed: {e:?}")))?;
    Ok(NcclInfo { nccl_version, devices })
}

/// Joins the job described by the environment: TCP for host traffic, NCCL for device buffers.
pub fn init_from_env() -> Result<Communicator> {
    let env = JobEnv::from_env()?;
    connect(&env, &ironweave_tcp::TcpConfig::from_env()?, CommOptions::from_env()?)
}

/// Joins the job: one rendezvous for the TCP links and the NCCL unique id.
pub fn connect(env: &JobEnv, tcp: &ironweave_tcp::TcpConfig, opts: CommOptions) -> Result<Communicator> {
    let info = available()?;
    // NCCL refuses two ranks of one communicator on one device, after every rank has waited
    // for the others: say so before anyone waits
    if let Some(local) = env.local_world_size.filter(|&l| l > info.devices) {
        return Err(Error::Config(format!(
            "{local} ranks on this host need {local} CUDA devices (NCCL puts one rank per device); this host has {}: \
             start at most {} rank(s) per host",
            info.devices, info.devices
        )));
    }
    let mut rv = Rendezvous::connect(env, tcp.timeout)?;
    let mut tcp_links = ironweave_tcp::connect_links(env, &mut rv, tcp)?;
    let host = tcp_links.remove(0);
    let device = (env.local_rank % info.devices) as u32;
    let link = NcclLink::connect(env, &mut rv, host, device, opts.timeout)?;
    rv.close()?;
    Communicator::new(vec![Arc::new(link) as Arc<dyn Link>], opts)
}

/// An `n`-rank NCCL job inside this process (one thread and one device per rank).
pub fn local_world(n: usize, opts: CommOptions) -> Result<Vec<Communicator>> {
    let info = available()?;
    if n > info.devices {
        return Err(Error::Config(format!(
            "{n} ranks need {n} CUDA devices (NCCL puts one rank per device); this machine has {}",
            info.devices
        )));
    }
    let tcp = ironweave_tcp::TcpConfig { linger: std::time::Duration::from_secs(2), ..Default::default() };
    ironweave_transport::rendezvous::local_job(n, "nccl", move |env| connect(&env, &tcp, opts.clone()))
}
