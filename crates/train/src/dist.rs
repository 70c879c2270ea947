//! Expert and data parallelism over an ironweave `Communicator`: expert `e` lives on rank
//! `e mod world`; tokens travel to their experts and back with `all_to_all_v`; dense gradients
//! are averaged with one all-reduce. Every exchange is recorded in the profiler as training
//! communication on link 0, which is what the checkpoint engine schedules around.

use std::sync::Arc;

use ironweave_profile::{CommKind, MonotonicClock, Profiler};
use ironweave_transport::{Communicator, ReduceOp};

use crate::error::Result;

/// This rank's place in the job.
#[derive(Debug, Clone)]
pub struct Dist {
    /// The world.
    pub comm: Arc<Communicator>,
    /// Profiler to record communication in (optional).
    pub prof: Option<Arc<Profiler<MonotonicClock>>>,
}

impl Dist {
    /// Rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// World size.
    pub fn world(&self) -> usize {
        self.comm.size()
    }

    /// Exchange rows of `width` floats: `send` holds `send_rows[d]` rows for each rank `d` in
    /// order; returns what every rank sent here, in rank order, given `recv_rows`.
    pub fn exchange(&self, send: &[f32], send_rows: &[usize], recv_rows: &[usize], width: usize) -> Result<Vec<f32>> {
        let sc: Vec<usize> = send_rows.iter().map(|r| r * width).collect();
        let rc: Vec<usize> = recv_rows.iter().map(|r| r * width).collect();
        let mut out = vec![0f32; rc.iter().sum()];
        let _t = self.prof.as_ref().map(|p| p.comm(0, CommKind::Training, (send.len() * 4) as u64));
        self.comm.all_to_all_v(send, &sc, &mut out, &rc)?;
        Ok(out)
    }

    /// Exchange a fixed number of counts with every rank.
    pub fn exchange_counts(&self, send: &[i64]) -> Result<Vec<i64>> {
        let mut out = vec![0i64; send.len()];
        // small, but it is training traffic on the link: a checkpoint chunk sent across it is
        // not in a window
        let _t = self.prof.as_ref().map(|p| p.comm(0, CommKind::Training, (send.len() * 8) as u64));
        self.comm.all_to_all(send, &mut out)?;
        Ok(out)
    }

    /// Average `buf` over all ranks.
    pub fn all_reduce_avg(&self, buf: &mut [f32]) -> Result<()> {
        let _t = self.prof.as_ref().map(|p| p.comm(0, CommKind::Training, (buf.len() * 4) as u64));
        self.comm.all_reduce(buf, ReduceOp::Avg)?;
        Ok(())
    }
}
