//! Links: one path to the peers, moving tagged bytes point to point.
//!
//! A backend implements [`Link`]. Matching is shared by every backend through [`Mailbox`]:
//! each message carries a sequence number per (peer, tag), assigned when the send is issued,
//! and a receive posted as the k-th on (peer, tag) takes the k-th message, whatever order the
//! bytes arrive in (several connections, several threads).

use std::time::Instant;

use crate::error::{Error, Result};

mod buf;
mod handle;
mod mailbox;

pub use buf::{BufPool, RecvBuf};
pub(crate) use handle::Filled;
pub use handle::{join_until, wait_blocking_send, PendingSend, SendCompleter, SendHandle};
pub use mailbox::{set_background_thread, Mailbox, Progress, RecvHandle, SeqTable, PROGRESS_SPIN};

/// A message tag. Communicators put their context id in the upper 32 bits so that
/// sub-groups and collectives never match each other's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(pub u64);

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Ordinary host memory.
    Host,
    /// Memory of an accelerator, by device ordinal.
    Device(u32),
}

impl std::fmt::Display for MemKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemKind::Host => f.write_str("host"),
            MemKind::Device(d) => write!(f, "device {d}"),
        }
    }
}

/// Whether a link's speed figures were measured or only declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeedSource {
    /// From configuration or a backend's nominal figure.
    Declared,
    /// From a probe run (ping-pong and streaming).
    Measured,
    /// Nothing known; the figures are placeholders the planner must not trust.
    Unknown,
}

/// Name, speed and reach of a link.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkInfo {
    /// Human name, e.g. `tcp:lo` or `tcp:veth-a`.
    pub name: String,
    /// Which backend drives it (`tcp`, `inproc`, ...).
    pub backend: &'static str,
    /// Bandwidth in bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// One-way latency of a small message in seconds.
    pub latency_s: f64,
    /// Where the figures come from.
    pub speed_source: SpeedSource,
    /// Memory kinds this link can read and write.
    pub memory: Vec<MemKind>,
}

impl LinkInfo {
    /// True when the link can move buffers living in `mem`.
    pub fn can_touch(&self, mem: MemKind) -> bool {
        self.memory.contains(&mem)
    }
}

/// Operations a backend with its own collectives (NCCL) provides. The communicator calls
/// them instead of the point-to-point algorithms for buffers outside host memory, on the
/// backend's world group (sub-groups from `split` need the backend's own split, later).
pub trait NativeCollectives: Send + Sync {
    /// In-place all-reduce over the link's whole world.
    fn all_reduce(&self, buf: BufMut<'_>, dtype: crate::DType, op: crate::ReduceOp) -> Result<()>;
    /// Broadcast from world rank `root`.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// All-gather: `output` holds world-size × `input`.
    fn all_gather(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()>;
    /// Reduce-scatter: `input` holds world-size × `output`.
    fn reduce_scatter(&self, input: Buf<'_>, output: BufMut<'_>, dtype: crate::DType, op: crate::ReduceOp) -> Result<()>;
}

/// A device buffer handed through the API untouched (interpreted by a device backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    /// Device pointer.
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Device ordinal.
    pub device: u32,
}

/// A read-only buffer in host or device memory.
#[derive(Debug, Clone, Copy)]
pub enum Buf<'a> {
    /// Host bytes.
    Host(&'a [u8]),
    /// Device bytes.
    Device(DeviceSlice),
}

impl Buf<'_> {
    /// Where the buffer lives.
    pub fn memory(&self) -> MemKind {
        match self {
            Buf::Host(_) => MemKind::Host,
            Buf::Device(d) => MemKind::Device(d.device),
        }
    }
}

/// A mutable buffer in host or device memory.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// Host bytes.
    Host(&'a mut [u8]),
    /// Device bytes.
    Device(DeviceSlice),
}

impl BufMut<'_> {
    /// Where the buffer lives.
    pub fn memory(&self) -> MemKind {
        match self {
            BufMut::Host(_) => MemKind::Host,
            BufMut::Device(d) => MemKind::Device(d.device),
        }
    }
}

/// One path to the peers. Implemented by every backend.
///
/// Ranks are world ranks of the link. Sends and receives on the same (peer, tag) match in
/// the order they were issued; different tags are independent.
pub trait Link: Send + Sync + std::fmt::Debug {
    /// Name, speed and the memory the link can touch.
    fn info(&self) -> &LinkInfo;
    /// This process's rank in the link's world.
    fn rank(&self) -> usize;
    /// Number of ranks in the link's world.
    fn size(&self) -> usize;
    /// Sends borrowed bytes; returns once the buffer may be reused.
    fn send(&self, peer: usize, tag: Tag, data: &[u8], deadline: Instant) -> Result<()>;
    /// Sends the concatenation of `parts` as one message (a header and a payload lying in
    /// different places); returns once they may be reused, and whether the link joined them in
    /// a buffer of its own first (a copy). The default joins them; a backend that writes them
    /// from where they lie (TCP: one iovec per part) overrides it.
    fn send_parts(&self, peer: usize, tag: Tag, parts: &[&[u8]], deadline: Instant) -> Result<bool> {
        self.send(peer, tag, &parts.concat(), deadline).map(|()| true)
    }
    /// Starts sending an owned buffer; the handle hands it back when done.
    fn isend(&self, peer: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle>;
    /// Posts a receive; it takes the next message from `peer` on `tag` in issue order.
    fn irecv(&self, peer: usize, tag: Tag) -> Result<RecvHandle>;
    /// Like [`Link::irecv`], but the backend may write the message straight into
    /// `dst..dst+len` (saving a copy); the result's [`RecvBuf::is_landed`] says whether it did.
    /// The default ignores the zone.
    ///
    /// # Safety
    /// As for [`Mailbox::post_into`]: the memory stays valid and untouched by anyone else until
    /// the handle is waited on successfully or dropped, and the handle is never leaked.
    unsafe fn irecv_into(&self, peer: usize, tag: Tag, dst: *mut u8, len: usize) -> Result<RecvHandle> {
        let _ = (dst, len);
        self.irecv(peer, tag)
    }
    /// Makes every pending and future operation on this link fail, here and at every peer
    /// (best effort), with `reason`.
    fn abort(&self, reason: &str);
    /// Like [`Link::abort`], for a failure another link of the same communicator saw first (a
    /// lost or aborting peer): a backend that tells its peers about failures passes `cause` on
    /// as it is, so that every rank names the root cause on every link. The default aborts
    /// with its text.
    fn abort_with(&self, cause: &Error) {
        self.abort(&cause.to_string());
    }
    /// Native collectives, for backends that have them.
    fn native_collectives(&self) -> Option<&dyn NativeCollectives> {
        None
    }
    /// Bytes sent to `peer` that the peer has not acknowledged yet (the kernel's send queues
    /// for TCP), where the backend can tell; `None` otherwise. A send returns once its bytes
    /// are handed over, which can be long before they cross a link with a deep queue: this is
    /// how a caller sharing work between links sees how far behind each really is.
    fn unacked_bytes(&self, peer: usize) -> Option<usize> {
        let _ = peer;
        None
    }
}
