//! Link probe: measures a link's latency (alpha: half the median round trip of an 8-byte
//! ping-pong) and bandwidth (beta: a one-way stream of large messages, closed by an
//! acknowledgement) between two ranks. The result is what the planners consume.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::comm::Communicator;
use crate::error::{Error, Result};

/// What a probe measured on one link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkProbe {
    /// The link's name (`tcp:a`).
    pub name: String,
    /// One-way latency of a small message, seconds (alpha).
    pub latency_s: f64,
    /// Streaming bandwidth, bytes per second (1/beta).
    pub bandwidth_bytes_per_s: f64,
    /// The rate the link declares (from configuration), bytes per second, if any.
    pub declared_bytes_per_s: Option<f64>,
    /// Bytes streamed for the bandwidth figure.
    pub streamed_bytes: u64,
}

const TAG: u32 = 0x7072_6f62 & crate::MAX_USER_TAG;

/// Probes link `link` between group ranks `a` (which streams) and `b`. Every other rank
/// returns `Ok(None)` at once; `a` and `b` both return the measurement. `stream_for` bounds
/// how long the bandwidth test runs.
pub fn probe_link(comm: &Communicator, link: usize, a: usize, b: usize, stream_for: Duration) -> Result<Option<LinkProbe>> {
    let me = comm.rank();
    if a == b || a >= comm.size() || b >= comm.size() {
        return Err(Error::InvalidArgument(format!("probe needs two distinct ranks of {}, got {a} and {b}", comm.size())));
    }
    if me != a && me != b {
        return Ok(None);
    }
    let view = comm.on_link(link)?;
    let info = view.links()[link].clone();
    let peer = if me == a { b } else { a };
    // Ping-pong: a sends, b echoes.
    let mut rtts = Vec::with_capacity(200);
    let mut buf = [0u8; 8];
    for i in 0..200u64 {
        if me == a {
            let t = Instant::now();
            view.send(peer, TAG, &i.to_le_bytes())?;
            view.recv(peer, TAG, &mut buf)?;
            rtts.push(t.elapsed().as_secs_f64());
        } else {
            view.recv(peer, TAG, &mut buf)?;
            view.send(peer, TAG, &buf)?;
        }
    }
    // Stream: a sends chunks until `stream_for` passed, then a zero-length end marker; b
    // acknowledges the end. Time from the first byte to the acknowledgement (minus one latency).
    let chunk = vec![0x5au8; 4 << 20];
    let mut streamed = 0u64;
    let secs;
    if me == a {
        let t = Instant::now();
        while t.elapsed() < stream_for {
            view.send_bytes(peer, TAG + 1, &chunk)?;
            streamed += chunk.len() as u64;
        }
        view.send_bytes(peer, TAG + 1, &[])?;
        view.recv_bytes(peer, TAG + 2)?;
        secs = t.elapsed().as_secs_f64();
        view.send(peer, TAG + 3, &[streamed as f64, secs])?;
    } else {
        loop {
            let m = view.recv_bytes(peer, TAG + 1)?;
            if m.is_empty() {
                break;
            }
        }
        view.send_bytes(peer, TAG + 2, &[])?;
        let mut r = [0f64; 2];
        view.recv(peer, TAG + 3, &mut r)?;
        streamed = r[0] as u64;
        secs = r[1];
    }
    // b learns the round trips too, so both return the same figures.
    let mut lat = [0.0f64];
    if me == a {
        rtts.sort_by(|x, y| x.total_cmp(y));
        lat[0] = rtts[rtts.len() / 2] / 2.0;
        view.send(peer, TAG + 4, &lat)?;
    } else {
        view.recv(peer, TAG + 4, &mut lat)?;
    }
    let declared = (info.speed_source != crate::SpeedSource::Unknown).then_some(info.bandwidth_bytes_per_s);
    Ok(Some(LinkProbe {
        name: info.name,
        latency_s: lat[0],
        bandwidth_bytes_per_s: streamed as f64 / (secs - lat[0]).max(1e-9),
        declared_bytes_per_s: declared,
        streamed_bytes: streamed,
    }))
}
