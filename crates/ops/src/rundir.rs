//! The run directory's files, which every training run writes and the benches, `report`,
//! `chaos` and the tests read: `report.json` ([`Report`], [`TpReport`], [`SdpReport`], the
//! layout-free [`Digests`]), `iterations.jsonl` (rank 0's lines, written through
//! [`crate::train::elastic::RankLog`] and read by [`read_iterations`]; the recovery marker) and
//! the statistics the benches read them with. It imports no operation.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Result;

/// A list of floats where null (how JSON writes NaN) reads back as NaN.
fn floats_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<f32>, D::Error> {
    let v: Vec<Option<f32>> = Deserialize::deserialize(d)?;
    Ok(v.into_iter().map(|x| x.unwrap_or(f32::NAN)).collect())
}

/// What `report.json` holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub config: String,
    pub strategy: String,
    pub ranks: usize,
    pub iterations: u64,
    pub iter_time_s: Vec<f64>,
    /// Per iteration (NaN, written as null: emulated compute, which learns nothing).
    #[serde(deserialize_with = "floats_or_null")]
    pub loss: Vec<f32>,
    pub ckpt_exposed_s: Vec<f64>,
    /// Rank 0's chunk transfers as its sender threads timed them (`send` calls: bytes into
    /// the socket buffer), mean over the iterations.
    pub partition_accuracy: Option<f64>,
    /// Every rank as a holder: the share of the replica chunks it received whose time on the
    /// wire (the `len / rate` before the last byte arrived) fell inside an idle window of its
    /// own link, over the run (`ironweave_ckpt::partition::wire_accuracy`).
    #[serde(default)]
    pub wire_accuracy: Option<f64>,
    /// Replica chunks the holders received and judged, all ranks.
    #[serde(default)]
    pub wire_chunks: u64,
    pub profiling_activations: u64,
    pub last_committed_iter: Option<u64>,
    pub recoveries: u64,
    pub final_state_sha256: String,
    pub tokens_per_iter: u64,
    /// Compute threads of each rank (RAYON_NUM_THREADS as the ranks saw it).
    #[serde(default)]
    pub threads_per_rank: usize,
    /// Gradient buckets per iteration (0 when alone).
    #[serde(default)]
    pub grad_buckets: usize,
    /// Rank 0's data-parallel gradient averaging per iteration: seconds on the wire, and the
    /// part of it during which its backward pass computed.
    #[serde(default)]
    pub dp_comm_s: Vec<f64>,
    #[serde(default)]
    pub dp_hidden_s: Vec<f64>,
    /// Where each rank's state came from in the last recovery: "own memory", "peer",
    /// "persistent", "initial state" (nothing was committed: started over), "" when it never
    /// restored.
    #[serde(default)]
    pub restore_sources: Vec<String>,
    /// The ranks holding a replica of each rank's snapshots.
    #[serde(default)]
    pub replica_holders: Vec<Vec<usize>>,
    /// Each rank's host (index in order of first appearance).
    #[serde(default)]
    pub hosts: Vec<usize>,
    /// Parameters and optimizer state each rank holds between iterations (what one
    /// checkpoint of a rank carries), bytes.
    #[serde(default)]
    pub state_bytes_per_rank: u64,
    /// Replica bytes the ranks sent to their holders over the run (every holder counted).
    #[serde(default)]
    pub ckpt_bytes_replicated: u64,
    /// Of which to holders on another host, as the senders counted them (the links' own
    /// counters are in `bench ckpt`'s rows).
    #[serde(default)]
    pub ckpt_bytes_inter_host_sent: u64,
    /// Replica bytes per link the engine used (the training link first).
    #[serde(default)]
    pub ckpt_bytes_per_link: Vec<u64>,
    /// Bytes written to the persistent tier over the run, all ranks.
    #[serde(default)]
    pub ckpt_bytes_storage: u64,
    /// Snapshots not taken because the links did not keep up (the committed iteration and
    /// the ones after it filled every buffer), all ranks.
    #[serde(default)]
    pub ckpt_snapshots_skipped: u64,
    /// The engine's memory traffic for its copies, summed over the ranks
    /// (`ironweave_ckpt::Engine::memory_passes`): state bytes snapshotted and the bytes read and
    /// written for them, replica bytes received and the bytes read and written for them.
    #[serde(default)]
    pub ckpt_memory: ironweave_ckpt::MemoryPasses,
    /// The layout-free digests of the final state and of a resumed job's loaded state.
    #[serde(flatten)]
    pub digests: Digests,
    /// CPU the checkpoint engine's own replica sender and receiver threads used over the run,
    /// all ranks, ns — named for what it counts: the transport's reader threads that take the
    /// replica bytes off the socket are not in it (they serve training messages too; the whole
    /// cost, every thread, is `process_cpu_ns` against a `none` run). Reports written before
    /// the name said what it counts carry it as `ckpt_cpu_ns`.
    #[serde(default, alias = "ckpt_cpu_ns")]
    pub ckpt_engine_threads_cpu_ns: u64,
    /// CPU every thread of the ranks' processes used over the whole run, ns, all ranks: a run
    /// minus the `none` run of the same job is what checkpointing cost, on whichever thread
    /// (TCP readers that decode replica frames included).
    #[serde(default)]
    pub process_cpu_ns: u64,
    /// CPU the transport's own threads used (`ironweave_transport::threads::comm_cpu_ns`), ns,
    /// all ranks.
    #[serde(default)]
    pub comm_cpu_ns: u64,
    /// Each rank's share of the emulated storage bandwidth, bytes/s (None: the local disk).
    #[serde(default)]
    pub storage_bytes_per_s_per_rank: Option<f64>,
    /// The emulated cluster's topology file the run used (None: one machine).
    #[serde(default)]
    pub topology: Option<PathBuf>,
    /// Ranks per host.
    #[serde(default)]
    pub ranks_per_host: usize,
    /// Rank 0's resident memory after each iteration, bytes (`/proc/self/statm`; 0 where
    /// unreadable): a leak shows as growth over a long run.
    #[serde(default)]
    pub rss_bytes: Vec<u64>,
    /// Rank 0's open file descriptors after each iteration.
    #[serde(default)]
    pub open_fds: Vec<u64>,
    /// How the ranks computed, and the busy shares.
    #[serde(flatten)]
    pub compute: ComputeCounters,
}

