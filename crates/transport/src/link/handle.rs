//! Send completion: the handles of a non-blocking send ([`SendHandle`], [`SendCompleter`]), a
//! send's owned or borrowed payload ([`PendingSend`]), and the bounded waits on them.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use ironweave_units::Locked;

use crate::error::{Error, Result};

/// Completion of a non-blocking send. Dropping it does not cancel the send.
#[derive(Debug, Clone)]
pub struct SendHandle {
    inner: Arc<Filled<Vec<u8>>>,
}

/// A result filled once by one thread and taken by another, which may sleep for it. Filling
/// wakes the taker only if it sleeps: a condition variable's notify is a system call even when
/// nobody waits, and most results here are filled before anyone looks.
#[derive(Debug)]
pub(crate) struct Filled<R> {
    /// The result, and how many threads sleep for it.
    slot: Mutex<(Option<Result<R>>, usize)>,
    cv: Condvar,
}

impl<R> Default for Filled<R> {
    fn default() -> Self {
        Filled { slot: Mutex::new((None, 0)), cv: Condvar::new() }
    }
}

impl<R> Filled<R> {
    /// Fills the slot and wakes a sleeping taker.
    pub(crate) fn fill(&self, r: Result<R>) {
        let mut g = self.slot.locked();
        g.0 = Some(r);
        let sleeping = g.1 > 0;
        drop(g);
        if sleeping {
            self.cv.notify_all();
        }
    }

    pub(crate) fn is_filled(&self) -> bool {
        self.slot.locked().0.is_some()
    }

    /// Takes the result once filled, or `Timeout` naming `what` when `deadline` passes first.
    pub(crate) fn take(&self, deadline: Instant, what: &str) -> Result<R> {
        let mut g = self.slot.locked();
        if let Some(r) = g.0.take() {
            return r;
        }
        let start = Instant::now();
        loop {
            if let Some(r) = g.0.take() {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { what: what.into(), after: now - start });
            }
            g.1 += 1;
            g = self.cv.wait_timeout(g, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
            g.1 -= 1;
        }
    }
}

/// The producer side of a [`SendHandle`], held by the backend's progress thread.
#[derive(Debug)]
pub struct SendCompleter {
    inner: Arc<Filled<Vec<u8>>>,
}

impl SendCompleter {
    /// Completes the send, handing the buffer (or the error) to the waiter.
    pub fn complete(self, result: Result<Vec<u8>>) {
        self.inner.fill(result);
    }
}

impl SendHandle {
    /// A handle that is already complete.
    pub fn ready(result: Result<Vec<u8>>) -> Self {
        let inner = Arc::new(Filled::default());
        inner.fill(result);
        SendHandle { inner }
    }

    /// A pending handle and the completer that finishes it.
    pub fn pending() -> (SendHandle, SendCompleter) {
        let inner = Arc::new(Filled::default());
        (SendHandle { inner: inner.clone() }, SendCompleter { inner })
    }

    /// True once the send finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.inner.is_filled()
    }

    /// Waits for the send and returns the buffer.
    pub fn wait(self, deadline: Instant) -> Result<Vec<u8>> {
        self.inner.take(deadline, "send")
    }
}

enum Payload {
    Owned(Vec<u8>),
    Borrowed(*const u8, usize),
}

/// A send a caller hands to a backend's progress thread: the bytes (owned, or borrowed from a
/// caller that blocks until completion) and the completer of the caller's [`SendHandle`].
/// Dropping it unfinished completes the handle with an error, so no caller waits for a send
/// that a closing backend discarded.
#[derive(Debug)]
pub struct PendingSend {
    data: Payload,
    done: Option<SendCompleter>,
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Payload::Owned(v) => write!(f, "Owned({} bytes)", v.len()),
            Payload::Borrowed(_, n) => write!(f, "Borrowed({n} bytes)"),
        }
    }
}

// SAFETY: the only non-Send part is the pointer of a borrowed send, whose caller blocks until
// the send completes (see `PendingSend::borrowed`).

unsafe impl Send for PendingSend {}

impl PendingSend {
    /// A send of an owned buffer (returned through the handle when done).
    pub fn owned(data: Vec<u8>) -> (PendingSend, SendHandle) {
        let (h, c) = SendHandle::pending();
        (PendingSend { data: Payload::Owned(data), done: Some(c) }, h)
    }

    /// A send of borrowed bytes.
    ///
    /// # Safety
    /// `data` must stay valid and unchanged until the handle completes: the caller waits for it
    /// (and, on a deadline, aborts the link and waits again, see [`wait_blocking_send`]).
    pub unsafe fn borrowed(data: &[u8]) -> (PendingSend, SendHandle) {
        let (h, c) = SendHandle::pending();
        (PendingSend { data: Payload::Borrowed(data.as_ptr(), data.len()), done: Some(c) }, h)
    }

    /// A send nobody waits for (control messages).
    pub fn detached(data: Vec<u8>) -> PendingSend {
        PendingSend { data: Payload::Owned(data), done: None }
    }

    /// The bytes to send.
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            Payload::Owned(v) => v,
            // SAFETY: valid until completion by `borrowed`'s contract; completion consumes self.
            Payload::Borrowed(p, n) => unsafe { std::slice::from_raw_parts(*p, *n) },
        }
    }

    /// Completes the caller's handle (owned buffers go back to it).
    pub fn finish(mut self, result: Result<()>) {
        if let Some(c) = self.done.take() {
            let data = std::mem::replace(&mut self.data, Payload::Owned(Vec::new()));
            c.complete(result.map(|()| match data {
                Payload::Owned(v) => v,
                Payload::Borrowed(..) => Vec::new(),
            }));
        }
    }
}

impl Drop for PendingSend {
    fn drop(&mut self) {
        if let Some(c) = self.done.take() {
            c.complete(Err(Error::Aborted { reason: "the link closed before the send was issued".into() }));
        }
    }
}

/// Joins a backend's thread if it finishes by `until` (polling; a thread stuck in a driver
/// call is left behind rather than hanging the caller).
pub fn join_until(t: std::thread::JoinHandle<()>, until: Instant) {
    while !t.is_finished() && Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    if t.is_finished() {
        let _ = t.join();
    }
}

/// Waits for a blocking send handed to a progress thread. On the deadline it aborts the link
/// (`abort`), which makes the backend cancel the send, and waits (up to `grace` more) for the
/// backend to let go of the caller's bytes before reporting the timeout.
pub fn wait_blocking_send(h: SendHandle, deadline: Instant, grace: std::time::Duration, abort: impl FnOnce()) -> Result<()> {
    match h.clone().wait(deadline) {
        Ok(_) => Ok(()),
        Err(e @ Error::Timeout { .. }) => {
            abort();
            let _ = h.wait(Instant::now() + grace);
            Err(e)
        }
        Err(e) => Err(e),
    }
}
