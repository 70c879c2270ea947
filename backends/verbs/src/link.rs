//! [`VerbsLink`]: RC queue pairs to every peer, driven by one progress thread.

use ironweave_units::Locked;
use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ironweave_transport::rendezvous::{JobEnv, Rendezvous};
use ironweave_transport::{
    join_until, wait_blocking_send, Error, Link, LinkInfo, Mailbox, MemKind, PendingSend, RecvHandle, Result, SendHandle,
    SeqTable, SpeedSource, Tag,
};
use rdma_sys as v;

use crate::dev::{Context, Cq, Qp, QpAddr, Region};
use crate::VerbsConfig;

/// Bytes per ring slot (one chunk: header + payload).
pub const SLOT_BYTES: usize = 64 << 10;
/// Slots per peer and direction (the credits a sender starts with).
pub const SLOTS: usize = 32;
const HDR: usize = 40;
const PAYLOAD: usize = SLOT_BYTES - HDR;
/// Control sends a queue pair may have outstanding.
const CTRL_MAX: usize = 16;
const CTRL: u32 = 0x8000_0000;
const CTRL_CREDITS: u32 = 1 << 24;
const CTRL_BYE: u32 = 2 << 24;
const CTRL_ABORT: u32 = 3 << 24;

const WR_DATA: u64 = 1;
const WR_CTRL: u64 = 2;
const WR_RECV: u64 = 3;

fn wr_id(kind: u64, peer: usize, slot: usize) -> u64 {
    (kind << 56) | ((peer as u64) << 16) | slot as u64
}

fn wr_parts(id: u64) -> (u64, usize, usize) {
    (id >> 56, ((id >> 16) & 0xff_ffff_ffff) as usize, (id & 0xffff) as usize)
}

/// A chunk header: tag, sequence, total length, offset, chunk length.
fn put_header(dst: &mut [u8], tag: Tag, seq: u64, total: usize, offset: usize, len: usize) {
    dst[..8].copy_from_slice(&tag.0.to_le_bytes());
    dst[8..16].copy_from_slice(&seq.to_le_bytes());
    dst[16..24].copy_from_slice(&(total as u64).to_le_bytes());
    dst[24..32].copy_from_slice(&(offset as u64).to_le_bytes());
    dst[32..36].copy_from_slice(&(len as u32).to_le_bytes());
}

fn get_header(src: &[u8]) -> Result<(Tag, u64, usize, usize, usize)> {
    let u = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&src[r]);
        u64::from_le_bytes(b)
    };
    let (tag, seq, total, offset) = (Tag(u(0..8)), u(8..16), u(16..24) as usize, u(24..32) as usize);
    let len = u32::from_le_bytes([src[32], src[33], src[34], src[35]]) as usize;
    if len > PAYLOAD || offset.checked_add(len).is_none_or(|e| e > total) {
        return Err(Error::Protocol {
            from: "verbs peer".into(),
            detail: format!("chunk {offset}+{len} of a {total}-byte message does not fit (slot payload {PAYLOAD})"),
        });
    }
    Ok((tag, seq, total, offset, len))
}

struct OutMsg {
    tag: Tag,
    seq: u64,
    offset: usize,
    send: PendingSend,
}

enum Cmd {
    Send { peer: usize, msg: OutMsg },
    Abort(String),
    Close,
}

/// Per-peer state on the progress thread. Field order is drop order: the queue pair goes
/// before the regions it may touch.
struct Peer {
    qp: Qp,
    ring: Region,
    stage: Region,
    remote_addr: u64,
    rkey: u32,
    credits: usize,
    next_remote: usize,
    stage_free: Vec<usize>,
    to_return: usize,
    ctrl_out: usize,
    queue: VecDeque<OutMsg>,
    bye: bool,
    bye_sent: bool,
}

struct Shared {
    rank: usize,
    size: usize,
    info: LinkInfo,
    mailbox: Arc<Mailbox>,
    seq: SeqTable,
    cmds: Mutex<Option<mpsc::Sender<Cmd>>>,
}

/// One verbs link to every rank of the job.
pub struct VerbsLink {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    linger: Duration,
}

impl std::fmt::Debug for VerbsLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsLink").field("name", &self.shared.info.name).field("rank", &self.shared.rank).finish()
    }
}

