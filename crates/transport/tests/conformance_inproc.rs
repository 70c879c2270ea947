//! The conformance suite on the in-process backend.

use ironweave_transport::{inproc, CommOptions, Communicator};
use std::time::Duration;

fn make(n: usize) -> Vec<Communicator> {
    let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
    inproc::world(n).into_iter().map(|l| Communicator::new(vec![l], opts.clone()).unwrap()).collect()
}

ironweave_transport::conformance_suite!(make);

#[test]
fn device_buffers_need_a_backend_that_can_touch_them() {
    use ironweave_transport::{Buf, BufMut, DType, DeviceSlice, Error, ReduceOp};
    let c = make(1).pop().unwrap();
    let dev = DeviceSlice { ptr: 0x1000, len: 64, device: 0 };
    let host = [0u8; 64];
    let errs = [
        c.all_reduce_buf(BufMut::Device(dev), DType::F32, ReduceOp::Sum).unwrap_err(),
        c.broadcast_buf(BufMut::Device(dev), 0).unwrap_err(),
        c.all_gather_buf(Buf::Host(&host), BufMut::Device(dev)).unwrap_err(),
        c.reduce_scatter_buf(Buf::Device(dev), BufMut::Device(dev), DType::F32, ReduceOp::Sum).unwrap_err(),
    ];
    for e in errs {
        assert!(matches!(e, Error::UnsupportedMemory { .. }), "{e}");
    }
}

mod native {
    //! A backend that declares native collectives gets device buffers; host buffers still take
    //! the point-to-point algorithms.
    use ironweave_transport::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    #[derive(Debug)]
    struct WithNative {
        inner: Arc<dyn Link>,
        calls: AtomicUsize,
    }

    impl NativeCollectives for WithNative {
        fn all_reduce(&self, buf: BufMut<'_>, _: DType, _: ReduceOp) -> Result<()> {
            assert!(matches!(buf, BufMut::Device(_)));
            self.calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn broadcast(&self, _: BufMut<'_>, _: usize) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn all_gather(&self, _: Buf<'_>, _: BufMut<'_>) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn reduce_scatter(&self, _: Buf<'_>, _: BufMut<'_>, _: DType, _: ReduceOp) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    impl Link for WithNative {
        fn info(&self) -> &LinkInfo {
            self.inner.info()
        }
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn size(&self) -> usize {
            self.inner.size()
        }
        fn send(&self, p: usize, t: Tag, d: &[u8], dl: Instant) -> Result<()> {
            self.inner.send(p, t, d, dl)
        }
        fn isend(&self, p: usize, t: Tag, d: Vec<u8>) -> Result<SendHandle> {
            self.inner.isend(p, t, d)
        }
        fn irecv(&self, p: usize, t: Tag) -> Result<RecvHandle> {
            self.inner.irecv(p, t)
        }
        fn abort(&self, r: &str) {
            self.inner.abort(r)
        }
        fn native_collectives(&self) -> Option<&dyn NativeCollectives> {
            Some(self)
        }
    }

    #[test]
    fn device_buffers_go_to_native_collectives() {
        let link = Arc::new(WithNative { inner: inproc::world(1).pop().unwrap(), calls: AtomicUsize::new(0) });
        let c = Communicator::new(vec![link.clone() as Arc<dyn Link>], CommOptions::default()).unwrap();
        let dev = DeviceSlice { ptr: 0x1000, len: 64, device: 0 };
        c.all_reduce_buf(BufMut::Device(dev), DType::F32, ReduceOp::Sum).unwrap();
        c.broadcast_buf(BufMut::Device(dev), 0).unwrap();
        c.all_gather_buf(Buf::Device(dev), BufMut::Device(dev)).unwrap();
        c.reduce_scatter_buf(Buf::Device(dev), BufMut::Device(dev), DType::F32, ReduceOp::Sum).unwrap();
        assert_eq!(link.calls.load(Ordering::SeqCst), 4);
        let mut host = vec![1.0f32; 16];
        c.all_reduce(&mut host, ReduceOp::Sum).unwrap();
        assert_eq!(link.calls.load(Ordering::SeqCst), 4, "host buffers take the point-to-point path");
    }
}

/// The same contract on a striped communicator over two in-process links (70% / 30%).
mod striped {
    use ironweave_transport::testing::{self, Case};
    use ironweave_transport::{inproc, CommOptions, Communicator, Link, LinkInfo, RecvHandle, ReduceOp, Result, SendHandle, Tag};
    use std::time::{Duration, Instant};

    fn make(n: usize) -> Vec<Communicator> {
        let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
        let (a, b) = (inproc::world(n), inproc::world(n));
        a.into_iter()
            .zip(b)
            .map(|(la, lb)| Communicator::new(vec![la, lb], opts.clone()).unwrap().striped(Some(vec![0.7, 0.3])).unwrap())
            .collect()
    }

    ironweave_transport::conformance_suite!(make);

