//! Backend selection by name, and what `ironweave doctor` reports. A backend that was not
//! compiled in returns `Error::NotCompiledWith`, so callers need no `cfg`.

use ironweave_transport::{Communicator, Error, Result};
use serde::Serialize;

/// Names accepted by `--backend`.
pub const NAMES: [&str; 4] = ["tcp", "ucx", "verbs", "nccl"];

/// Joins the job in the environment over the named backend.
pub fn connect(name: &str) -> Result<Communicator> {
    check(name)?;
    match name {
        "ucx" => ucx::connect(),
        "verbs" => verbs::connect(),
        "nccl" => nccl::connect(),
        _ => ironweave_tcp::init_from_env(),
    }
}

/// Checks a backend name (and that it was compiled in) before any process is started.
pub fn check(name: &str) -> Result<()> {
    match name {
        "tcp" => Ok(()),
        "ucx" => compiled("ucx", cfg!(feature = "ucx")),
        "verbs" => compiled("verbs", cfg!(feature = "verbs")),
        "nccl" => compiled("nccl", cfg!(feature = "nccl")),
        other => Err(Error::InvalidArgument(format!("unknown backend {other:?}; choose one of {NAMES:?}"))),
    }
}

fn compiled(feature: &'static str, yes: bool) -> Result<()> {
    if yes {
        Ok(())
    } else {
        Err(Error::NotCompiledWith { feature })
    }
}

/// One backend as `ironweave doctor` sees it.
#[derive(Debug, Serialize)]
pub struct Report {
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
#[derive(Debug, Serialize)]
pub struct LinkReport {
    pub name: String,
    pub usable: bool,
    pub detail: String,
}

fn report(backend: &'static str, compiled: bool, r: Result<(String, Vec<LinkReport>)>) -> Report {
    match r {
        Ok((detail, links)) => Report { backend, compiled, usable: true, detail, links },
        Err(e) => Report { backend, compiled, usable: false, detail: e.to_string(), links: Vec::new() },
    }
}

/// Every backend: compiled in or not, usable here or why not, and the links found.
pub fn doctor() -> Vec<Report> {
    vec![
        report("tcp", true, tcp_links()),
        report("ucx", cfg!(feature = "ucx"), ucx::doctor()),
        report("verbs", cfg!(feature = "verbs"), verbs::doctor()),
        report("nccl", cfg!(feature = "nccl"), nccl::doctor()),
    ]
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
    use ironweave_transport::{Communicator, Result};

    pub fn connect() -> Result<Communicator> {
        ironweave_ucx::init_from_env()
    }

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
    use ironweave_transport::{Communicator, Result};

    pub fn connect() -> Result<Communicator> {
        ironweave_verbs::init_from_env()
    }

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
    use ironweave_transport::{Communicator, Result};

    pub fn connect() -> Result<Communicator> {
        ironweave_nccl::init_from_env()
    }

    pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
        let info = ironweave_nccl::available()?;
        let links = (0..info.devices)
            .map(|d| LinkReport { name: format!("nccl:cuda{d}"), usable: true, detail: "CUDA device".into() })
            .collect();
        Ok((info.to_string(), links))
    }
}

/// The stub of a backend left out of this build: the same functions, returning NotCompiledWith.
#[allow(unused_macros)]
macro_rules! stub {
    ($f:literal) => {
        use super::LinkReport;
        use ironweave_transport::{Communicator, Error, Result};

        pub fn connect() -> Result<Communicator> {
            Err(Error::NotCompiledWith { feature: $f })
        }

        pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
            Err(Error::NotCompiledWith { feature: $f })
        }
    };
}

#[cfg(not(feature = "ucx"))]
mod ucx {
    stub!("ucx");
}
#[cfg(not(feature = "verbs"))]
mod verbs {
    stub!("verbs");
}
#[cfg(not(feature = "nccl"))]
mod nccl {
    stub!("nccl");
}