fn entry_bytes(a: &QpAddr, addr: u64, rkey: u32) -> [u8; 40] {
    let mut b = [0u8; 40];
    b[..2].copy_from_slice(&a.lid.to_le_bytes());
    b[2..6].copy_from_slice(&a.qpn.to_le_bytes());
    b[6..10].copy_from_slice(&a.psn.to_le_bytes());
    b[10..26].copy_from_slice(&a.gid);
    b[26..34].copy_from_slice(&addr.to_le_bytes());
    b[34..38].copy_from_slice(&rkey.to_le_bytes());
    b
}

fn parse_entry(b: &[u8]) -> (QpAddr, u64, u32) {
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[10..26]);
    let mut a8 = [0u8; 8];
    a8.copy_from_slice(&b[26..34]);
    let a = QpAddr {
        lid: u16::from_le_bytes([b[0], b[1]]),
        qpn: u32::from_le_bytes([b[2], b[3], b[4], b[5]]),
        psn: u32::from_le_bytes([b[6], b[7], b[8], b[9]]),
        gid,
    };
    (a, u64::from_le_bytes(a8), u32::from_le_bytes([b[34], b[35], b[36], b[37]]))
}

impl VerbsLink {
    /// Opens the device, creates a queue pair and rings per peer, exchanges addresses through
    /// `rv`, connects every queue pair and starts the progress thread.
    pub fn connect(env: &JobEnv, rv: &mut Rendezvous, cfg: &VerbsConfig) -> Result<VerbsLink> {
        let (me, size) = (env.rank, env.world_size);
        let ctx = Context::open(cfg.device.as_deref(), cfg.port)?;
        let cq = Cq::new(&ctx, (size * (SLOTS * 2 + CTRL_MAX * 3)).max(64) as i32)?;
        let gid = if ctx.port_attr.link_layer == 2 { ctx.gid(i32::from(cfg.gid_index))? } else { [0u8; 16] };
        let psn_base = (std::process::id().wrapping_mul(2_654_435_761) ^ (me as u32).wrapping_mul(40_503)) & 0xff_ffff;
        let mut peers: Vec<Option<Peer>> = Vec::with_capacity(size);
        let mut blob = Vec::with_capacity(size * 40);
        for p in 0..size {
            if p == me {
                peers.push(None);
                blob.extend_from_slice(&[0u8; 40]);
                continue;
            }
            let qp = Qp::new(&ctx, &cq, (SLOTS + CTRL_MAX) as u32, (SLOTS + 2 * CTRL_MAX) as u32)?;
            let ring = Region::new(&ctx, SLOTS * SLOT_BYTES, true)?;
            let stage = Region::new(&ctx, SLOTS * SLOT_BYTES, false)?;
            let addr = QpAddr { lid: ctx.port_attr.lid, qpn: qp.qpn(), psn: (psn_base + p as u32) & 0xff_ffff, gid };
            blob.extend_from_slice(&entry_bytes(&addr, ring.addr(), ring.rkey()));
            peers.push(Some(Peer {
                qp,
                ring,
                stage,
                remote_addr: 0,
                rkey: 0,
                credits: SLOTS,
                next_remote: 0,
                stage_free: (0..SLOTS).rev().collect(),
                to_return: 0,
                ctrl_out: 0,
                queue: VecDeque::new(),
                bye: false,
                bye_sent: false,
            }));
        }
        let table = rv.all_gather("verbs-qp", &blob)?;
        for (p, peer) in peers.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            let b = table.get(p).filter(|b| b.len() == size * 40).ok_or_else(|| Error::Protocol {
                from: format!("rank {p}"),
                detail: "queue-pair table of the wrong size".into(),
            })?;
            let (remote, addr, rkey) = parse_entry(&b[me * 40..me * 40 + 40]);
            for i in 0..SLOTS + 2 * CTRL_MAX {
                peer.qp.post_recv(wr_id(WR_RECV, p, i))?;
            }
            peer.qp.connect(&remote, (psn_base + p as u32) & 0xff_ffff, cfg.gid_index)?;
            peer.remote_addr = addr;
            peer.rkey = rkey;
        }
        // Nobody writes before every queue pair is ready to receive.
        rv.all_gather("verbs-ready", b"ok")?;
        let dev_name = cfg.device.clone().unwrap_or_else(|| "rdma".into());
        let info = LinkInfo {
            name: format!("verbs:{dev_name}"),
            backend: "verbs",
            bandwidth_bytes_per_s: 12.5e9,
            latency_s: 2e-6,
            speed_source: SpeedSource::Unknown,
            memory: vec![MemKind::Host],
        };
        let shared = Arc::new(Shared {
            rank: me,
            size,
            info,
            mailbox: Arc::new(Mailbox::new(me, size, 1, usize::MAX)),
            seq: SeqTable::default(),
            cmds: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel();
        *shared.cmds.locked() = Some(tx);
        let mut eng = Engine { shared: shared.clone(), peers, cq, _ctx: ctx, failed: false };
        let linger = cfg.linger;
        let thread = std::thread::Builder::new()
            .name(format!("iw-verbs-{me}"))
            .spawn(move || eng.run(&rx, linger))
            .map_err(|e| Error::io("spawn the verbs progress thread", &e))?;
        Ok(VerbsLink { shared, thread: Mutex::new(Some(thread)), linger })
    }

    fn submit(&self, cmd: Cmd) -> Result<()> {
        let ok = self.shared.cmds.locked().as_ref().is_some_and(|tx| tx.send(cmd).is_ok());
        if ok {
            Ok(())
        } else {
            Err(self.shared.mailbox.failure().unwrap_or(Error::Aborted { reason: "the verbs link is closed".into() }))
        }
    }

    fn loopback(&self, tag: Tag, seq: u64, data: Vec<u8>) -> Result<()> {
        self.shared.mailbox.deliver_whole(self.shared.rank, tag, seq, data)
    }
}

impl Link for VerbsLink {
    fn info(&self) -> &LinkInfo {
        &self.shared.info
    }

    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn send(&self, peer: usize, tag: Tag, data: &[u8], deadline: Instant) -> Result<()> {
        self.shared.mailbox.check_peer(peer)?;
        let seq = self.shared.seq.next(peer, tag);
        if peer == self.shared.rank {
            return self.loopback(tag, seq, data.to_vec());
        }
        // SAFETY: we block below until the progress thread copied `data` out (or let go of it).
        let (send, h) = unsafe { PendingSend::borrowed(data) };
        self.submit(Cmd::Send { peer, msg: OutMsg { tag, seq, offset: 0, send } })?;
        wait_blocking_send(h, deadline, self.linger + Duration::from_secs(10), || {
            self.abort(&format!("a send to rank {peer} timed out"));
        })
    }

