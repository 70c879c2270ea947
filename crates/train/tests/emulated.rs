//! Emulated compute on two ranks over TCP: the device is busy for exactly the time the FLOP
//! count of the configured model predicts (computed here from the formulas, not from the
//! library's), the exchanges carry exactly the model's bytes, the state changes every
//! iteration, and two runs end in the same digest.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ironweave_plan::DeviceDesc;
use ironweave_profile::{MonotonicClock, Profiler};
use ironweave_tcp::TcpConfig;
use ironweave_train::data::Corpus;
use ironweave_train::device::Sleep;
use ironweave_train::dist::Dist;
use ironweave_train::emulated::Emulated;
use ironweave_train::routing::{RoutingShape, RoutingTrace};
use ironweave_train::trainer::expert_of;
use ironweave_train::{TrainConfig, Trainer};
use ironweave_transport::CommOptions;

#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<Duration>>);

impl Sleep for Recorder {
    fn sleep(&self, d: Duration) {
        self.0.lock().unwrap().push(d);
    }
}

fn config() -> (TrainConfig, Corpus) {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let c = TrainConfig::from_toml_str(&std::fs::read_to_string(format!("{root}/configs/moe-tiny.toml")).unwrap()).unwrap();
    let corpus = Corpus::load(std::path::Path::new(&format!("{root}/{}", c.data.path)), c.model.seq).unwrap();
    (c, corpus)
}

const ITERS: u64 = 3;

/// A trace recorded with half this run's tokens per rank (so the counts are scaled by 2), whose
/// busiest expert wants more than its capacity (so the cut is exercised).
fn trace(cfg: &TrainConfig) -> RoutingTrace {
    let mut shape = RoutingShape::of(cfg, 2);
    shape.tokens_per_rank /= 2;
    let base = [100u64, 75, 50, 31]; // sums to 128 tokens x top-2
    let mut rows = Vec::new();
    for it in 1..=ITERS {
        for r in 0..2 {
            let per_layer: Vec<Vec<u64>> =
                (0..2).map(|m| (0..4).map(|e| base[(e + it as usize + m + r) % 4]).collect()).collect();
            rows.push((it, r, per_layer));
        }
    }
    RoutingTrace::assemble(shape, rows).unwrap()
}

/// 1 TFLOP/s, memory so fast that every operation is compute-bound.
fn device() -> DeviceDesc {
    DeviceDesc::from_toml_str("name = \"test\"\npeak_tflops = 1.0\nefficiency = 1.0\nmemory_gib = 1.0\nmemory_gbyte_s = 1e9\n")
        .unwrap()
}

struct RankRun {
    slept: Vec<Duration>,
    /// Training bytes the profiler saw per iteration.
    comm_bytes: Vec<u64>,
    digests: Vec<String>,
    params: usize,
    dense_params: usize,
}

