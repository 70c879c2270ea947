//! Non-blocking collectives: `iall_reduce`, `iall_gather`, `ireduce_scatter`, `ibroadcast`.
//!
//! Each takes its buffer by value and returns a [`CollHandle`] that hands the result back. The
//! operations run, in the order they were issued, on the communicator's collective thread —
//! started on first use, over a [`Communicator::dup`] of the group, so they never mix with the
//! caller's blocking calls and every rank runs them in the same order. The caller computes
//! meanwhile; several operations can be in flight and their handles waited on in any order.
//! Owned buffers (not borrowed ones) are what make this safe: a handle dropped early cannot
//! leave the thread writing into freed memory. Every wait is bounded: by the communicator's
//! timeout for each operation queued ahead and for this one. Dropping the communicator waits
//! (bounded the same way) for the thread to finish its queue and drop its `dup`: the link's
//! goodbye is then sent before the process can exit, so peers never see a closed connection
//! without one.

use ironweave_units::Locked;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Communicator;
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::link::Filled;

type Job = Box<dyn FnOnce(&Communicator) + Send>;

/// The collective thread of one communicator.
pub(crate) struct CollExecutor {
    /// `None` once dropping began (closing the queue ends the thread's loop).
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    /// Operations issued and not finished (to bound waits).
    pending: Arc<AtomicUsize>,
    /// The communicator's timeout: how long each queued operation may take.
    timeout: Duration,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CollExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollExecutor").field("pending", &self.pending.load(Ordering::Relaxed)).finish()
    }
}

impl CollExecutor {
    /// Starts the thread on `comm` (a dup of the communicator it serves). The thread ends when
    /// the communicator (and so the sender) is dropped and the queue is drained.
    pub(crate) fn start(comm: Communicator) -> Result<CollExecutor> {
        let (tx, rx) = mpsc::channel::<Job>();
        let timeout = comm.options().timeout;
        let thread = std::thread::Builder::new()
            .name(format!("iw-coll-{}", comm.rank()))
            .spawn(move || {
                for job in rx {
                    job(&comm);
                }
            })
            .map_err(|e| Error::io("starting the collective thread", &e))?;
        Ok(CollExecutor { tx: Mutex::new(Some(tx)), pending: Arc::new(AtomicUsize::new(0)), timeout, thread: Some(thread) })
    }

    /// Queues `f`; its result lands in the returned handle.
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&Communicator) -> Result<R> + Send + 'static,
    ) -> Result<CollHandle<R>> {
        let slot: Arc<Slot<R>> = Arc::new(Filled::default());
        let ahead = self.pending.fetch_add(1, Ordering::SeqCst);
        // each operation ahead, and this one, ends within the communicator's timeout (plus a
        // margin for the abort that a failed operation sends)
        let bound = timeout.saturating_mul(ahead as u32 + 1) + Duration::from_secs(5);
        let (done, pending) = (slot.clone(), self.pending.clone());
        let job: Job = Box::new(move |c| {
            let started = Instant::now();
            let r = f(c).map(|v| (v, started, Instant::now()));
            pending.fetch_sub(1, Ordering::SeqCst);
            done.fill(r);
        });
        let sent = self.tx.locked().as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Aborted { reason: "the collective thread has stopped".into() });
        }
        Ok(CollHandle { slot, bound: Instant::now() + bound })
    }
}

impl Drop for CollExecutor {
    /// Closes the queue and waits for the thread to run what is queued and drop its `dup` of
    /// the communicator. Without this the thread could hold the last reference to the links
    /// while the process exits, and the peers would see the connections close without a
    /// goodbye (a lost peer) after a job that succeeded.
    fn drop(&mut self) {
        self.tx.locked().take();
        let Some(thread) = self.thread.take() else { return };
        // dropped by a job on the thread itself: it cannot wait for itself
        if thread.thread().id() == std::thread::current().id() {
            return;
        }
        let queued = self.pending.load(Ordering::SeqCst) as u32;
        crate::link::join_until(thread, Instant::now() + self.timeout.saturating_mul(queued) + Duration::from_secs(5));
    }
}

/// The result with when the collective thread started and finished the operation.
type Slot<R> = Filled<(R, Instant, Instant)>;

/// The result of a non-blocking collective, to wait for. Dropping it does not cancel the
/// operation (every rank must still run it); its result is then discarded.
pub struct CollHandle<R> {
    slot: Arc<Slot<R>>,
    /// When the operation must have ended (see the module docs).
    bound: Instant,
}

impl<R> std::fmt::Debug for CollHandle<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollHandle").field("done", &self.test()).finish()
    }
}

impl<R> CollHandle<R> {
    /// Whether the operation has finished (successfully or not).
    pub fn test(&self) -> bool {
        self.slot.is_filled()
    }