    fn isend(&self, peer: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle> {
        self.shared.mailbox.check_peer(peer)?;
        let seq = self.shared.seq.next(peer, tag);
        if peer == self.shared.rank {
            self.loopback(tag, seq, data.clone())?;
            return Ok(SendHandle::ready(Ok(data)));
        }
        let (send, h) = PendingSend::owned(data);
        self.submit(Cmd::Send { peer, msg: OutMsg { tag, seq, offset: 0, send } })?;
        Ok(h)
    }

    fn irecv(&self, peer: usize, tag: Tag) -> Result<RecvHandle> {
        self.shared.mailbox.irecv(peer, tag)
    }

    unsafe fn irecv_into(&self, peer: usize, tag: Tag, dst: *mut u8, len: usize) -> Result<RecvHandle> {
        // SAFETY: forwarded from the caller (Link::irecv_into's contract).
        unsafe { self.shared.mailbox.irecv_into(peer, tag, dst, len) }
    }

    fn abort(&self, reason: &str) {
        let _ = self.submit(Cmd::Abort(reason.to_string()));
        self.shared.mailbox.fail(Error::Aborted { reason: reason.to_string() });
    }
}

impl Drop for VerbsLink {
    fn drop(&mut self) {
        let _ = self.submit(Cmd::Close);
        let until = Instant::now() + self.linger + Duration::from_secs(15);
        if let Some(t) = self.thread.locked().take() {
            join_until(t, until);
        }
        self.shared.mailbox.fail(Error::Aborted { reason: "link closed".into() });
    }
}

/// The progress thread's state. Field order is drop order: queue pairs and rings, then the
/// completion queue, then the device context.
struct Engine {
    shared: Arc<Shared>,
    peers: Vec<Option<Peer>>,
    cq: Cq,
    _ctx: Arc<Context>,
    failed: bool,
}

impl Engine {
    fn fail(&mut self, e: Error) {
        self.failed = true;
        self.shared.mailbox.fail(e);
    }

    fn ctrl(&mut self, p: usize, imm: u32) -> bool {
        let Some(peer) = self.peers[p].as_mut() else { return false };
        if peer.ctrl_out >= CTRL_MAX {
            return false;
        }
        match peer.qp.send_imm(wr_id(WR_CTRL, p, 0), CTRL | imm) {
            Ok(()) => {
                peer.ctrl_out += 1;
                true
            }
            Err(e) => {
                self.fail(Error::PeerLost { rank: p, detail: e.to_string() });
                false
            }
        }
    }

