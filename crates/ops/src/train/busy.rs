//! The counters that show an emulated bed is bound by its links, not by this machine's cores:
//! each rank's device-busy share and the whole machine's CPU busy share over the steady
//! iterations (after two warm-up ones). One meter for every training workload (MoE, sharded,
//! tensor parallel), so their reports say the same thing the same way.

use ironweave_train::emulated::Emulated;
use ironweave_transport::{Communicator, ReduceOp};

use crate::error::Result;

/// Iterations before the steady ones.
const WARM_UP: u64 = 2;

/// One rank's meter; [`BusyMeter::iteration`] after each iteration, [`BusyMeter::finish`] once.
#[derive(Debug, Default)]
pub struct BusyMeter {
    /// Emulated compute, the steady iterations: device-busy and wall seconds.
    device: (f64, f64),
    /// Rank 0: the machine's CPU ticks at the end of the warm-up.
    cpu_mark: Option<(u64, u64)>,
    /// Rank 0: the machine's busy share over the steady iterations so far.
    cpu_share: Option<f64>,
    /// Emulated compute, the steady iterations: the compute lane's seconds beyond the device's
    /// (host work in real time), and the iterations counted.
    host: (f64, u64),
}

impl BusyMeter {
    /// Records iteration `iter` (1-based) of `dt` seconds on rank `rank`, whose compute lane
    /// was busy `compute_s` seconds (where the workload times it); returns the seconds the
    /// device was busy in it (None: real compute). Takes the device's count, so call it once
    /// per iteration.
    pub fn iteration(&mut self, emu: Option<&Emulated>, iter: u64, dt: f64, rank: usize, compute_s: Option<f64>) -> Option<f64> {
        let busy = emu.map(|e| e.device.take_busy().0.as_secs_f64());
        if let (Some(b), true) = (busy, iter > WARM_UP) {
            self.device.0 += b;
            self.device.1 += dt;
            if let Some(c) = compute_s {
                self.host.0 += (c - b).max(0.0);
                self.host.1 += 1;
            }
        }
        // a restarted rank 0 measures from its own third iteration on
        if rank == 0 {
            if iter == WARM_UP {
                self.cpu_mark = crate::rundir::machine_cpu_ticks();
            } else if let (Some((b0, t0)), Some((b1, t1))) = (self.cpu_mark, crate::rundir::machine_cpu_ticks()) {
                self.cpu_share = (t1 > t0).then(|| (b1 - b0) as f64 / (t1 - t0) as f64);
            }
        }
        busy
    }

    /// Every rank's device-busy share (empty under real compute; collective: every rank
    /// calls it) and, on rank 0, the machine's CPU busy share.
    pub fn finish(&self, comm: &Communicator, emulated: bool) -> Result<(Vec<f64>, Option<f64>)> {
        if !emulated {
            return Ok((Vec::new(), self.cpu_share));
        }
        // each rank's share in its own slot (parts per million), summed
        let mut shares = vec![0i64; comm.size()];
        let (b, t) = self.device;
        shares[comm.rank()] = if t > 0.0 { (b / t * 1e6).round() as i64 } else { 0 };
        comm.all_reduce(&mut shares, ReduceOp::Sum)?;
        Ok((shares.into_iter().map(|x| x as f64 / 1e6).collect(), self.cpu_share))
    }
}

impl BusyMeter {
    /// Emulated compute: each rank's host work per steady iteration, seconds — the time its
    /// compute lane spent beyond the device's modelled operations (the optimizer's CPU over the
    /// real state, parameters put in place, pseudo-gradients): real time, not dilated, and not
    /// in the device model or the simulator. Empty under real compute or where the workload
    /// does not time its compute lane. Collective: every rank calls it.
    pub fn finish_host(&self, comm: &Communicator, emulated: bool) -> Result<Vec<f64>> {
        if !emulated {
            return Ok(Vec::new());
        }
        // microseconds per iteration, each rank in its own slot
        let mut us = vec![0i64; comm.size()];
        let (s, n) = self.host;
        us[comm.rank()] = if n > 0 { (s / n as f64 * 1e6).round() as i64 } else { 0 };
        comm.all_reduce(&mut us, ReduceOp::Sum)?;
        Ok(us.into_iter().map(|x| x as f64 / 1e6).collect())
    }
}

/// What a run's summary line says of an emulated run's counters.
pub fn describe(c: &crate::rundir::ComputeCounters) -> String {
    let shares: Vec<String> = c.device_busy_share.iter().map(|b| format!("{:.0}%", b * 100.0)).collect();
    format!("compute {}: device busy {} (per rank), machine CPU busy {}", c.mode, shares.join(" "), c.cpu_cell())
}

/// What a rank's per-iteration line leads with: the device-busy share of the `dt`-second
/// iteration under emulated compute (`busy`: what [`BusyMeter::iteration`] returned), else its
/// loss.
pub fn iteration_cell(busy: Option<f64>, dt: f64, loss: f32) -> String {
    match busy {
        Some(b) => format!("device busy {:>3.0}%", 100.0 * b / dt.max(1e-9)),
        None => format!("loss {loss:.4}"),
    }
}

/// What a run's summary line says of its outcome: the loss from `first` to `last` under real
/// compute, the busy shares under emulated compute (which learns nothing).
pub fn outcome(c: &crate::rundir::ComputeCounters, first: Option<f32>, last: Option<f32>) -> String {
    if c.device_busy_share.is_empty() {
        format!("loss {:.4} -> {:.4}", first.unwrap_or(f32::NAN), last.unwrap_or(f32::NAN))
    } else {
        describe(c)
    }
}
