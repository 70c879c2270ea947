//! Emulated compute of the dense workloads over TCP: the sharded (FULL_SHARD, 4 ranks) and the
//! tensor-parallel (degree 2, Megatron's and Oases' schedules) ranks keep their device busy for
//! exactly the time the configured model's FLOP count predicts (computed here from the formulas,
//! not from the library's code), the state changes every iteration, and two runs end in the same
//! digests.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ironweave_overlap::Schedule;
use ironweave_plan::DeviceDesc;
use ironweave_sdp::{Groups, Strategy};
use ironweave_tcp::TcpConfig;
use ironweave_train::data::Corpus;
use ironweave_train::device::Sleep;
use ironweave_train::emulated::Emulated;
use ironweave_train::sdp::SdpTrainer;
use ironweave_train::tp::{TpSpec, TpTrainer};
use ironweave_train::TrainConfig;
use ironweave_transport::{CommOptions, Communicator};

#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<Duration>>);

impl Sleep for Recorder {
    fn sleep(&self, d: Duration) {
        self.0.lock().unwrap().push(d);
    }
}

fn config(file: &str) -> (TrainConfig, Corpus) {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let c = TrainConfig::from_toml_str(&std::fs::read_to_string(format!("{root}/configs/{file}")).unwrap()).unwrap();
    let corpus = Corpus::load(std::path::Path::new(&format!("{root}/{}", c.data.path)), c.model.seq).unwrap();
    (c, corpus)
}

/// 1 TFLOP/s, memory so fast that every operation is compute-bound.
fn device() -> DeviceDesc {
    DeviceDesc::from_toml_str("name = \"test\"\npeak_tflops = 1.0\nefficiency = 1.0\nmemory_gib = 1.0\nmemory_gbyte_s = 1e9\n")
        .unwrap()
}

const ITERS: u64 = 3;

/// Forward FLOPs of one attention and one MLP block (ffn x4) on `seqs` sequences, split over
/// `d` devices, and of the byte-vocabulary head.
fn flops(h: f64, s: f64, seqs: f64, d: f64) -> (f64, f64, f64) {
    let attn = seqs * (8.0 * s * h * h + 4.0 * s * s * h) / d;
    let mlp = seqs * 16.0 * s * h * h / d;
    (attn, mlp, seqs * 2.0 * s * h * 256.0)
}

fn world(n: usize) -> Vec<Communicator> {
    let tcp = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..TcpConfig::default() };
    ironweave_tcp::local_world(n, &tcp, CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() }).unwrap()
}

struct Ran {
    /// Device time per iteration.
    busy: Vec<Duration>,
    ops: usize,
    digests: Vec<[u8; 32]>,
    /// Parameters the rank's optimizer updates.
    params: usize,
}