    /// Writes as many queued chunks as credits and staging slots allow.
    fn pump(&mut self) -> bool {
        let mut any = false;
        for p in 0..self.peers.len() {
            let mut err = None;
            if let Some(peer) = self.peers[p].as_mut() {
                while peer.credits > 0 && !peer.stage_free.is_empty() {
                    let Some(m) = peer.queue.front_mut() else { break };
                    let total = m.send.bytes().len();
                    let len = (total - m.offset).min(PAYLOAD);
                    let Some(s) = peer.stage_free.pop() else { break };
                    let r = peer.next_remote;
                    let base = s * SLOT_BYTES;
                    let slot = &mut peer.stage.bytes_mut()[base..base + HDR + len];
                    put_header(slot, m.tag, m.seq, total, m.offset, len);
                    slot[HDR..].copy_from_slice(&m.send.bytes()[m.offset..m.offset + len]);
                    let remote = peer.remote_addr + (r * SLOT_BYTES) as u64;
                    if let Err(e) =
                        peer.qp.write_imm(wr_id(WR_DATA, p, s), &peer.stage, (base, HDR + len), (remote, peer.rkey), r as u32)
                    {
                        err = Some(e);
                        break;
                    }
                    peer.credits -= 1;
                    peer.next_remote = (r + 1) % SLOTS;
                    m.offset += len;
                    any = true;
                    if m.offset == total {
                        // The bytes are copied out: the caller's buffer is free.
                        if let Some(done) = peer.queue.pop_front() {
                            done.send.finish(Ok(()));
                        }
                    }
                }
            }
            if let Some(e) = err {
                self.fail(Error::PeerLost { rank: p, detail: e.to_string() });
            }
        }
        any
    }

