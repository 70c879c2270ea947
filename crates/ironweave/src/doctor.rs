//! What `ironweave doctor` reports: every backend, compiled in or not, usable here or why not,
//! and the links (or devices) it finds.

use ironweave_transport::{Error, Result};
use serde::Serialize;

use crate::Backend;

/// One backend as the doctor sees it.
#[derive(Debug, Clone, Serialize)]
pub struct BackendReport {
    pub backend: &'static str,
    pub compiled: bool,
    /// Whether it can be used on this machine.
    pub usable: bool,
    /// Version and devices when usable, else the reason it is not.
    pub detail: String,
    /// Links (or devices) found, each with whether it works.
    pub links: Vec<LinkReport>,
}

/// One link of a backend.
#[derive(Debug, Clone, Serialize)]
pub struct LinkReport {
    pub name: String,
    pub usable: bool,
    pub detail: String,
}

/// Every backend: compiled in or not, usable here or why not, and the links found.
pub fn doctor() -> Vec<BackendReport> {
    Backend::ALL
        .into_iter()
        .map(|b| {
            let r = match b {
                Backend::Tcp => tcp_links(),
                Backend::Ucx => ucx::doctor(),
                Backend::Verbs => verbs::doctor(),
                Backend::Nccl => nccl::doctor(),
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

#[cfg(feature = "ucx")]
mod ucx {
    use super::LinkReport;
    use ironweave_transport::Result;

    pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
        let version = ironweave_ucx::available()?;
        let specs = ironweave_ucx::parse_links("shm,tcp")?;
        let links = ironweave_ucx::probe_links(&specs)
            .into_iter()
            .zip(&specs)
            .map(|((name, r), spec)| LinkReport {
                name,
                usable: r.is_ok(),
                detail: match r {
                    Ok(()) => format!("UCX_TLS={}", spec.tls.as_deref().unwrap_or("default")),
                    Err(e) => e.to_string(),
                },
            })
            .collect();
        Ok((version, links))
    }
}

#[cfg(feature = "verbs")]
mod verbs {
    use super::LinkReport;
    use ironweave_transport::Result;

    pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
        let devs = ironweave_verbs::available()?;
        let links = devs
            .iter()
            .map(|d| LinkReport { name: format!("verbs:{}", d.name), usable: d.active_ports > 0, detail: d.to_string() })
            .collect();
        Ok((format!("{} RDMA device(s)", devs.len()), links))
    }
}

#[cfg(feature = "nccl")]
mod nccl {
    use super::LinkReport;
    use ironweave_transport::Result;

    pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
        let info = ironweave_nccl::available()?;
        let links = (0..info.devices)
            .map(|d| LinkReport { name: format!("nccl:cuda{d}"), usable: true, detail: "CUDA device".into() })
            .collect();
        Ok((info.to_string(), links))
    }
}

/// A backend left out of this build answers NotCompiledWith.
#[allow(unused_macros)] // unused when every backend is compiled in
macro_rules! stub {
    ($m:ident, $f:literal) => {
        mod $m {
            use super::LinkReport;
            use ironweave_transport::{Error, Result};
            pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
                Err(Error::NotCompiledWith { feature: $f })
            }
        }
    };
}
#[cfg(not(feature = "ucx"))]
stub!(ucx, "ucx");
#[cfg(not(feature = "verbs"))]
stub!(verbs, "verbs");
#[cfg(not(feature = "nccl"))]
stub!(nccl, "nccl");