/// How a run's ranks computed and the counters that show whether the links or this machine's
/// cores bound it: every report and bench row carries them (flattened: `compute`,
/// `device_busy_share`, `cpu_busy_share`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ComputeCounters {
    /// `cpu` (the real math) or `emulated DEVICE (dilation D)`.
    #[serde(rename = "compute", default)]
    pub mode: String,
    /// Emulated compute: each rank's device-busy share of the steady iterations (after two
    /// warm-up iterations): modelled device time over wall time.
    #[serde(default)]
    pub device_busy_share: Vec<f64>,
    /// The whole machine's CPU busy share during the steady iterations (/proc/stat, every
    /// core, every process): a bed whose links are the bottleneck keeps it low.
    #[serde(default)]
    pub cpu_busy_share: Option<f64>,
    /// Emulated compute (sharded and tensor-parallel workloads): each rank's host work per
    /// steady iteration, seconds of real (undilated) time its compute lane spent beyond the
    /// device's operations — the optimizer's CPU over the real state, parameters put in place.
    /// Neither the device model nor the simulator has it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_compute_s: Vec<f64>,
}

impl ComputeCounters {
    /// The mean of several runs of one row (rounds): the first's mode, each rank's mean
    /// device share, the mean CPU share of the runs that measured one.
    pub fn mean<'a>(runs: impl IntoIterator<Item = &'a ComputeCounters>) -> ComputeCounters {
        let runs: Vec<&ComputeCounters> = runs.into_iter().collect();
        let Some(first) = runs.first() else { return ComputeCounters::default() };
        let n = runs.len() as f64;
        let cpu: Vec<f64> = runs.iter().filter_map(|r| r.cpu_busy_share).collect();
        ComputeCounters {
            mode: first.mode.clone(),
            device_busy_share: (0..first.device_busy_share.len())
                .map(|k| runs.iter().map(|r| r.device_busy_share.get(k).copied().unwrap_or(0.0)).sum::<f64>() / n)
                .collect(),
            cpu_busy_share: (!cpu.is_empty()).then(|| cpu.iter().sum::<f64>() / cpu.len() as f64),
            host_compute_s: (0..first.host_compute_s.len())
                .map(|k| runs.iter().map(|r| r.host_compute_s.get(k).copied().unwrap_or(0.0)).sum::<f64>() / n)
                .collect(),
        }
    }

    /// The mode as a table says it (`cpu` when unset: reports from before the field).
    pub fn mode_or_cpu(&self) -> &str {
        if self.mode.is_empty() {
            "cpu"
        } else {
            &self.mode
        }
    }

    /// The machine CPU busy cell of a table.
    pub fn cpu_cell(&self) -> String {
        self.cpu_busy_share.map_or_else(|| "-".into(), |c| format!("{:.0}%", c * 100.0))
    }

    /// The device-busy cell of a table: the mean over the ranks.
    pub fn device_cell(&self) -> String {
        let d = &self.device_busy_share;
        if d.is_empty() {
            "-".into()
        } else {
            format!("{:.0}%", 100.0 * d.iter().sum::<f64>() / d.len() as f64)
        }
    }
}

