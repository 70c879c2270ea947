//! `ironweave bench collectives`: nccl-tests-style timing of collectives over local
//! processes, every row verified against a reference, beside a single-process memcpy of the
//! same size (the ceiling).

use std::time::{Duration, Instant};

use crate::error::{bail, Context, Result};
use ironweave_transport::testing::{check_collective, Case};
use ironweave_transport::{bf16, f16, Communicator, DType, Element, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};

/// Operations the benchmark knows, by name: collectives, and two point-to-point tests between
/// ranks 0 and 1 (`pingpong`: one-way time of a round trip / 2, as `ucx_perftest -t tag_lat`;
/// `stream`: rank 0 sends one buffer to rank 1 back to back, as `-t tag_bw`).
pub const OPS: [&str; 7] = ["allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "pingpong", "stream"];

fn is_p2p(op: &str) -> bool {
    matches!(op, "pingpong" | "stream")
}

/// One measured row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub op: String,
    pub bytes: usize,
    pub count: usize,
    pub dtype: String,
    pub ranks: usize,
    pub backend: String,
    pub iters: usize,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub memcpy_gbps: f64,
    pub verified: bool,
    /// Which path the timed calls took: `shm` when every one of them went through the
    /// intra-host segment (its collective counter grew by at least the call count), else `link`.
    #[serde(default)]
    pub path: String,
    /// On a striped communicator: the share of the bytes rank 0 sent on each link during the
    /// row's calls (all-gather and reduce-scatter count them), which shows how a dynamic split
    /// fell and that a static one held.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub link_share: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
}

/// Parses `4K`, `1M`, `64M`, `1G` or a byte count (`ironweave_units::parse_size`).
pub fn parse_size(s: &str) -> Result<usize> {
    let n = ironweave_units::parse_size(s)?;
    usize::try_from(n).with_context(|| format!("size {s:?} does not fit this machine's address space"))
}

/// Human size for tables.
pub fn human(b: usize) -> String {
    ironweave_units::human_bytes(b as u64)
}

fn case_of(op: &str) -> Result<Case> {
    Ok(match op {
        // Checked by name before use; the point-to-point tests run in `p2p_row`.
        "pingpong" | "stream" => Case::Barrier,
        "allreduce" => Case::AllReduce,
        "allgather" => Case::AllGather,
        "reducescatter" => Case::ReduceScatter,
        "alltoall" => Case::AllToAll,
        "broadcast" => Case::Broadcast,
        other => bail!("unknown op {other:?}; choose from {OPS:?}"),
    })
}

/// nccl-tests' bus-bandwidth factor of a benchmark op (1 for point-to-point rows).
pub fn bus_factor(op: &str, n: usize) -> f64 {
    op.parse::<ironweave_units::Coll>().map_or(1.0, |c| c.bus_factor(n as u32))
}

/// Validates ops and sizes before anything starts.
pub fn check_args(ops: &[String], sizes: &[String], dtype: &str) -> Result<()> {
    for o in ops {
        case_of(o)?;
    }
    for s in sizes {
        parse_size(s)?;
    }
    DType::parse(dtype).with_context(|| format!("unknown dtype {dtype:?}"))?;
    Ok(())
}

/// Bytes per second of a warm single-threaded memcpy of `bytes`.
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let bytes = bytes.max(1);
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let mut iters = 0u64;
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(150) || iters < 3 {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        iters += 1;
    }
    (bytes as f64 * iters as f64) / t.elapsed().as_secs_f64() / 1e9
}