    fn on_recv(&mut self, p: usize, wc: &v::ibv_wc) -> Result<()> {
        // SAFETY: the union holds the immediate for the two opcodes this backend receives.
        let imm = u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data });
        let mb = self.shared.mailbox.clone();
        let Some(peer) = self.peers[p].as_mut() else { return Ok(()) };
        if wc.opcode == v::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
            let slot = imm as usize;
            if slot >= SLOTS {
                return Err(Error::Protocol { from: format!("rank {p}"), detail: format!("write into slot {slot} of {SLOTS}") });
            }
            let base = slot * SLOT_BYTES;
            let ring = &peer.ring.bytes()[base..base + SLOT_BYTES];
            let (tag, seq, total, offset, len) = get_header(ring)?;
            let data = &ring[HDR..HDR + len];
            match mb.land(p, tag, seq, total, offset, len)? {
                Some(dst) => {
                    // SAFETY: the mailbox granted `len` writable bytes at `dst` until land_done.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, len) };
                    mb.land_done(p, tag, seq, len, true);
                }
                None => {
                    mb.reserve(len);
                    let mut buf = mb.buffer(len);
                    buf.copy_from_slice(data);
                    mb.deliver(p, tag, seq, total, offset, buf)?;
                }
            }
            peer.to_return += 1;
        } else if imm & CTRL != 0 {
            let (op, val) = (imm & !CTRL & 0x7f00_0000, (imm & 0xff_ffff) as usize);
            match op {
                CTRL_CREDITS => peer.credits += val,
                CTRL_BYE => {
                    peer.bye = true;
                    mb.goodbye(p);
                }
                CTRL_ABORT => {
                    self.failed = true;
                    mb.fail(Error::PeerAborted { rank: p, reason: "aborted over verbs (reason not transmitted)".into() });
                }
                _ => return Err(Error::Protocol { from: format!("rank {p}"), detail: format!("unknown control {imm:#x}") }),
            }
        }
        peer.qp.post_recv(wc.wr_id)
    }

    fn poll(&mut self) -> bool {
        // SAFETY: plain data, written by poll.
        let mut wcs: [v::ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let n = match self.cq.poll(&mut wcs) {
            Ok(n) => n,
            Err(e) => {
                self.fail(e);
                return false;
            }
        };
        for wc in &wcs[..n] {
            let (kind, p, slot) = wr_parts(wc.wr_id);
            if p >= self.peers.len() {
                continue;
            }
            if wc.status != v::ibv_wc_status::IBV_WC_SUCCESS {
                let bye = self.peers[p].as_ref().is_some_and(|x| x.bye);
                if !bye && !self.failed {
                    self.fail(Error::PeerLost { rank: p, detail: format!("work completion status {}", wc.status) });
                }
                continue;
            }
            let r = match kind {
                WR_DATA => {
                    if let Some(peer) = self.peers[p].as_mut() {
                        peer.stage_free.push(slot);
                    }
                    Ok(())
                }
                WR_CTRL => {
                    if let Some(peer) = self.peers[p].as_mut() {
                        peer.ctrl_out = peer.ctrl_out.saturating_sub(1);
                    }
                    Ok(())
                }
                _ => self.on_recv(p, wc),
            };
            if let Err(e) = r {
                self.fail(e);
            }
        }
        // Give consumed slots back in one control message per peer.
        for p in 0..self.peers.len() {
            let give = self.peers[p].as_ref().map_or(0, |x| x.to_return);
            if give > 0 && self.ctrl(p, CTRL_CREDITS | give as u32) {
                if let Some(peer) = self.peers[p].as_mut() {
                    peer.to_return = 0;
                }
            }
        }
        n > 0
    }

    fn run(&mut self, cmds: &mpsc::Receiver<Cmd>, linger: Duration) {
        let mut closing: Option<Instant> = None;
        let mut idle_since = Instant::now();
        loop {
            let mut busy = false;
            loop {
                match cmds.try_recv() {
                    Ok(Cmd::Send { peer, msg }) => {
                        match self.peers.get_mut(peer).and_then(Option::as_mut) {
                            Some(p) if !self.failed => p.queue.push_back(msg),
                            _ => msg.send.finish(Err(self
                                .shared
                                .mailbox
                                .failure()
                                .unwrap_or(Error::Aborted { reason: "the verbs link failed".into() }))),
                        }
                        busy = true;
                    }
                    Ok(Cmd::Abort(reason)) => {
                        for p in 0..self.peers.len() {
                            self.ctrl(p, CTRL_ABORT);
                        }
                        // Give the abort messages a moment to leave before the queue pairs go.
                        let until = Instant::now() + Duration::from_millis(100);
                        while Instant::now() < until && self.peers.iter().flatten().any(|p| p.ctrl_out > 0) {
                            if !self.poll() {
                                std::thread::yield_now();
                            }
                        }
                        self.fail(Error::Aborted { reason });
                        return;
                    }
                    Ok(Cmd::Close) | Err(mpsc::TryRecvError::Disconnected) => {
                        closing.get_or_insert(Instant::now() + linger);
                        break;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            busy |= self.pump();
            busy |= self.poll();
            if let Some(until) = closing {
                let drained = self.peers.iter().flatten().all(|p| p.queue.is_empty() && p.stage_free.len() == SLOTS);
                if drained && !self.failed {
                    for p in 0..self.peers.len() {
                        if self.peers[p].as_ref().is_some_and(|x| !x.bye_sent) && self.ctrl(p, CTRL_BYE) {
                            if let Some(peer) = self.peers[p].as_mut() {
                                peer.bye_sent = true;
                            }
                        }
                    }
                }
                let all_bye = self.peers.iter().flatten().all(|p| p.bye && p.bye_sent);
                if self.failed || (drained && all_bye) || Instant::now() >= until {
                    return;
                }
            }
            if busy {
                idle_since = Instant::now();
            } else if idle_since.elapsed() > Duration::from_micros(50) {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_work_request_ids_round_trip() {
        let mut b = [0u8; HDR];
        put_header(&mut b, Tag(0xabc), 7, 1 << 20, 65496, 65496);
        assert_eq!(get_header(&b).unwrap(), (Tag(0xabc), 7, 1 << 20, 65496, 65496));
        put_header(&mut b, Tag(1), 0, 10, 5, 6);
        assert!(matches!(get_header(&b), Err(Error::Protocol { .. })), "a chunk past the message end must be refused");
        put_header(&mut b, Tag(1), 0, 1 << 30, 0, PAYLOAD + 1);
        assert!(get_header(&b).is_err(), "a chunk larger than a slot must be refused");
        for (k, p, s) in [(WR_DATA, 0, 0), (WR_RECV, 1023, 47), (WR_CTRL, 5, SLOTS - 1)] {
            assert_eq!(wr_parts(wr_id(k, p, s)), (k, p, s));
        }
        let a = QpAddr { lid: 3, qpn: 0x12345, psn: 0xabcdef, gid: [7; 16] };
        assert_eq!(parse_entry(&entry_bytes(&a, 0xdead_0000, 99)), (a, 0xdead_0000, 99));
    }
}