    #[test]
    fn counts_split_exactly_and_bad_fractions_are_refused() {
        let c = make(1).pop().unwrap();
        for n in [0usize, 1, 2, 3, 10, 1001] {
            let parts = c.stripe_counts(n);
            assert_eq!(parts.iter().sum::<usize>(), n);
            assert!(parts[0] >= parts[1]);
        }
        assert_eq!(c.stripe_counts(10), vec![7, 3]);
        let plain = Communicator::new(inproc::world(1), CommOptions::default()).unwrap();
        assert!(plain.striped(Some(vec![0.5, 0.5])).is_err(), "one link, two fractions");
        let two =
            Communicator::new(vec![inproc::world(1).pop().unwrap(), inproc::world(1).pop().unwrap()], CommOptions::default())
                .unwrap();
        assert!(two.striped(Some(vec![-1.0, 2.0])).is_err());
        assert!(two.striped(Some(vec![0.0, 0.0])).is_err());
        assert_eq!(two.striped(None).unwrap().stripe_fractions(), Some(&[0.5, 0.5][..]));
    }

    /// Link 1 of every rank, with each send held up by `delay` (a slow or busy link).
    #[derive(Debug)]
    struct Slow {
        inner: std::sync::Arc<dyn Link>,
        delay: Duration,
    }

    impl Link for Slow {
        fn info(&self) -> &LinkInfo {
            self.inner.info()
        }
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn size(&self) -> usize {
            self.inner.size()
        }
        fn send(&self, peer: usize, tag: Tag, data: &[u8], deadline: Instant) -> Result<()> {
            std::thread::sleep(self.delay);
            self.inner.send(peer, tag, data, deadline)
        }
        fn isend(&self, peer: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle> {
            std::thread::sleep(self.delay);
            self.inner.isend(peer, tag, data)
        }
        fn irecv(&self, peer: usize, tag: Tag) -> Result<RecvHandle> {
            self.inner.irecv(peer, tag)
        }
        fn abort(&self, reason: &str) {
            self.inner.abort(reason)
        }
    }

    /// Two ranks over a fast link 0 and a link 1 whose sends each take `delay`, split 50/50.
    fn lopsided(delay: Duration) -> Vec<Communicator> {
        let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
        inproc::world(2)
            .into_iter()
            .zip(inproc::world(2))
            .map(|(fast, slow)| {
                let slow: std::sync::Arc<dyn Link> = std::sync::Arc::new(Slow { inner: slow, delay });
                Communicator::new(vec![fast, slow], opts.clone()).unwrap().striped(Some(vec![0.5, 0.5])).unwrap()
            })
            .collect()
    }

    /// Runs an all-gather and a reduce-scatter of 4 MiB on every rank; returns each rank's bytes
    /// sent per link.
    fn gather_and_reduce(comms: Vec<Communicator>) -> Vec<Vec<u64>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let n = 1 << 20; // f32 elements: 4 MiB
                        for (case, salt) in [(Case::AllGather, 11), (Case::ReduceScatter, 12)] {
                            testing::check_collective::<f32>(&c, case, n, ReduceOp::Sum, salt, true).unwrap();
                        }
                        c.stripe_bytes_sent().unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn a_slow_link_carries_less_of_a_dynamic_split_and_exactly_its_fraction_of_a_static_one() {
        // Each send on link 1 takes 5 ms; one on link 0 takes microseconds. Link 0 should take
        // most of the 2 x 64 segments of each block (a static split would give link 1 half).
        let dynamic = gather_and_reduce(lopsided(Duration::from_millis(5)));
        for (r, sent) in dynamic.iter().enumerate() {
            let total = (sent[0] + sent[1]) as f64;
            assert_eq!(total, 2.0 * 2.0 * (1 << 20) as f64, "rank {r}: every byte of both collectives counted once: {sent:?}");
            assert!((sent[1] as f64) < 0.25 * total, "rank {r}: the slow link carried {sent:?}");
        }
        // The static split puts exactly half on each link, however slow.
        let fixed = gather_and_reduce(lopsided(Duration::from_millis(1)).into_iter().map(|c| c.with_static_split()).collect());
        for sent in fixed {
            assert_eq!(sent, vec![2 << 20, 2 << 20]);
        }
    }

    #[test]
    fn the_static_split_gathers_and_reduces_on_three_ranks() {
        let comms: Vec<Communicator> = make(3).into_iter().map(|c| c.with_static_split()).collect();
        assert!(comms.iter().all(|c| !c.stripe_is_dynamic()));
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    for (case, salt) in [(Case::AllGather, 5), (Case::ReduceScatter, 6)] {
                        for n in [(1 << 18) + 3, 3 << 18] {
                            testing::check_collective::<f32>(c, case, n, ReduceOp::Sum, salt, true).unwrap();
                            testing::check_collective::<i64>(c, case, n, ReduceOp::Max, salt, true).unwrap();
                        }
                    }
                });
            }
        });
    }
}