/// `ironweave bench collectives`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct CollectivesArgs {
    /// Number of ranks (processes).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Backend: tcp (default), ucx, verbs, nccl.
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Comma-separated: allreduce, allgather, reducescatter, alltoall, broadcast.
    #[arg(long, value_delimiter = ',', default_value = "allreduce,allgather,reducescatter,alltoall")]
    pub ops: Vec<String>,
    /// Comma-separated sizes in bytes with K/M/G suffixes (total buffer, as nccl-tests).
    #[arg(long, value_delimiter = ',', default_value = "4K,1M,16M")]
    pub sizes: Vec<String>,
    /// Element type.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Seconds each timed loop should last (at least 3 iterations).
    #[arg(long, default_value_t = 0.3)]
    pub min_time: f64,
    /// Write the rows as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Run on the emulated cluster of this topology file.
    #[arg(long)]
    pub topology: Option<std::path::PathBuf>,
    /// Ranks per emulated host (with --topology).
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Which link: a link name; `all` (striped over every link: all-gather and
    /// reduce-scatter balance dynamically over two links, the rest splits by rate);
    /// `all-static` (every collective split by rate); `all:F1,F2` (split by these
    /// fractions); or the default link.
    #[arg(long, default_value = "")]
    pub link: String,
}

/// What each benchmark rank is told: its command line is [`BenchWorkerArgs::to_argv`], parsed
/// back by the hidden `bench-worker` subcommand.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct BenchWorkerArgs {
    #[arg(long)]
    pub backend: String,
    #[arg(long, default_value = "")]
    pub link: String,
    #[arg(long, value_delimiter = ',')]
    pub ops: Vec<String>,
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<String>,
    #[arg(long)]
    pub dtype: String,
    #[arg(long)]
    pub min_time: f64,
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

impl BenchWorkerArgs {
    /// The hidden subcommand that runs it.
    pub const SUBCOMMAND: &'static str = "bench-worker";

    /// The rank's command line: the subcommand, then these options as clap parses them.
    pub fn to_argv(&self) -> Vec<String> {
        let mut v: Vec<String> = vec![
            Self::SUBCOMMAND.into(),
            "--backend".into(),
            self.backend.clone(),
            format!("--link={}", self.link),
            "--ops".into(),
            self.ops.join(","),
            "--sizes".into(),
            self.sizes.join(","),
            "--dtype".into(),
            self.dtype.clone(),
            "--min-time".into(),
            self.min_time.to_string(),
        ];
        if let Some(o) = &self.out {
            v.extend(["--out".into(), o.display().to_string()]);
        }
        v
    }
}

/// `ironweave bench collectives`: the ranks run [`worker`], rank 0's rows come back as JSON,
/// the memcpy ceiling is measured beside each, the table is printed; returns 2 when a row
/// failed verification.
pub fn collectives(a: &CollectivesArgs) -> Result<i32> {
    crate::backend::check(&a.backend)?;
    check_args(&a.ops, &a.sizes, &a.dtype)?;
    let topology = match &a.topology {
        Some(p) => Some((crate::cluster::Topology::load(p)?, a.ranks_per_host.max(1))),
        None => None,
    };
    let ranks = topology.as_ref().map_or(a.ranks, |(t, k)| t.hosts * k);
    let out = std::env::temp_dir().join(format!("ironweave-bench-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&out);
    eprintln!(
        "ironweave bench collectives: {ranks} ranks over {}, {} ops x {} sizes, dtype {}",
        a.backend,
        a.ops.len(),
        a.sizes.len(),
        a.dtype
    );
    let w = BenchWorkerArgs {
        backend: a.backend.clone(),
        link: a.link.clone(),
        ops: a.ops.clone(),
        sizes: a.sizes.clone(),
        dtype: a.dtype.clone(),
        min_time: a.min_time,
        out: Some(out.clone()),
    };
    crate::launch::helpers(ranks, w.to_argv(), topology, "benchmark")?;
    let mut rows: Vec<Row> = serde_json::from_slice(&std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?)?;
    let _ = std::fs::remove_file(&out);
    for r in rows.iter_mut() {
        r.memcpy_gbps = memcpy_gbps(r.bytes);
    }
    println!("{}", table(&rows));
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&rows)?).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    let bad: Vec<String> = rows.iter().filter(|r| !r.verified).map(|r| format!("{} {}", r.op, human(r.bytes))).collect();
    if !bad.is_empty() {
        eprintln!("ironweave: {} rows failed verification: {}", bad.len(), bad.join(", "));
        return Ok(2);
    }
    Ok(0)
}