    /// Waits for the result; bounded by the communicator's timeout per operation queued.
    pub fn wait(self) -> Result<R> {
        let bound = self.bound;
        self.wait_until(bound)
    }

    /// Waits until `deadline` at the latest: `Timeout` if the operation has not finished by
    /// then (it still runs; its result is discarded).
    pub fn wait_until(self, deadline: Instant) -> Result<R> {
        self.wait_timed(deadline).map(|(r, _, _)| r)
    }

    /// [`CollHandle::wait_until`], also returning when the collective thread started and
    /// finished the operation (what an overlap schedule measures: the time on the wire, not
    /// the time the caller waited).
    pub fn wait_timed(self, deadline: Instant) -> Result<(R, Instant, Instant)> {
        self.slot.take(deadline, "a non-blocking collective")
    }

    /// When the operation must have ended: the communicator's timeout for each operation
    /// queued ahead of it and for itself.
    pub fn deadline(&self) -> Instant {
        self.bound
    }
}

impl Communicator {
    /// The collective thread, started once (the one initializer takes the `dup`, so every rank
    /// derives the same tag space however many threads call this at once).
    fn executor(&self) -> Result<&CollExecutor> {
        self.nb.get_or_init(|| CollExecutor::start(self.dup())).as_ref().map_err(Clone::clone)
    }

    /// Starts an all-reduce of `buf`; the handle returns the reduced buffer.
    pub fn iall_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Result<CollHandle<Vec<T>>> {
        self.executor()?.submit(self.options().timeout, move |c| {
            c.all_reduce(&mut buf, op)?;
            Ok(buf)
        })
    }

    /// Starts an all-gather of `input`; the handle returns every rank's input, in rank order.
    pub fn iall_gather<T: Element>(&self, input: Vec<T>) -> Result<CollHandle<Vec<T>>> {
        let n = self.size();
        self.executor()?.submit(self.options().timeout, move |c| {
            let mut out = vec![T::zeroed(); input.len() * n];
            c.all_gather(&input, &mut out)?;
            Ok(out)
        })
    }

    /// Starts a reduce-scatter of `input` (a multiple of the group size); the handle returns
    /// this rank's reduced block.
    pub fn ireduce_scatter<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Result<CollHandle<Vec<T>>> {
        let n = self.size();
        if input.len() % n != 0 {
            return Err(Error::InvalidArgument(format!(
                "ireduce_scatter: {} elements do not split into {n} equal blocks",
                input.len()
            )));
        }
        self.executor()?.submit(self.options().timeout, move |c| {
            let mut out = vec![T::zeroed(); input.len() / n];
            c.reduce_scatter(&input, &mut out, op)?;
            Ok(out)
        })
    }

    /// Starts a broadcast from group rank `root`; the handle returns the root's buffer.
    pub fn ibroadcast<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Result<CollHandle<Vec<T>>> {
        if root >= self.size() {
            return Err(Error::RankOutOfRange { rank: root, size: self.size() });
        }
        self.executor()?.submit(self.options().timeout, move |c| {
            c.broadcast(&mut buf, root)?;
            Ok(buf)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{inproc, CommOptions};

    /// Dropping a communicator whose collective thread is busy waits for the thread, so the
    /// links are released (and a socket link's goodbye sent) before the drop returns. Before,
    /// the thread's `dup` could hold the last reference while the process exited.
    #[test]
    fn dropping_the_communicator_releases_the_links_before_it_returns() {
        let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
        let c = Communicator::new(inproc::world(1).pop().into_iter().collect(), opts).unwrap();
        let links = Arc::downgrade(&c.links);
        let h = c.executor().unwrap().submit(c.options().timeout, |_| {
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        });
        drop(h);
        drop(c);
        assert!(links.upgrade().is_none(), "the collective thread still holds the links after the communicator was dropped");
    }

    /// A job that drops the last reference to its communicator ends its thread without
    /// waiting for itself.
    #[test]
    fn the_last_reference_dropped_on_the_collective_thread_does_not_wait_for_itself() {
        let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
        let c = Arc::new(Communicator::new(inproc::world(1).pop().into_iter().collect(), opts).unwrap());
        let links = Arc::downgrade(&c.links);
        let (tx, rx) = mpsc::channel();
        let mine = c.clone();
        let h = c.iall_reduce(vec![1.0f32], ReduceOp::Sum).unwrap();
        c.executor()
            .unwrap()
            .submit(Duration::from_secs(60), move |_| {
                // hold the communicator until the caller has let go of its own reference
                rx.recv().unwrap();
                drop(mine);
                Ok(())
            })
            .unwrap();
        assert_eq!(h.wait().unwrap(), vec![1.0]);
        drop(c);
        let t0 = Instant::now();
        tx.send(()).unwrap();
        while links.upgrade().is_some() {
            assert!(t0.elapsed() < Duration::from_secs(10), "the collective thread waited for itself");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