impl Report {
    /// Mean of `v` after the first `skip` (warm-up) entries, or of all when too short.
    pub fn steady(v: &[f64], skip: usize) -> f64 {
        let v = if v.len() > skip { &v[skip..] } else { v };
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }

    /// Iterations this job did not run: those of the checkpoint it resumed from.
    pub fn resumed_iters(&self) -> usize {
        self.digests.resumed_from_iter.unwrap_or(0) as usize
    }

    /// Mean iteration time after two warm-up iterations (of those this job ran).
    pub fn mean_iter_s(&self) -> f64 {
        Self::steady(&self.iter_time_s, self.resumed_iters() + 2)
    }

    /// Tokens per second over the steady iterations.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_iter as f64 / self.mean_iter_s().max(1e-12)
    }

    /// Share of data-parallel communication time during which backward computed (None when
    /// nothing was communicated).
    pub fn comm_hidden_fraction(&self) -> Option<f64> {
        let c = Self::steady(&self.dp_comm_s, 2);
        (c > 0.0).then(|| Self::steady(&self.dp_hidden_s, 2) / c)
    }
}

/// This process's resident memory (bytes) and open file descriptors, from /proc (zeros where
/// it cannot be read).
pub fn process_footprint() -> (u64, u64) {
    // statm's second field: resident pages
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1).and_then(|x| x.parse::<u64>().ok()))
        // SAFETY: sysconf with a valid name has no preconditions.
        .map_or(0, |pages| pages * (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64));
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    (rss, fds)
}

/// The whole machine's CPU time so far, in clock ticks: (busy, total) from /proc/stat's first
/// line (busy: everything but idle and iowait). Two readings give the machine's busy share
/// between them; None where /proc/stat cannot be read.
pub fn machine_cpu_ticks() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user)
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// Appends a recovery marker to rank 0's per-iteration lines: where the job went back to (0:
/// the initial state). `ironweave chaos` reads what was committed before it.
pub fn mark_recovery(dir: &Path, restored: u64) -> Result<()> {
    append_line(dir, &serde_json::json!({ "recovered": restored }))
}

