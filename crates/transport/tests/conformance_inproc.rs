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
    use ironweave_transport::{inproc, CommOptions, Communicator};
    use std::time::Duration;

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
}
