//! What `ironweave doctor` reports: every backend, compiled in or not, usable here or why not,
//! and the links (or devices) it finds.

use ironweave_transport::{Error, Result};
use serde::Serialize;

use crate::backend::{self, Backend, LinkReport};

/// One backend as the doctor sees it.
#[derive(Debug, Clone, Serialize)]
pub struct BackendReport {
    /// Its name (`tcp`, `ucx`, `verbs`, `nccl`).
    pub backend: &'static str,
    /// Whether this build has it (its cargo feature was on).
    pub compiled: bool,
    /// Whether it can be used on this machine.
    pub usable: bool,
    /// Version and devices when usable, else the reason it is not.
    pub detail: String,
    /// Links (or devices) found, each with whether it works.
    pub links: Vec<LinkReport>,
}

/// Every backend: compiled in or not, usable here or why not, and the links found.
pub fn doctor() -> Vec<BackendReport> {
    Backend::ALL
        .into_iter()
        .map(|b| {
            let r = match b {
                Backend::Tcp => tcp_links(),
                Backend::Ucx => backend::ucx::doctor(),
                Backend::Verbs => backend::verbs::doctor(),
                Backend::Nccl => backend::nccl::doctor(),
            };
            match r {
                Ok((detail, links)) => BackendReport { backend: b.name(), compiled: b.compiled(), usable: true, detail, links },
                Err(e) => BackendReport {
                    backend: b.name(),
                    compiled: b.compiled(),
                    usable: false,
                    detail: e.to_string(),
                    links: Vec::new(),
                },
            }
        })
        .collect()
}

/// IPv4 interfaces that are up: the candidate TCP links (`IRONWEAVE_TCP_LINKS=name=ip,...`).
fn tcp_links() -> Result<(String, Vec<LinkReport>)> {
    let mut out = Vec::new();
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return Err(Error::io("listing network interfaces", &std::io::Error::last_os_error()));
    }
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let i = unsafe { &*p };
        p = i.ifa_next;
        if i.ifa_addr.is_null() || (i.ifa_flags & libc::IFF_UP as u32) == 0 {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points at a sockaddr of the family it names.
        if i32::from(unsafe { (*i.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET addresses are sockaddr_in.
        let sin = unsafe { &*i.ifa_addr.cast::<libc::sockaddr_in>() };
        let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        // SAFETY: ifa_name is a NUL-terminated interface name.
        let name = unsafe { std::ffi::CStr::from_ptr(i.ifa_name) }.to_string_lossy().into_owned();
        let speed = std::fs::read_to_string(format!("/sys/class/net/{name}/speed"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .filter(|&s| s > 0)
            .map_or("speed unknown".to_string(), |s| format!("{s} Mbit/s"));
        out.push(LinkReport { name: format!("tcp:{name}"), usable: true, detail: format!("{ip}, {speed}") });
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(ifa) };
    Ok(("pure Rust over std::net (always available)".into(), out))
}