/// Appends `line` to the run's `iterations.jsonl` under `dir`.
pub fn append_line(dir: &Path, line: &serde_json::Value) -> Result<()> {
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("iterations.jsonl"))?;
    writeln!(f, "{line}")?;
    Ok(())
}

/// Every iteration's line of the run under `dir`, the last line of a re-run iteration winning
/// (so a restarted rank 0 still reports the whole run); unreadable lines are skipped.
pub fn read_iterations(dir: &Path) -> std::collections::BTreeMap<u64, serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("iterations.jsonl")).unwrap_or_default();
    let mut by_iter = std::collections::BTreeMap::new();
    for l in text.lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
            if let Some(it) = v["iter"].as_u64() {
                by_iter.insert(it, v);
            }
        }
    }
    by_iter
}

/// What a tensor-parallel run's `report.json` holds (rank 0's view).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TpReport {
    pub config: String,
    pub schedule: String,
    /// The largest tensor-parallel degree (every sub-layer's when uniform).
    pub tp: usize,
    /// Each sub-layer's degree (one value: uniform).
    #[serde(default)]
    pub degrees: Vec<usize>,
    /// Data-parallel degree of the head.
    pub dp: usize,
    pub sub_batches: usize,
    pub ranks: usize,
    pub threads_per_rank: usize,
    pub iterations: u64,
    pub iter_time_s: Vec<f64>,
    #[serde(deserialize_with = "floats_or_null")]
    pub loss: Vec<f32>,
    /// Seconds of compute on rank 0's compute lane, per iteration.
    pub compute_s: Vec<f64>,
    /// Seconds rank 0's tensor-parallel collectives were on the wire, per iteration.
    pub tp_comm_s: Vec<f64>,
    /// Of those, seconds during which rank 0 computed.
    pub tp_hidden_s: Vec<f64>,
    /// Seconds rank 0's compute lane waited for collectives.
    pub wait_s: Vec<f64>,
    /// Data-parallel gradient averaging on the wire, per iteration.
    pub dp_comm_s: Vec<f64>,
    /// Seconds of each iteration outside the scheduled work (loss average, optimizer step).
    #[serde(default)]
    pub outside_s: Vec<f64>,
    /// Mean compute seconds of each stage and sub-batch over the steady iterations.
    pub stage_compute_s: Vec<Vec<f64>>,
    /// Mean seconds on the wire of each stage's collective and sub-batch (0: none).
    pub stage_comm_s: Vec<Vec<f64>>,
    /// Mean seconds on the wire of each tail (data-parallel gradients).
    pub tail_comm_s: Vec<f64>,
    /// SHA-256 over every rank's state digest, in rank order.
    pub final_state_sha256: String,
    pub tokens_per_iter: u64,
    /// How the ranks computed, and the busy shares.
    #[serde(flatten)]
    pub compute: ComputeCounters,
}

