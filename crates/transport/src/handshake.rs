//! Connection handshake: job id, world size, rank and a shared-secret challenge, both ways.
//!
//! Used by the rendezvous and by every data connection of the TCP backend. Bytes that are not
//! an ironweave handshake are *garbage*: the connection is dropped and the job goes on. A peer
//! that speaks the protocol but carries the wrong job, world size or secret is a misconfigured
//! job member: it is rejected with a reason, and both sides report a typed error.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::wire::{nonce, proof, Handshake, Role, VERSION};

/// What both sides of a connection must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// Job id; ranks of different jobs never talk.
    pub job: String,
    /// Shared secret (never sent; proven by a challenge).
    pub secret: Vec<u8>,
    /// World size.
    pub world: u32,
}

/// Who connected, after a successful server-side handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerHello {
    pub rank: u32,
    pub link: u16,
    pub conn: u16,
}

/// Outcome of reading a handshake message.
enum ReadErr {
    /// Not our protocol, or the peer vanished before saying anything coherent.
    Garbage(String),
    Io(std::io::Error),
}

fn read_msg(s: &mut TcpStream, deadline: Instant) -> std::result::Result<Handshake, ReadErr> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(ReadErr::Io)?;
    let mut pre = [0u8; 4];
    s.read_exact(&mut pre).map_err(ReadErr::Io)?;
    let n = Handshake::check_len(pre).map_err(|e| ReadErr::Garbage(e.to_string()))?;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).map_err(ReadErr::Io)?;
    Handshake::decode(&body).map_err(|e| ReadErr::Garbage(e.to_string()))
}

fn write_msg(s: &mut TcpStream, m: &Handshake, what: &str) -> Result<()> {
    s.write_all(&m.encode()).map_err(|e| Error::io(what, &e))
}

/// Server side. `Ok(None)` means garbage (drop the connection, carry on); `Err` means a
/// protocol-speaking peer was rejected (report it).
pub fn accept(s: &mut TcpStream, creds: &Credentials, role: Role, timeout: Duration) -> Result<Option<PeerHello>> {
    let deadline = Instant::now() + timeout;
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let hello = match read_msg(s, deadline) {
        Ok(h) => h,
        Err(_) => return Ok(None),
    };
    let Handshake::Hello { version, role: their_role, job, rank, world, link, conn, nonce: cn } = hello else {
        return Ok(None);
    };
    let reason = if version != VERSION {
        Some(format!("protocol version {version}, this side speaks {VERSION}: run the same ironweave build on every rank"))
    } else if their_role != role {
        Some(format!("a {their_role:?} connection reached a {role:?} port"))
    } else if job != creds.job {
        Some(format!("job id {job:?} does not match {:?}: this port belongs to another job", creds.job))
    } else if world != creds.world {
        Some(format!("world size {world} does not match {}: every rank must be started with the same world size", creds.world))
    } else if rank >= world {
        Some(format!("rank {rank} is out of range for world size {world}"))
    } else {
        None
    };
    let reject = |s: &mut TcpStream, reason: String| -> Result<Option<PeerHello>> {
        let _ = write_msg(s, &Handshake::Reject { reason: reason.clone() }, "handshake reject");
        Err(Error::HandshakeRejected { peer: format!("{peer} (claims rank {rank})"), reason })
    };
    if let Some(r) = reason {
        return reject(s, r);
    }
    let sn = nonce();
    write_msg(
        s,
        &Handshake::Challenge { nonce: sn, proof: proof(&creds.secret, "server", &creds.job, &cn, &sn) },
        "handshake challenge",
    )?;
    match read_msg(s, deadline) {
        Ok(Handshake::Proof { proof: p }) if p == proof(&creds.secret, "client", &creds.job, &cn, &sn) => {}
        Ok(Handshake::Proof { .. }) => {
            return reject(s, "wrong secret: IRONWEAVE_SECRET differs between ranks".into());
        }
        Ok(Handshake::Reject { reason }) => {
            return Err(Error::HandshakeRejected { peer: format!("{peer} (claims rank {rank})"), reason });
        }
        _ => return Ok(None),
    }
    write_msg(s, &Handshake::Accept, "handshake accept")?;
    s.set_read_timeout(None).map_err(|e| Error::io("clear read timeout", &e))?;
    Ok(Some(PeerHello { rank, link, conn }))
}

/// Client side: introduces rank `rank` on `link`/`conn`; any refusal is an error naming why.
pub fn connect(
    s: &mut TcpStream,
    creds: &Credentials,
    role: Role,
    rank: u32,
    link: u16,
    conn: u16,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let rejected = |reason: String| Error::HandshakeRejected { peer: peer.clone(), reason };
    let cn = nonce();
    let hello =
        Handshake::Hello { version: VERSION, role, job: creds.job.clone(), rank, world: creds.world, link, conn, nonce: cn };
    write_msg(s, &hello, "handshake hello")?;
    let read = |s: &mut TcpStream| match read_msg(s, deadline) {
        Ok(m) => Ok(m),
        Err(ReadErr::Garbage(g)) => {
            Err(rejected(format!("the peer answered with something that is not an ironweave handshake ({g})")))
        }
        Err(ReadErr::Io(e)) => Err(rejected(format!("connection closed during the handshake ({e})"))),
    };
    match read(s)? {
        Handshake::Challenge { nonce: sn, proof: p } => {
            if p != proof(&creds.secret, "server", &creds.job, &cn, &sn) {
                let reason = "wrong secret: the peer cannot prove it knows IRONWEAVE_SECRET".to_string();
                let _ = write_msg(s, &Handshake::Reject { reason: reason.clone() }, "handshake reject");
                return Err(rejected(reason));
            }
            write_msg(s, &Handshake::Proof { proof: proof(&creds.secret, "client", &creds.job, &cn, &sn) }, "handshake proof")?;
        }
        Handshake::Reject { reason } => return Err(rejected(reason)),
        other => return Err(rejected(format!("unexpected handshake message {other:?}"))),
    }
    match read(s)? {
        Handshake::Accept => {
            s.set_read_timeout(None).map_err(|e| Error::io("clear read timeout", &e))?;
            Ok(())
        }
        Handshake::Reject { reason } => Err(rejected(reason)),
        other => Err(rejected(format!("unexpected handshake message {other:?}"))),
    }
}