fn run() -> Vec<RankRun> {
    let (cfg, corpus) = config();
    let tcp = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..TcpConfig::default() };
    let comms =
        ironweave_tcp::local_world(2, &tcp, CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() }).unwrap();
    let hs: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let (cfg, corpus) = (cfg.clone(), corpus.clone());
            std::thread::spawn(move || {
                let rec = Arc::new(Recorder::default());
                let emu = Emulated::new(&cfg, 2, &device(), 1.0, Some(trace(&cfg)), ITERS, Some(rec.clone())).unwrap();
                let prof = Arc::new(Profiler::new(MonotonicClock::default(), 16));
                let dist = Dist { comm: Arc::new(comm), prof: None };
                let mut tr = Trainer::distributed(cfg.clone(), corpus, dist).unwrap();
                tr.set_profiler(prof.clone());
                let mut comm_bytes = Vec::new();
                let mut digests = vec![tr.state_sha256()];
                for it in 1..=ITERS {
                    prof.begin_iteration(it);
                    let s = tr.step_emulated(&emu, Some(&prof)).unwrap();
                    assert!(s.loss.is_nan(), "emulated compute learns nothing and says so");
                    let p = prof.end_iteration().unwrap();
                    comm_bytes.push(p.comms.iter().map(|c| c.bytes).sum());
                    digests.push(tr.state_sha256());
                }
                let params = tr.params.list.iter().map(|p| p.w.len()).sum();
                let dense_params = tr.params.list.iter().filter(|p| expert_of(&p.name).is_none()).map(|p| p.w.len()).sum();
                let slept = rec.0.lock().unwrap().clone();
                RankRun { slept, comm_bytes, digests, params, dense_params }
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Tokens rank `src` sends to expert `e` at iteration `it`, layer `m`, by hand: the trace's
/// count doubled, cut at the capacity ceil(1.25 x 256 x 2 / 4) = 160.
fn sent(it: u64, m: usize, src: usize, e: usize) -> u64 {
    let base = [100u64, 75, 50, 31];
    (2 * base[(e + it as usize + m + src) % 4]).min(160)
}

#[test]
fn the_device_is_busy_for_the_model_flops_and_the_links_carry_the_model_bytes() {
    let ranks = run();
    // moe-tiny: 2 layers, hidden 64, seq 64, 4 experts (2 per rank), ffn x2; 4 sequences a rank
    let (h, s, seqs, tokens) = (64f64, 64f64, 4f64, 256f64);
    let attn = seqs * (8.0 * s * h * h + 4.0 * s * s * h);
    let head = 2.0 * tokens * h * 256.0;
    let per_token_expert = 4.0 * 2.0 * h * h;
    for (rank, r) in ranks.iter().enumerate() {
        assert_eq!(r.slept.len() as u64, ITERS * (2 * 2 * (1 + 2) + 2 + 1), "rank {rank}: one sleep per device operation");
        let ops_per_iter = r.slept.len() / ITERS as usize;
        for it in 1..=ITERS {
            let mut fwd = 2.0 * attn + head;
            for m in 0..2 {
                for e in (0..4).filter(|e| e % 2 == rank) {
                    let n: u64 = (0..2).map(|src| sent(it, m, src, e)).sum();
                    fwd += per_token_expert * n as f64;
                }
            }
            let flops = 3.0 * fwd + 12.0 * r.params as f64;
            let i = (it - 1) as usize;
            let busy: Duration = r.slept[i * ops_per_iter..(i + 1) * ops_per_iter].iter().sum();
            let predicted = flops / 1e12;
            // each operation's duration is rounded to the nanosecond
            assert!(
                (busy.as_secs_f64() - predicted).abs() <= ops_per_iter as f64 * 1e-9,
                "rank {rank}, iteration {it}: device busy {busy:?}, the model's FLOPs say {predicted} s"
            );
            // exchanges: per MoE layer the counts (2 x 8 bytes) and, forward and backward,
            // every row this rank sends and receives (64 bf16 values = 128 bytes each way);
            // then every dense gradient (4 bytes a parameter)
            let mut bytes = 4 * r.dense_params as u64;
            for m in 0..2 {
                let out: u64 = (0..4).filter(|e| e % 2 != rank).map(|e| sent(it, m, rank, e)).sum::<u64>()
                    + (0..4).filter(|e| e % 2 == rank).map(|e| sent(it, m, rank, e)).sum::<u64>();
                let inn: u64 = (0..4).filter(|e| e % 2 == rank).map(|e| (0..2).map(|src| sent(it, m, src, e)).sum::<u64>()).sum();
                bytes += 16 + 2 * 128 * (out + inn);
            }
            assert_eq!(r.comm_bytes[i], bytes, "rank {rank}, iteration {it}: training bytes");
        }
        // the state is real and changes every iteration
        for w in r.digests.windows(2) {
            assert_ne!(w[0], w[1], "rank {rank}: an iteration left the state unchanged");
        }
    }
    // dense state is data-parallel: equal on both ranks after each iteration would need equal
    // experts too; deterministic it must be
    let again = run();
    for (a, b) in ranks.iter().zip(&again) {
        assert_eq!(a.digests, b.digests, "two emulated runs diverged");
    }
}

#[test]
fn a_trace_of_another_routing_architecture_or_too_short_is_refused() {
    let (cfg, _) = config();
    let t = trace(&cfg);
    let e = Emulated::new(&cfg, 2, &device(), 1.0, Some(t.clone()), ITERS + 1, None).unwrap_err().to_string();
    assert!(e.contains("3 iterations recorded, the run needs 4"), "{e}");
    let mut other = cfg.clone();
    other.model.experts = 8;
    let e = Emulated::new(&other, 2, &device(), 1.0, Some(t.clone()), ITERS, None).unwrap_err().to_string();
    assert!(e.contains("4 experts") && e.contains("8 experts"), "{e}");
    let e = Emulated::new(&cfg, 2, &device(), 0.0, Some(t), ITERS, None).unwrap_err().to_string();
    assert!(e.contains("dilation"), "{e}");
    // MoE layers need a recorded router
    let e = Emulated::new(&cfg, 2, &device(), 1.0, None, ITERS, None).unwrap_err().to_string();
    assert!(e.contains("MoE layers") && e.contains("--routing"), "{e}");
}

/// The beds' files say their arithmetic (configs/emu-moe.toml): the checked-in router drives the
/// bed's model, and the state per rank, the device time per iteration and the expert traffic
/// are what the files say.
#[test]
fn the_beds_arithmetic_is_what_their_files_say() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let read = |p: &str| std::fs::read_to_string(format!("{root}/{p}")).unwrap();
    let cfg = TrainConfig::from_toml_str(&read("configs/emu-moe.toml")).unwrap();
    let trace = RoutingTrace::from_json_str(&read("configs/routing/moe-wide-8ranks.json"), "moe-wide-8ranks.json").unwrap();
    for (device, mean_ms, busiest_ms) in [("a100", 4.7, 6.6), ("h100", 1.4, 1.9)] {
        let d = DeviceDesc::from_toml_str(&read(&format!("configs/devices/{device}.toml"))).unwrap();
        let emu = Emulated::new(&cfg, 8, &d, 1.0, Some(trace.clone()), 40, None).unwrap();
        // rank 0's real parameters (its two experts per layer and every dense tensor) x 12 bytes
        let p = ironweave_train::trainer::rank_params(&cfg, 0, 8);
        let state = 12.0 * p.list.iter().map(|x| x.w.len()).sum::<usize>() as f64;
        assert!((state / 1e6 - 147.0).abs() < 1.0, "state per rank {:.1} MB, the file says 147", state / 1e6);
        // the memory check's estimate (before any rank starts) is close to it
        let estimate = ironweave_train::emulated::state_bytes_per_rank(&emu.model, 8);
        assert!((estimate / state - 1.0).abs() < 0.03, "estimate {estimate}, real {state}");
        // the recorded router after the capacity cut: the mean rank and the busiest one
        let params = (state / 12.0) as usize;
        let (mut worst, mut sum): (f64, f64) = (0.0, 0.0);
        for it in 1..=40 {
            for r in 0..8 {
                let ms = emu.busy(&emu.ops(it, r, params)).as_secs_f64() * 1e3;
                worst = worst.max(ms);
                sum += ms;
            }
        }
        let mean = sum / 320.0;
        assert!(
            (mean / mean_ms - 1.0).abs() < 0.05 && (worst / busiest_ms - 1.0).abs() < 0.05,
            "{device}: device time per iteration {mean:.2} ms on the mean rank, {worst:.2} ms on the busiest; the bed's file says {mean_ms} and {busiest_ms}"
        );
    }
}

/// A one-expert "MoE" configuration is emulated as the dense model it is, not a panic.
#[test]
fn a_single_expert_model_is_emulated_as_dense() {
    let (mut cfg, _) = config();
    cfg.model.experts = 1;
    cfg.model.top_k = 1;
    let shape = RoutingShape::of(&cfg, 1);
    let row = vec![vec![shape.tokens_per_rank]; shape.moe_layers];
    let trace = RoutingTrace::assemble(shape, (1..=ITERS).map(|it| (it, 0, row.clone()))).unwrap();
    let emu = Emulated::new(&cfg, 1, &device(), 1.0, Some(trace), ITERS, None).unwrap();
    let ops = emu.ops(1, 0, 1000);
    assert!(ops.iter().all(|o| !o.what.contains(".e")), "{ops:?}");
    assert_eq!(ops.iter().filter(|o| o.what.ends_with("mlp.fwd")).count(), 2);
    assert_eq!(emu.dispatched(1, 0), emu.wanted(1, 0));
}