/// Runs `ITERS` iterations of `step` on every rank with a recording device.
fn ranks<T: Send + 'static>(
    n: usize,
    cfg: &TrainConfig,
    make: impl Fn(&Communicator) -> T + Send + Sync + 'static,
    step: impl Fn(&mut T, &Emulated) + Send + Sync + 'static,
    digest: impl Fn(&T) -> [u8; 32] + Send + Sync + 'static,
    params: impl Fn(&T) -> usize + Send + Sync + 'static,
) -> Vec<Ran> {
    let f = Arc::new((make, step, digest, params));
    let hs: Vec<_> = world(n)
        .into_iter()
        .map(|comm| {
            let (cfg, f) = (cfg.clone(), f.clone());
            std::thread::spawn(move || {
                let rec = Arc::new(Recorder::default());
                let emu = Emulated::new(&cfg, n, &device(), 1.0, None, ITERS, Some(rec.clone())).unwrap();
                let mut t = (f.0)(&comm);
                let mut digests = vec![(f.2)(&t)];
                let mut busy = Vec::new();
                let mut ops = 0;
                for _ in 0..ITERS {
                    (f.1)(&mut t, &emu);
                    let (b, k) = emu.device.take_busy();
                    busy.push(b);
                    ops = k as usize;
                    digests.push((f.2)(&t));
                }
                let slept: Duration = rec.0.lock().unwrap().iter().sum();
                assert_eq!(slept, busy.iter().sum::<Duration>(), "the device's count is what it slept");
                Ran { busy, ops, digests, params: (f.3)(&t) }
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn check(ran: &[Ran], forward: f64, ops: usize) {
    for (rank, r) in ran.iter().enumerate() {
        assert_eq!(r.ops, ops, "rank {rank}: device operations per iteration");
        let predicted = (3.0 * forward + 12.0 * r.params as f64) / 1e12;
        for (i, b) in r.busy.iter().enumerate() {
            // each operation's duration is rounded to the nanosecond
            assert!(
                (b.as_secs_f64() - predicted).abs() <= ops as f64 * 1e-9,
                "rank {rank}, iteration {}: device busy {b:?}, the model's FLOPs say {predicted} s",
                i + 1
            );
        }
        for w in r.digests.windows(2) {
            assert_ne!(w[0], w[1], "rank {rank}: an iteration left the state unchanged");
        }
    }
}

fn sdp_run(cfg: &TrainConfig, corpus: &Corpus) -> Vec<Ran> {
    let (c, corpus) = (cfg.clone(), corpus.clone());
    ranks(
        4,
        cfg,
        move |w| {
            let groups = Groups::new(w, 2, 0, 0).unwrap();
            SdpTrainer::new(c.clone(), corpus.clone(), w, groups, Strategy::Full, &[]).unwrap()
        },
        |t, emu| {
            let s = t.step_emulated(emu).unwrap();
            assert!(s.loss.is_nan(), "emulated compute learns nothing and says so");
        },
        SdpTrainer::state_digest,
        // parameters, gradients and both moments of the shards, 4 bytes each
        |t| (t.state_bytes_per_rank() / 16) as usize,
    )
}

#[test]
fn a_sharded_rank_is_busy_for_the_model_flops() {
    let (cfg, corpus) = config("gpt-sdp.toml");
    // gpt-sdp: 8 layers, hidden 256, 64-byte sequences, 2 sequences a rank
    let (attn, mlp, head) = flops(256.0, 64.0, 2.0, 1.0);
    let ran = sdp_run(&cfg, &corpus);
    // per layer forward (attention, MLP) and backward; the head's forward and backward; AdamW
    check(&ran, 8.0 * (attn + mlp) + head, 8 * 4 + 2 + 1);
    let again = sdp_run(&cfg, &corpus);
    for (a, b) in ran.iter().zip(&again) {
        assert_eq!(a.digests, b.digests, "two emulated runs diverged");
    }
}

fn tp_run(cfg: &TrainConfig, corpus: &Corpus, schedule: Schedule, k: usize) -> Vec<Ran> {
    let (c, corpus) = (cfg.clone(), corpus.clone());
    ranks(
        2,
        cfg,
        move |w| TpTrainer::new(c.clone(), corpus.clone(), Some(w), TpSpec::uniform(2, schedule, k)).unwrap(),
        |t, emu| {
            let s = t.step_emulated(emu).unwrap();
            assert!(s.loss.is_nan(), "emulated compute learns nothing and says so");
            assert!(s.stats.comm_s.iter().sum::<f64>() > 0.0, "the all-reduces ran");
        },
        TpTrainer::state_digest,
        |t| t.params.list.iter().map(|p| p.w.len()).sum(),
    )
}

#[test]
fn a_tensor_parallel_rank_is_busy_for_the_model_flops_under_either_schedule() {
    let (cfg, corpus) = config("gpt-tp.toml");
    // gpt-tp: 4 layers, hidden 256, 128-byte sequences, the group's 8 sequences, each rank half
    // of every split matrix; the head is replicated in the group
    let (attn, mlp, head) = flops(256.0, 128.0, 8.0, 2.0);
    let forward = 4.0 * (attn + mlp) + head;
    let megatron = tp_run(&cfg, &corpus, Schedule::Megatron, 1);
    // per sub-layer a forward and a backward, the head's two, AdamW
    check(&megatron, forward, 8 * 2 + 2 + 1);
    let oases = tp_run(&cfg, &corpus, Schedule::Oases, 2);
    // the same work in two sub-batches
    check(&oases, forward, 2 * (8 * 2 + 2) + 1);
    for (a, b) in megatron.iter().zip(&oases) {
        assert_eq!(a.digests, b.digests, "the schedule changed the state");
    }
}

/// The dense beds' files say their arithmetic (configs/emu-gpt-sdp.toml, configs/emu-gpt-tp.toml):
/// the device time per iteration the emulation runs is what they say.
#[test]
fn the_dense_beds_arithmetic_is_what_their_files_say() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let read = |p: &str| std::fs::read_to_string(format!("{root}/{p}")).unwrap();
    let ms = |emu: &Emulated, ops: &[ironweave_train::emulated::DeviceOp]| emu.busy(ops).as_secs_f64() * 1e3;
    let sdp = TrainConfig::from_toml_str(&read("configs/emu-gpt-sdp.toml")).unwrap();
    let tp = TrainConfig::from_toml_str(&read("configs/emu-gpt-tp.toml")).unwrap();
    for (device, sdp_ms, tp_ms) in [("a100", 7.7, 5.1), ("h100", 2.2, 1.5)] {
        let d = DeviceDesc::from_toml_str(&read(&format!("configs/devices/{device}.toml"))).unwrap();
        // a rank of 4 under FULL_SHARD: forward and backward of every layer and the head (the
        // optimizer on a quarter of the 38 M parameters is a fraction of a percent)
        let emu = Emulated::new(&sdp, 4, &d, 1.0, None, 8, None).unwrap();
        let got = ms(&emu, &emu.ops(1, 0, 0));
        assert!((got / sdp_ms - 1.0).abs() < 0.05, "{device}: sharded bed {got:.2} ms per iteration, the file says {sdp_ms}");
        // a rank of the degree-2 group: half of every sub-layer on the group's 4 sequences,
        // the replicated head
        let emu = Emulated::new(&tp, 2, &d, 1.0, None, 8, None).unwrap();
        let mut ops = Vec::new();
        for _ in 0..tp.model.layers {
            for f in [emu.attn_forward_on(4.0, 2), emu.mlp_forward_on(4.0, 2)] {
                ops.push(Emulated::backward(&f));
                ops.push(f);
            }
        }
        let head = emu.head_forward_on(4.0);
        ops.push(Emulated::backward(&head));
        ops.push(head);
        let got = ms(&emu, &ops);
        assert!(
            (got / tp_ms - 1.0).abs() < 0.05,
            "{device}: tensor-parallel bed {got:.2} ms per iteration, the file says {tp_ms}"
        );
    }
}