/// Connects to `addr`, retrying refused connections until `deadline` (the server may not be
/// listening yet).
pub fn connect_retry(addr: std::net::SocketAddr, deadline: Instant) -> Result<TcpStream> {
    connect_retry_watching(addr, deadline, &|| None)
}

/// [`connect_retry`], giving up as soon as `watch` says why (an elastic job's board announced
/// a newer generation: the peer being waited for will never listen here).
pub fn connect_retry_watching(
    addr: std::net::SocketAddr,
    deadline: Instant,
    watch: &(dyn Fn() -> Option<Error> + Send + Sync),
) -> Result<TcpStream> {
    let start = Instant::now();
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(e) = watch() {
            return Err(e);
        }
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
            Ok(s) => {
                s.set_nodelay(true).map_err(|e| Error::io("set TCP_NODELAY", &e))?;
                return Ok(s);
            }
            Err(e) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    Err(Error::Timeout {
        what: format!("connecting to {addr} (last error: {})", last.map(|e| e.to_string()).unwrap_or_else(|| "none".into())),
        // zero when the deadline had passed before the first attempt: the message says so
        after: start.elapsed().min(deadline.saturating_duration_since(start)),
    })
}

#[cfg(test)]
mod hostile_peers {
    //! A peer that speaks just enough of the protocol to be read: each hostile message is
    //! refused within the deadline, without allocating what it claims, with a typed error
    //! naming the peer where the peer speaks the protocol.
    use std::net::TcpListener;

    use super::*;

    fn creds() -> Credentials {
        Credentials { job: "job".into(), secret: b"s3cret".to_vec(), world: 4 }
    }

    /// Runs `accept` on a fresh loopback port while `client` talks to it.
    fn serve(client: impl FnOnce(TcpStream) + Send) -> (Result<Option<PeerHello>>, Duration) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::scope(|sc| {
            sc.spawn(move || client(TcpStream::connect(addr).unwrap()));
            let (mut s, _) = l.accept().unwrap();
            let t0 = Instant::now();
            let r = accept(&mut s, &creds(), Role::Data, Duration::from_secs(2));
            (r, t0.elapsed())
        })
    }

    fn hello(job: &str, rank: u32) -> Handshake {
        Handshake::Hello { version: VERSION, role: Role::Data, job: job.into(), rank, world: 4, link: 0, conn: 0, nonce: [1; 16] }
    }

    #[test]
    fn an_absurd_length_is_garbage_at_once() {
        let (r, t) = serve(|mut c| {
            // claims 4 GiB of handshake
            c.write_all(&u32::MAX.to_le_bytes()).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        assert!(matches!(r, Ok(None)), "{r:?}");
        assert!(t < Duration::from_secs(1), "took {t:?}: the claim must be refused before reading it");
    }

    #[test]
    fn silence_ends_at_the_deadline() {
        let (r, t) = serve(|_c| std::thread::sleep(Duration::from_secs(3)));
        assert!(matches!(r, Ok(None)), "{r:?}");
        assert!(t < Duration::from_secs(3), "took {t:?}");
    }

    #[test]
    fn another_jobs_hello_and_a_wrong_proof_are_rejected_naming_the_peer() {
        let (r, _) = serve(|mut c| {
            c.write_all(&hello("other", 1).encode()).unwrap();
            let _ = read_msg(&mut c, Instant::now() + Duration::from_secs(2));
        });
        let e = r.unwrap_err().to_string();
        assert!(e.contains("claims rank 1") && e.contains("another job"), "{e}");
        let (r, _) = serve(|mut c| {
            c.write_all(&hello("job", 5).encode()).unwrap();
            let _ = read_msg(&mut c, Instant::now() + Duration::from_secs(2));
        });
        assert!(r.unwrap_err().to_string().contains("out of range"));
        let (r, _) = serve(|mut c| {
            c.write_all(&hello("job", 2).encode()).unwrap();
            let _ = read_msg(&mut c, Instant::now() + Duration::from_secs(2));
            c.write_all(&Handshake::Proof { proof: [0; 32] }.encode()).unwrap();
            let _ = read_msg(&mut c, Instant::now() + Duration::from_secs(2));
        });
        let e = r.unwrap_err().to_string();
        assert!(e.contains("claims rank 2") && e.contains("wrong secret"), "{e}");
    }

    #[test]
    fn a_server_answering_garbage_fails_the_client_with_a_reason() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::scope(|sc| {
            sc.spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let _ = read_msg(&mut s, Instant::now() + Duration::from_secs(2));
                s.write_all(&(1u32 << 31).to_le_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
            });
            let mut c = TcpStream::connect(addr).unwrap();
            let e = connect(&mut c, &creds(), Role::Data, 1, 0, 0, Duration::from_secs(2)).unwrap_err().to_string();
            assert!(e.contains("not an ironweave handshake"), "{e}");
        });
    }
}
