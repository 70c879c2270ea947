//! # ironweave-transport
//!
//! The API every ironweave backend implements and every other ironweave crate uses.
//!
//! - A [`Link`] is one path to the peers (a NIC, shared memory, an NCCL communicator): it moves
//!   tagged bytes point to point and says its name, speed and which memory it can touch.
//! - A [`Communicator`] is one rank's view of a group over one or more links: point-to-point,
//!   collectives written once over point-to-point (ring for large messages, recursive doubling
//!   or trees for small ones), and [`Communicator::split`] for tensor-, data- and
//!   expert-parallel sub-groups.
//! - [`rendezvous`] reads the job from the environment (ironweave, torchrun, SLURM, OpenMPI)
//!   and exchanges addresses through rank 0.
//! - [`shm`] is the intra-host path: collectives between ranks on one host through one shared
//!   segment, set up by the TCP backend when the whole job is on one host.
//! - [`inproc`] is a backend of threads and channels for fast tests of the algorithms.
//!
//! Backends live in their own crates (`ironweave-tcp`, ...). Every blocking call has a
//! deadline ([`CommOptions::timeout`], default 300 s, `IRONWEAVE_TIMEOUT_S`), and every
//! failure is an [`Error`] that says what to do.
//!
//! ```
//! use ironweave_transport::{inproc, CommOptions, Communicator, ReduceOp};
//! let comms: Vec<Communicator> = inproc::world(3)
//!     .into_iter()
//!     .map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap())
//!     .collect();
//! std::thread::scope(|s| {
//!     for c in &comms {
//!         s.spawn(move || {
//!             let mut v = vec![c.rank() as f32 + 1.0; 4];
//!             c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
//!             assert_eq!(v, vec![6.0; 4]);
//!         });
//!     }
//! });
//! ```

pub mod board;
mod comm;
mod dtype;
mod error;
pub mod handshake;
pub mod inproc;
mod link;
pub mod probe;
pub mod rendezvous;
pub mod shm;
pub mod testing;
pub mod threads;
pub mod wire;

pub use comm::CollHandle;
pub use comm::{unique_job_id, CommOptions, Communicator, DEFAULT_TIMEOUT, MAX_USER_TAG};
pub use dtype::{finish_avg, reduce_into, DType, Element, ReduceOp};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use link::set_background_thread;
pub use link::{
    join_until, wait_blocking_send, Buf, BufMut, DeviceSlice, Link, LinkInfo, Mailbox, MemKind, NativeCollectives, PendingSend,
    Progress, RecvBuf, RecvHandle, SendCompleter, SendHandle, SeqTable, SpeedSource, Tag, PROGRESS_SPIN,
};
