//! Emulated device compute: a rank's accelerator as one queue that an operation occupies for the
//! time a roofline model gives, while the host thread sleeps.
//!
//! Why: the systems ironweave implements were measured on accelerator clusters, where the math
//! runs on the device, the host's cores are mostly idle and the links are the bottleneck. On a
//! machine without accelerators, real math takes the cores that the transport and the checkpoint
//! engine need, so the beds measure the CPU instead of the systems. An emulated device keeps
//! everything else real (collectives carry real byte counts, the state is real memory) and
//! replaces only the math by its duration on a published device ([`Roofline`] from a device
//! profile, `configs/devices/*.toml`).
//!
//! The device is one queue, as a GPU's compute stream is: operations from several threads run one
//! after the other, never at once. Communication does not touch it, so it overlaps compute as it
//! does on a GPU. Sleeping goes through a [`Sleep`]: real time in a run, a recording fake in
//! tests, so the accounting is tested exactly.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ironweave_units::{Locked, Roofline};

/// How the emulated device waits out an operation.
pub trait Sleep: Send + Sync + fmt::Debug {
    /// Blocks the calling thread for `d`.
    fn sleep(&self, d: Duration);
}

/// Real time: `std::thread::sleep`, with what the OS overslept taken off the next operation, so
/// that over an iteration the device is busy for the model's time and not the model's time plus
/// one scheduler wake-up per operation.
#[derive(Debug, Default)]
pub struct ThreadSleep {
    overslept: Mutex<Duration>,
}

impl Sleep for ThreadSleep {
    fn sleep(&self, d: Duration) {
        let mut debt = self.overslept.locked();
        let want = d.saturating_sub(*debt);
        *debt = debt.saturating_sub(d);
        if want.is_zero() {
            return;
        }
        let t0 = Instant::now();
        std::thread::sleep(want);
        *debt += t0.elapsed().saturating_sub(want);
    }
}

/// One rank's emulated accelerator.
#[derive(Debug)]
pub struct EmulatedDevice {
    name: String,
    model: Roofline,
    sleep: Arc<dyn Sleep>,
    /// The queue: one operation at a time.
    queue: Mutex<()>,
    busy_ns: AtomicU64,
    ops: AtomicU64,
}

impl EmulatedDevice {
    /// A device named `name` (for reports) with the speed `model`, sleeping in real time.
    pub fn new(name: impl Into<String>, model: Roofline) -> EmulatedDevice {
        EmulatedDevice::with_sleep(name, model, Arc::new(ThreadSleep::default()))
    }

    /// The same, waiting through `sleep` (tests pass a fake that records).
    pub fn with_sleep(name: impl Into<String>, model: Roofline, sleep: Arc<dyn Sleep>) -> EmulatedDevice {
        EmulatedDevice {
            name: name.into(),
            model,
            sleep,
            queue: Mutex::new(()),
            busy_ns: AtomicU64::new(0),
            ops: AtomicU64::new(0),
        }
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's speed.
    pub fn model(&self) -> Roofline {
        self.model
    }

    /// What an operation of `flops` moving `bytes` occupies the device for.
    pub fn duration(&self, flops: f64, bytes: f64) -> Duration {
        Duration::from_secs_f64(self.model.seconds(flops, bytes).max(0.0))
    }

    /// Runs one operation: waits for the operations queued before it, then occupies the
    /// device (the calling thread sleeps) for the model's time. Returns that time.
    pub fn run(&self, flops: f64, bytes: f64) -> Duration {
        let d = self.duration(flops, bytes);
        let _turn = self.queue.locked();
        self.sleep.sleep(d);
        self.busy_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.ops.fetch_add(1, Ordering::Relaxed);
        d
    }

    /// The modelled time the device has been busy, and the operations it ran, since it was made
    /// or last taken; resets both (one iteration's device-busy share is this over its wall time).
    pub fn take_busy(&self) -> (Duration, u64) {
        let _turn = self.queue.locked();
        (Duration::from_nanos(self.busy_ns.swap(0, Ordering::Relaxed)), self.ops.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Records every sleep and fails if two overlap.
    #[derive(Debug, Default)]
    struct Recorder {
        slept: Mutex<Vec<Duration>>,
        inside: AtomicBool,
    }

    impl Sleep for Recorder {
        fn sleep(&self, d: Duration) {
            assert!(!self.inside.swap(true, Ordering::SeqCst), "two operations on one device at once");
            std::thread::yield_now();
            self.slept.locked().push(d);
            self.inside.store(false, Ordering::SeqCst);
        }
    }

    const H100: Roofline = Roofline { flops_per_s: 989e12 * 0.5, bytes_per_s: Some(3350e9) };

    #[test]
    fn the_device_is_busy_for_exactly_the_models_time() {
        let rec = Arc::new(Recorder::default());
        let dev = EmulatedDevice::with_sleep("h100", H100, rec.clone());
        // a compute-bound matmul, a memory-bound elementwise op, nothing
        let ops = [(2.0 * 4096.0 * 4096.0 * 4096.0, 3.0 * 4096.0 * 4096.0 * 2.0), (1e6, 1e9), (0.0, 0.0)];
        let mut want = Duration::ZERO;
        for (f, b) in ops {
            want += dev.run(f, b);
        }
        // the roofline: the matmul by its FLOPs, the elementwise op by its bytes
        assert_eq!(dev.duration(ops[0].0, ops[0].1), Duration::from_secs_f64(ops[0].0 / (989e12 * 0.5)));
        assert_eq!(dev.duration(ops[1].0, ops[1].1), Duration::from_secs_f64(1e9 / 3350e9));
        assert_eq!(*rec.slept.locked(), ops.iter().map(|&(f, b)| dev.duration(f, b)).collect::<Vec<_>>());
        assert_eq!(dev.take_busy(), (want, 3));
        assert_eq!(dev.take_busy(), (Duration::ZERO, 0), "taking resets");
    }

    #[test]
    fn operations_from_several_threads_queue_one_after_the_other() {
        let rec = Arc::new(Recorder::default());
        let dev = Arc::new(EmulatedDevice::with_sleep("h100", H100, rec.clone()));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let dev = dev.clone();
                std::thread::spawn(move || (0..200).map(|i| dev.run(1e9 * f64::from(i), 0.0)).sum::<Duration>())
            })
            .collect();
        let total: Duration = threads.into_iter().map(|t| t.join().expect("no overlap")).sum();
        assert_eq!(rec.slept.locked().len(), 800);
        assert_eq!(dev.take_busy(), (total, 800));
    }

    #[test]
    fn real_sleep_pays_back_what_it_overslept() {
        let s = ThreadSleep::default();
        *s.overslept.locked() = Duration::from_millis(5);
        // owed more than asked: returns at once and keeps the rest of the debt
        s.sleep(Duration::from_millis(2));
        assert_eq!(*s.overslept.locked(), Duration::from_millis(3));
    }
}