/// The per-rank part: runs inside every launched process.
pub fn worker(a: &BenchWorkerArgs) -> Result<()> {
    let (backend, ops, sizes, min_time) = (a.backend.as_str(), &a.ops, &a.sizes, a.min_time);
    let world = crate::backend::connect(backend).context("joining the job")?;
    let comm = select_link(&world, &a.link)?;
    let d = DType::parse(&a.dtype).context("dtype")?;
    let rows = match d {
        DType::F32 => rows::<f32>(&comm, backend, ops, sizes, min_time)?,
        DType::F64 => rows::<f64>(&comm, backend, ops, sizes, min_time)?,
        DType::F16 => rows::<f16>(&comm, backend, ops, sizes, min_time)?,
        DType::BF16 => rows::<bf16>(&comm, backend, ops, sizes, min_time)?,
        DType::I32 => rows::<i32>(&comm, backend, ops, sizes, min_time)?,
        DType::I64 => rows::<i64>(&comm, backend, ops, sizes, min_time)?,
        DType::U8 => rows::<u8>(&comm, backend, ops, sizes, min_time)?,
    };
    if comm.rank() == 0 {
        if let Some(path) = &a.out {
            std::fs::write(path, serde_json::to_vec_pretty(&rows)?).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    comm.barrier()?;
    Ok(())
}

/// `""`: the communicator as it is; `all`: striped over every link (all-gather and
/// reduce-scatter balance dynamically over two links, the rest splits by the links' rates);
/// `all-static`: striped, every collective split by the links' rates; `all:F1,F2`: striped,
/// every collective split by these fractions; a link name: only that link.
pub fn select_link(world: &Communicator, link: &str) -> Result<Communicator> {
    match link {
        "" => Ok(world.on_link(0)?),
        "all" => Ok(world.striped(None)?),
        "all-static" => Ok(world.striped(None)?.with_static_split()),
        l if l.starts_with("all:") => {
            let f: Vec<f64> =
                l[4..].split(',').map(|x| x.trim().parse().context("--link all:F1,F2,...")).collect::<Result<_>>()?;
            Ok(world.striped(Some(f))?.with_static_split())
        }
        name => {
            let infos = world.links();
            let i = infos.iter().position(|l| l.name == name || l.name.split_once(':').map(|(_, n)| n) == Some(name));
            let names: Vec<&str> = infos.iter().map(|l| l.name.as_str()).collect();
            let i = i.with_context(|| format!("no link named {name:?}; this job has {names:?}"))?;
            Ok(world.on_link(i)?)
        }
    }
}

fn rows<T: Element>(c: &Communicator, backend: &str, ops: &[String], sizes: &[String], min_time: f64) -> Result<Vec<Row>> {
    let total = ops.len() * sizes.len();
    // rank 0 reports; its stderr reaches the user through the launcher (so: lines, not a bar)
    let progress = (c.rank() == 0).then(|| Progress::new("row", 0, total as u64, Mode::Lines));
    let mut out = Vec::new();
    for op in ops {
        let case = case_of(op)?;
        for s in sizes {
            let bytes = parse_size(s)?;
            let row = if is_p2p(op) {
                p2p_row(c, op, bytes, backend, min_time)?
            } else {
                collective_row::<T>(c, op, case, bytes, backend, min_time)?
            };
            if let Some(p) = &progress {
                p.step(
                    out.len() as u64 + 1,
                    &format!(
                        "{:>13} {:>9}: {:>10.2} us  busbw {:>6.3} GB/s  {}",
                        row.op,
                        human(row.bytes),
                        row.time_us,
                        row.busbw_gbps,
                        if row.verified { "verified" } else { "NOT VERIFIED" }
                    ),
                );
            }
            out.push(row);
        }
    }
    Ok(out)
}

/// One collective row: verified once on patterned data, then timed.
fn collective_row<T: Element>(c: &Communicator, op: &str, case: Case, bytes: usize, backend: &str, min_time: f64) -> Result<Row> {
    let (n, es) = (c.size(), std::mem::size_of::<T>());
    let mut count = bytes / es;
    if matches!(case, Case::AllGather | Case::ReduceScatter | Case::AllToAll) {
        count = count / n * n;
    }
    // Verification: one call on patterned data, checked element by element.
    let check = check_collective::<T>(c, case, count, ReduceOp::Sum, 0x5eed ^ count as u64, true);
    if let Err(e) = &check {
        eprintln!("rank {}: {op} {} failed verification: {e}", c.rank(), human(count * es));
    }
    let mut flag = [i32::from(check.is_ok())];
    c.all_reduce(&mut flag, ReduceOp::Min)?;
    let before = c.shared_memory_collectives().unwrap_or(0);
    let lanes_before = c.stripe_bytes_sent();
    let (iters, secs) = time_op::<T>(c, case, count, min_time)?;
    let through_shm = c.shared_memory_collectives().unwrap_or(0) - before;
    let link_share = lanes_before.zip(c.stripe_bytes_sent()).and_then(|(a, b)| {
        let d: Vec<f64> = b.iter().zip(&a).map(|(b, a)| (b - a) as f64).collect();
        let sum: f64 = d.iter().sum();
        (sum > 0.0).then(|| d.iter().map(|x| x / sum).collect())
    });
    Ok(Row {
        path: if through_shm >= iters as u64 && iters > 0 { "shm" } else { "link" }.into(),
        op: op.into(),
        bytes: count * es,
        count,
        dtype: T::DTYPE.name().into(),
        ranks: n,
        backend: backend.into(),
        iters,
        time_us: secs * 1e6,
        algbw_gbps: (count * es) as f64 / secs / 1e9,
        busbw_gbps: (count * es) as f64 / secs / 1e9 * bus_factor(op, n),
        memcpy_gbps: 0.0,
        verified: flag[0] == 1,
        link_share,
        error: check.err().map(|e| e.to_string()),
    })
}

/// Rounds of the warm-up that sizes the timed loop.
const WINDOW: usize = 16;

/// One point-to-point row between ranks 0 and 1 (other ranks only take part in the barriers).
fn p2p_row(c: &Communicator, op: &str, bytes: usize, backend: &str, min_time: f64) -> Result<Row> {
    if c.size() < 2 {
        bail!("{op} needs at least two ranks");
    }
    let pattern: Vec<u8> = (0..bytes).map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8).collect();
    let me = c.rank();
    let mut dst = vec![0u8; bytes];
    // One round: pingpong = there and back; stream = `k` messages 0 -> 1, then a 1-byte ack.
    let round = |k: usize, dst: &mut Vec<u8>| -> ironweave_transport::Result<()> {
        match (op, me) {
            ("pingpong", 0) => {
                for _ in 0..k {
                    c.send(1, 1, &pattern)?;
                    c.recv(1, 1, dst)?;
                }
            }
            ("pingpong", 1) => {
                for _ in 0..k {
                    c.recv(0, 1, dst)?;
                    c.send(0, 1, dst)?;
                }
            }
            ("stream", 0) => {
                // One buffer sent back to back (as ucx_perftest's tag_bw reuses its buffer):
                // owned buffers in flight would measure cold memory instead of the link.
                for _ in 0..k {
                    c.send(1, 2, &pattern)?;
                }
                let mut ack = [0u8; 1];
                c.recv(1, 3, &mut ack)?;
            }
            ("stream", 1) => {
                for _ in 0..k {
                    c.recv(0, 2, dst)?;
                }
                c.send(0, 3, &[1u8])?;
            }
            _ => {}
        }
        Ok(())
    };
    // Verification: one round, the received bytes compared with the pattern.
    round(1, &mut dst)?;
    // Rank 0 of `stream` only sends; ranks above 1 only watch.
    let ok = me > 1 || (op == "stream" && me == 0) || dst == pattern;
    let mut flag = [i32::from(ok)];
    c.all_reduce(&mut flag, ReduceOp::Min)?;
    c.barrier()?;
    let t = Instant::now();
    round(WINDOW, &mut dst)?;
    let mut est = [t.elapsed().as_secs_f64() / WINDOW as f64];
    c.all_reduce(&mut est, ReduceOp::Max)?;
    let mut iters = [((min_time / est[0].max(1e-7)) as i64).clamp(WINDOW as i64, 200_000)];
    c.broadcast(&mut iters, 0)?;
    c.barrier()?;
    let t = Instant::now();
    round(iters[0] as usize, &mut dst)?;
    let per = t.elapsed().as_secs_f64() / iters[0] as f64;
    let mut secs = [if op == "pingpong" { per / 2.0 } else { per }];
    c.broadcast(&mut secs, 0)?;
    Ok(Row {
        op: op.into(),
        bytes,
        count: bytes,
        dtype: "u8".into(),
        ranks: 2,
        backend: backend.into(),
        iters: iters[0] as usize,
        time_us: secs[0] * 1e6,
        algbw_gbps: bytes as f64 / secs[0] / 1e9,
        busbw_gbps: bytes as f64 / secs[0] / 1e9,
        memcpy_gbps: 0.0,
        verified: flag[0] == 1,
        path: "link".into(),
        link_share: None,
        error: (!ok).then(|| "received bytes differ from the pattern".to_string()),
    })
}

/// Times `case` on `count` elements: rank 0 picks the iteration count from a warm-up so the
/// loop lasts about `min_time` seconds (up to 2 million calls: a row of a fifth of a
/// microsecond capped at 20,000 lasted 4 ms, which one preemption skewed by a quarter); the
/// result is the slowest rank's mean.
fn time_op<T: Element>(c: &Communicator, case: Case, count: usize, min_time: f64) -> Result<(usize, f64)> {
    let n = c.size();
    let mut a = vec![T::from_i64(1); count];
    let mut b = vec![T::zeroed(); count];
    let per = count / n;
    let once = |a: &mut Vec<T>, b: &mut Vec<T>| -> ironweave_transport::Result<()> {
        match case {
            Case::AllReduce => c.all_reduce(a, ReduceOp::Sum),
            Case::AllGather => c.all_gather(&a[..per], b),
            Case::ReduceScatter => c.reduce_scatter(a, &mut b[..per], ReduceOp::Sum),
            Case::AllToAll => c.all_to_all(a, b),
            Case::Broadcast => c.broadcast(a, 0),
            _ => Ok(()),
        }
    };
    once(&mut a, &mut b)?;
    c.barrier()?;
    let t = Instant::now();
    once(&mut a, &mut b)?;
    let mut est = [t.elapsed().as_secs_f64()];
    c.all_reduce(&mut est, ReduceOp::Max)?;
    let mut iters = [((min_time / est[0].max(1e-7)) as i64).clamp(3, 2_000_000)];
    c.broadcast(&mut iters, 0)?;
    c.barrier()?;
    let t = Instant::now();
    for _ in 0..iters[0] {
        once(&mut a, &mut b)?;
    }
    let mut secs = [t.elapsed().as_secs_f64() / iters[0] as f64];
    c.all_reduce(&mut secs, ReduceOp::Max)?;
    Ok((iters[0] as usize, secs[0]))
}

/// Renders rows as a Markdown table (pasteable into docs/BENCHMARKS.md).
pub fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| op | size | ranks | backend | time (us) | algbw (GB/s) | busbw (GB/s) | memcpy (GB/s) | busbw / memcpy | verified |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.3} | {:.3} | {:.2} | {:.3} | {} |\n",
            r.op,
            human(r.bytes),
            r.ranks,
            r.backend,
            r.time_us,
            r.algbw_gbps,
            r.busbw_gbps,
            r.memcpy_gbps,
            if r.memcpy_gbps > 0.0 { r.busbw_gbps / r.memcpy_gbps } else { 0.0 },
            if r.verified { "yes" } else { "NO" }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_parses_back_what_the_parent_wrote() {
        for (link, out) in [("", None), ("all:0.7,0.3", Some("/tmp/rows.json".into())), ("a", None)] {
            let a = BenchWorkerArgs {
                backend: "tcp".into(),
                link: link.into(),
                ops: vec!["allreduce".into(), "alltoall".into()],
                sizes: vec!["4K".into(), "1M".into()],
                dtype: "bf16".into(),
                min_time: 0.125,
                out,
            };
            let b: BenchWorkerArgs = crate::parse_back(&a.to_argv());
            assert_eq!(a, b);
        }
    }
}