impl TpReport {
    /// Mean of `v` after two warm-up iterations.
    pub fn steady(v: &[f64]) -> f64 {
        Report::steady(v, 2)
    }
    /// Median iteration time after two warm-up iterations.
    pub fn median_iter_s(&self) -> f64 {
        median(if self.iter_time_s.len() > 2 { &self.iter_time_s[2..] } else { &self.iter_time_s })
    }
    /// Tensor-parallel communication per iteration (steady mean).
    pub fn comm_s(&self) -> f64 {
        Self::steady(&self.tp_comm_s)
    }
    /// Share of it during which compute ran.
    pub fn hidden_fraction(&self) -> Option<f64> {
        let c = self.comm_s();
        (c > 0.0).then(|| Self::steady(&self.tp_hidden_s) / c)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// What a sharded run's `report.json` holds (rank 0's view).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SdpReport {
    pub config: String,
    /// The sharding strategy (`replicated`, `full`, `hybrid`, `hsdp`).
    pub sdp: String,
    pub ranks: usize,
    pub ranks_per_host: usize,
    pub iterations: u64,
    pub iter_time_s: Vec<f64>,
    #[serde(deserialize_with = "floats_or_null")]
    pub loss: Vec<f32>,
    /// Parameters, gradients and both Adam moments each rank holds between iterations.
    pub state_bytes_per_rank: u64,
    /// The links the two parts' groups used: (all-rank part, cross-host all-reduce).
    pub links: (String, String),
    pub fractions: Vec<f64>,
    /// Rank 0's compute per iteration (forward, backward, optimizer), seconds.
    #[serde(default)]
    pub compute_s: Vec<f64>,
    /// Seconds rank 0's compute waited for collectives, per iteration.
    #[serde(default)]
    pub wait_s: Vec<f64>,
    /// Seconds per iteration during which at least one of rank 0's collectives was on the wire.
    #[serde(default)]
    pub comm_busy_s: Vec<f64>,
    /// Seconds per iteration each of rank 0's lanes was busy: [all-rank group, host group,
    /// cross-host group].
    #[serde(default)]
    pub lane_busy_s: Vec<[f64; 3]>,
    /// The checkpoint strategy of the shards.
    #[serde(default)]
    pub ckpt: String,
    /// Recoveries (re-formations after a failure).
    #[serde(default)]
    pub recoveries: u64,
    /// The last iteration committed by the checkpoint engine.
    #[serde(default)]
    pub last_committed_iter: Option<u64>,
    /// SHA-256 over every rank's state digest (its shards and step), in rank order.
    #[serde(default)]
    pub final_state_sha256: String,
    /// CPU the ranks' communication threads used over the run, all ranks, ns
    /// (`ironweave_transport::threads::comm_cpu_ns`: collective threads, TCP readers and
    /// senders, striped lanes): on this bed every byte's CPU is paid on the training cores.
    #[serde(default)]
    pub comm_cpu_ns: u64,
    /// CPU every thread of the ranks' processes used over the run, all ranks, ns (the
    /// communication threads' CPU is a part of it).
    #[serde(default)]
    pub process_cpu_ns: u64,
    /// As in [`Report`] (the final digest is None when shards split the global tensors:
    /// `ironweave ckpt inspect` assembles them from the persistent tier).
    /// How the ranks computed, and the busy shares.
    #[serde(flatten)]
    pub compute: ComputeCounters,
    #[serde(flatten)]
    pub digests: Digests,
}

/// The layout-free digests `report.json` carries (train and sdp runs alike).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Digests {
    /// The final global state's (`ironweave::elastic::global_state_sha256`): equal across
    /// world sizes and layouts for the same tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_state_sha256: Option<String>,
    /// With `--resume-from`: the iteration loaded, the world size that wrote it, and the
    /// layout-free digest of the state as loaded (equal to the writer's `global_state_sha256`
    /// at that iteration when the load is exact).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_iter: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_world: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_global_state_sha256: Option<String>,
}

impl Digests {
    /// The digests of a finished job whose final state is `bufs` (in its registered order;
    /// collective).
    pub fn of(done: &ironweave::elastic::Finished, bufs: &[&[u8]]) -> Result<Self> {
        let (resumed_from_iter, resumed_from_world, restored_global_state_sha256) =
            done.resumed().map_or((None, None, None), |r| (Some(r.iter), Some(r.written_by), r.global_sha256.clone()));
        Ok(Digests {
            global_state_sha256: done.global_state_sha256(bufs)?,
            resumed_from_iter,
            resumed_from_world,
            restored_global_state_sha256,
        })
    }
}

/// Median of `v` after `skip` warm-up entries (of all when too short).
pub fn median_after(v: &[f64], skip: usize) -> f64 {
    let mut s: Vec<f64> = if v.len() > skip { v[skip..].to_vec() } else { v.to_vec() };
    if s.is_empty() {
        return 0.0;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}
