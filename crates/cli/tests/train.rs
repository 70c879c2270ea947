//! The workload end to end: `ironweave train` on moe-tiny with 4 ranks; a rank killed with
//! SIGKILL mid-backward is restarted, everyone restores the newest committed iteration, and the
//! run ends in exactly the state of the run without the failure.

use std::process::Command;

fn train(dir: &std::path::Path, fail: Option<&str>) -> serde_json::Value {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ironweave"));
    c.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args([
            "train",
            "--config",
            "configs/moe-tiny.toml",
            "--ranks",
            "4",
            "--ckpt",
            "capricorn",
            "--iters",
            "30",
            "--report-dir",
        ])
        .arg(dir)
        .arg("--record-routing")
        .arg(dir.join("routing.json"))
        .env("IRONWEAVE_TIMEOUT_S", "60");
    if let Some(f) = fail {
        c.args(["--fail", f]);
    }
    report(&c.output().unwrap(), dir)
}

#[test]
fn kill_9_mid_backward_recovers_to_the_same_final_state() {
    let base = std::env::temp_dir().join(format!("ironweave-train-{}", std::process::id()));
    let clean = train(&base.join("clean"), None);
    let failed = train(&base.join("failed"), Some("rank=1,iter=12"));
    assert_eq!(clean["recoveries"], 0);
    assert!(failed["recoveries"].as_u64().unwrap() >= 1, "{failed}");
    assert_eq!(clean["final_state_sha256"], failed["final_state_sha256"], "the recovered run must end in the same state");
    // the router's choices were recorded by every rank, and a recovered run, which repeats the
    // iterations after its checkpoint, records the same routing as the clean run
    let routing = |d: &str| {
        let p = base.join(d).join("routing.json");
        ironweave_train::routing::RoutingTrace::from_json_str(&std::fs::read_to_string(&p).unwrap(), &p.display().to_string())
            .unwrap()
    };
    let (r_clean, r_failed) = (routing("clean"), routing("failed"));
    let cfg = ironweave_train::TrainConfig::from_toml_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/moe-tiny.toml")).unwrap(),
    )
    .unwrap();
    r_clean.check_for(&ironweave_train::routing::RoutingShape::of(&cfg, 4), 30).unwrap();
    assert_eq!(r_clean.iterations.len(), 30);
    assert_ne!(r_clean.iterations[0], r_clean.iterations[29], "the router's choices move as the model trains");
    assert_eq!(r_clean, r_failed);
    // a rank and its replica peer (0 and 1 hold each other's state) killed together: only the
    // persistent tier (every 10 iterations) has their state; the run still ends the same
    let both = train(&base.join("both"), Some("rank=0+1,iter=14"));
    assert!(both["recoveries"].as_u64().unwrap() >= 1, "{both}");
    assert_eq!(clean["final_state_sha256"], both["final_state_sha256"]);
    assert_eq!(clean["loss"], both["loss"], "the restarted rank 0 still reports every iteration");
    // a kill before anything was committed (issue 17's report: it used to give up after
    // re-forming eight times): nothing is lost, every rank starts over from the initial state
    let early = train(&base.join("early"), Some("rank=2,iter=1"));
    assert_eq!(clean["final_state_sha256"], early["final_state_sha256"], "{early}");
    let sources: Vec<&str> = early["restore_sources"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    assert_eq!(sources, ["initial state"; 4], "{early}");
    let loss = clean["loss"].as_array().unwrap();
    assert!(loss.last().unwrap().as_f64().unwrap() < loss[0].as_f64().unwrap() - 1.0, "{loss:?}");
    assert_eq!(clean["last_committed_iter"], 30);
    for key in ["strategy", "iterations", "iter_time_s", "ckpt_exposed_s", "partition_accuracy", "profiling_activations"] {
        assert!(!clean[key].is_null(), "report.json lacks {key}");
    }
    assert!(base.join("clean/trace.json").exists() && base.join("clean/timeline.svg").exists());
    // every other rank's profile beside it, each its own rank's process
    for r in 1..4 {
        let t: serde_json::Value =
            serde_json::from_slice(&std::fs::read(base.join(format!("clean/trace-rank{r}.json"))).unwrap()).unwrap();
        assert_eq!(t["traceEvents"][0]["pid"], r, "{r}");
    }
    // the recorded expert load feeds the simulator
    let sim = |model: &str| {
        Command::new(env!("CARGO_BIN_EXE_ironweave"))
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .args(["simulate", "ckpt", "--model", model, "--cluster", "configs/clusters/4x8-a100.toml"])
            .arg("--load-trace")
            .arg(base.join("clean/expert_load.json"))
            .args(["--iterations", "6", "--strategies", "none,capricorn"])
            .output()
            .unwrap()
    };
    let out = sim("configs/models/moe-tiny.toml");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("capricorn"));
    // a trace of another shape is refused with the reason
    let out = sim("configs/models/moe-gpt-32e.toml");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("load trace has 4 experts, the model 32"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&base).ok();
}

/// `ironweave` in the repository root; the output whatever the status.
fn iw(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args(args)
        .env("IRONWEAVE_TIMEOUT_S", "60")
        .output()
        .unwrap()
}

fn report(out: &std::process::Output, dir: &std::path::Path) -> serde_json::Value {
    assert!(
        out.status.success(),
        "train failed: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
}

/// Emulated compute (issue 38) on one machine: a recorded router drives the steps, the state is
/// real — a rank killed mid-backward restores from a peer's memory to exactly the clean run's
/// final state — and each rank's device-busy share and the machine's CPU share are reported.
/// Bad input (no device, an unknown device, a profile with a zero rate, a trace of another
/// routing architecture or too short, a bed that cannot fit in memory) is refused with the file
/// and the field named, before any rank starts.
#[test]
fn emulated_compute_recovers_from_kill_9_to_the_same_state() {
    let base = std::env::temp_dir().join(format!("ironweave-emulated-{}", std::process::id()));
    let trace = base.join("routing.json");
    let t = trace.to_str().unwrap();
    let rec = base.join("rec");
    // moe-tiny on 4 ranks for 12 iterations, reporting to `dir`, with `extra`
    let run = |dir: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["train", "--config", "configs/moe-tiny.toml", "--ranks", "4", "--iters", "12", "--quiet"];
        args.extend(["--report-dir", dir.to_str().unwrap()]);
        args.extend(extra);
        report(&iw(&args), dir)
    };
    run(&rec, &["--ckpt", "none", "--record-routing", t]);
    let emulated = |name: &str, fail: Option<&str>| {
        let dir = base.join(name);
        let mut args =
            vec!["--ckpt", "capricorn", "--compute", "emulated", "--device", "h100", "--routing", t, "--dilation", "20000"];
        if let Some(f) = fail {
            args.extend(["--fail", f]);
        }
        run(&dir, &args)
    };
    let clean = emulated("clean", None);
    assert_eq!(clean["compute"], "emulated H100 SXM5 80GB (dilation 20000)");
    let busy: Vec<f64> = clean["device_busy_share"].as_array().unwrap().iter().map(|b| b.as_f64().unwrap()).collect();
    assert_eq!(busy.len(), 4, "{clean}");
    assert!(busy.iter().all(|&b| b > 0.0 && b <= 1.0), "device-busy shares {busy:?}");
    let cpu = clean["cpu_busy_share"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&cpu), "{cpu}");
    assert!(clean["loss"].as_array().unwrap().iter().all(|l| l.is_null()), "emulated compute reports no loss");
    let failed = emulated("failed", Some("rank=1,iter=7"));
    assert!(failed["recoveries"].as_u64().unwrap() >= 1, "{failed}");
    assert_eq!(clean["final_state_sha256"], failed["final_state_sha256"], "the recovered emulated run ended elsewhere");
    let again = emulated("again", None);
    assert_eq!(clean["final_state_sha256"], again["final_state_sha256"], "emulated compute is deterministic");

    // bad input, refused before any rank starts
    let refused = |extra: &[&str]| {
        let mut args = vec!["train"];
        args.extend(extra);
        for (flag, default) in [("--config", "configs/moe-tiny.toml"), ("--ranks", "4"), ("--iters", "12")] {
            if !extra.contains(&flag) {
                args.extend([flag, default]);
            }
        }
        let out = iw(&args);
        assert!(!out.status.success(), "{extra:?} was accepted");
        let e = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!e.contains("ironweave launch"), "{extra:?}: ranks were started:\n{e}");
        e
    };
    let e = refused(&["--compute", "emulated", "--routing", t]);
    assert!(e.contains("needs --device"), "{e}");
    let e = refused(&["--compute", "emulated", "--device", "tpu9", "--routing", t]);
    assert!(e.contains("tpu9") && e.contains("h100"), "{e}");
    let zero = base.join("zero.toml");
    std::fs::write(&zero, "name = \"z\"\npeak_tflops = 0\nefficiency = 0.5\nmemory_gib = 80\nmemory_gbyte_s = 3350\n").unwrap();
    let e = refused(&["--compute", "emulated", "--device", zero.to_str().unwrap(), "--routing", t]);
    assert!(e.contains("zero.toml") && e.contains("peak_tflops"), "{e}");
    let e = refused(&["--compute", "emulated", "--device", "h100", "--routing", t, "--ranks", "2"]);
    assert!(e.contains("routing.json") && e.contains("on 4 ranks") && e.contains("on 2 ranks"), "{e}");
    let e = refused(&["--compute", "emulated", "--device", "h100", "--routing", t, "--iters", "13"]);
    assert!(e.contains("12 iterations recorded, the run needs 13"), "{e}");
    let e = refused(&["--device", "h100"]);
    assert!(e.contains("--compute emulated"), "{e}");
    let e = refused(&[
        "--config",
        "configs/gpt-sdp.toml",
        "--sdp",
        "full",
        "--compute",
        "emulated",
        "--device",
        "h100",
        "--routing",
        t,
    ]);
    assert!(e.contains("--routing replays a MoE router"), "{e}");
    let huge = base.join("huge.toml");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let text = std::fs::read_to_string(format!("{root}/configs/moe-tiny.toml"))
        .unwrap()
        .replace("hidden = 64", "hidden = 65536")
        .replace("path = \"data/", &format!("path = \"{root}/data/"));
    std::fs::write(&huge, text).unwrap();
    let e = refused(&["--config", huge.to_str().unwrap(), "--compute", "emulated", "--device", "h100", "--routing", t]);
    assert!(e.contains("huge.toml") && e.contains("GiB of host memory"), "{e}");
    std::fs::remove_dir_all(&base).ok();
}

/// Emulated compute on the sharded workload: every rank's device is busy, a rank killed
/// mid-backward restores its shards from a peer's memory, and the run ends in the clean run's
/// state.
#[test]
fn emulated_sharded_run_recovers_from_kill_9_to_the_same_state() {
    let base = std::env::temp_dir().join(format!("ironweave-emulated-sdp-{}", std::process::id()));
    let run = |name: &str, fail: Option<&str>| {
        let dir = base.join(name);
        let mut args = vec!["train", "--config", "configs/gpt-sdp.toml", "--sdp", "full", "--ranks", "4", "--iters", "10"];
        args.extend(["--quiet", "--ckpt", "capricorn", "--compute", "emulated", "--device", "a100", "--dilation", "2000"]);
        args.extend(["--report-dir", dir.to_str().unwrap()]);
        if let Some(f) = fail {
            args.extend(["--fail", f]);
        }
        report(&iw(&args), &dir)
    };
    let clean = run("clean", None);
    assert_eq!(clean["compute"], "emulated A100 SXM4 80GB (dilation 2000)");
    let busy: Vec<f64> = clean["device_busy_share"].as_array().unwrap().iter().map(|b| b.as_f64().unwrap()).collect();
    assert!(busy.len() == 4 && busy.iter().all(|&b| b > 0.0 && b <= 1.0), "device-busy shares {busy:?}");
    assert!(clean["loss"].as_array().unwrap().iter().all(|l| l.is_null()), "emulated compute reports no loss");
    let failed = run("failed", Some("rank=1,iter=6"));
    assert!(failed["recoveries"].as_u64().unwrap() >= 1, "{failed}");
    assert_eq!(clean["final_state_sha256"], failed["final_state_sha256"], "the recovered emulated run ended elsewhere");
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn bad_train_arguments_fail_with_a_message() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ironweave"))
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .arg("train")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["--config", "configs/moe-tiny.toml", "--fail", "rank=9,iter=3"]).contains("only 4 ranks"));
    assert!(run(&["--config", "configs/moe-tiny.toml", "--fail", "oops"]).contains("rank=R,iter=I"));
    assert!(run(&["--config", "configs/moe-tiny.toml", "--ckpt", "zip"]).contains("unknown strategy"));
    assert!(run(&["--config", "configs/nope.toml"]).contains("nope.toml"));
}

#[test]
fn bench_ckpt_prints_a_row_per_strategy() {
    let out_dir = std::env::temp_dir().join(format!("ironweave-benchckpt-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args([
            "bench",
            "ckpt",
            "--config",
            "configs/moe-tiny.toml",
            "--strategies",
            "none,capricorn",
            "--ranks",
            "2",
            "--iters",
            "4",
            "--out",
        ])
        .arg(&out_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.lines().any(|l| l.starts_with("| none |")) && stdout.lines().any(|l| l.starts_with("| capricorn |")),
        "{stdout}"
    );
    assert!(out_dir.join("ckpt.json").exists() && out_dir.join("ckpt.md").exists());
    // the comparison as bar charts in the HTML report
    let rep = Command::new(env!("CARGO_BIN_EXE_ironweave")).arg("report").arg(&out_dir).output().unwrap();
    assert!(rep.status.success(), "{}", String::from_utf8_lossy(&rep.stderr));
    let html = std::fs::read_to_string(out_dir.join("report.html")).unwrap();
    assert!(html.contains("id=\"ckpt\"") && html.contains("<rect"), "no strategy bars in the report");
    std::fs::remove_dir_all(&out_dir).ok();
}

#[test]
fn train_sdp_full_holds_a_quarter_of_the_state_and_trains_the_same() {
    let base = std::env::temp_dir().join(format!("ironweave-train-sdp-{}", std::process::id()));
    let run = |strategy: &str| -> serde_json::Value {
        let dir = base.join(strategy);
        let out = Command::new(env!("CARGO_BIN_EXE_ironweave"))
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .args(["train", "--config", "configs/gpt-sdp.toml", "--ranks", "4", "--sdp", strategy, "--iters", "2", "--quiet"])
            .arg("--report-dir")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
    };
    let (rep, full) = (run("replicated"), run("full"));
    let bytes = |v: &serde_json::Value| v["state_bytes_per_rank"].as_f64().unwrap();
    let share = bytes(&full) / bytes(&rep);
    assert!((0.25..0.26).contains(&share), "full holds {share} of the replicated state");
    let (a, b) = (rep["loss"].as_array().unwrap(), full["loss"].as_array().unwrap());
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
        assert!((x - y).abs() <= 1e-4 * x.abs(), "loss {x} vs {y}");
    }
    // hsdp without its plan is refused, naming what to run
    let out = Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args(["train", "--config", "configs/gpt-sdp.toml", "--sdp", "hsdp"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("plan sdp --json"));
    std::fs::remove_dir_all(&base).ok();
}

/// `--sdp hsdp` with Capricorn checkpoints of every rank's shards: rank 1 killed with SIGKILL
/// in the middle of iteration 5's backward; the job re-forms, every rank restores its shards
/// and ends bit-identical to the clean run (4 ranks as 2 logical hosts of 2 over loopback).
#[test]
fn train_sdp_hsdp_recovers_from_kill_9_bit_identical() {
    let base = std::env::temp_dir().join(format!("ironweave-train-sdp-kill-{}", std::process::id()));
    std::fs::create_dir_all(&base).unwrap();
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let cfg = base.join("gpt-sdp-small.toml");
    let data = root.join("data/kjv-genesis-esther.txt");
    std::fs::write(
        &cfg,
        format!(
            "name = \"gpt-sdp-small\"\n[model]\nlayers = 4\nhidden = 64\nheads = 4\nseq = 32\nexperts = 1\ntop_k = 1\n\
             capacity_factor = 1.0\nmoe_every = 1000\nffn_mult = 4\n[train]\nbatch = 2\nlr = 1e-3\nweight_decay = 0.01\n\
             seed = 42\niters = 8\n[data]\npath = {:?}\n",
            data.display().to_string()
        ),
    )
    .unwrap();
    // a plan as `ironweave plan sdp --json` writes it: the within-host share per layer
    let plan = base.join("plan.json");
    std::fs::write(
        &plan,
        r#"{"plan":{"layers":[{"name":"L0","node_fraction":0.5},{"name":"L1","node_fraction":0.25},
            {"name":"L2","node_fraction":0.75},{"name":"L3","node_fraction":0.5},{"name":"head","node_fraction":0.4}]}}"#,
    )
    .unwrap();
    let run = |name: &str, fail: Option<&str>| -> (serde_json::Value, String) {
        let dir = base.join(name);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ironweave"));
        cmd.current_dir(root)
            .args(["train", "--config"])
            .arg(&cfg)
            .args(["--ranks", "4", "--ranks-per-host", "2", "--sdp", "hsdp", "--sdp-plan"])
            .arg(&plan)
            .args(["--ckpt", "capricorn", "--quiet", "--report-dir"])
            .arg(&dir);
        if let Some(f) = fail {
            cmd.args(["--fail", f]);
        }
        let out = cmd.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{text}");
        (serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap(), text)
    };
    let (clean, _) = run("clean", None);
    let (failed, text) = run("failed", Some("rank=1,iter=5"));
    assert!(text.contains("killed by signal 9"), "the rank was not killed: {text}");
    assert!(text.contains("recovered: every rank restored iteration"), "no restore: {text}");
    assert_eq!(failed["recoveries"].as_u64(), Some(1), "{text}");
    assert_eq!(clean["recoveries"].as_u64(), Some(0));
    let sha = |v: &serde_json::Value| v["final_state_sha256"].as_str().unwrap().to_string();
    assert_eq!(sha(&clean).len(), 64);
    assert_eq!(sha(&clean), sha(&failed), "the recovered run must end bit-identical to the clean one: {text}");
    assert_eq!(clean["loss"], failed["loss"]);
    assert_eq!(failed["loss"].as_array().unwrap().len(), 8);
    std::fs::remove_dir_all(&base).ok();
}

/// A short soak: 150 iterations of moe-tiny with Capricorn checkpoints every iteration (and the
/// persistent tier every 10). Rank 0's open file descriptors stay constant after warm-up and its
/// resident memory at iteration 150 is within 5% of iteration 50 (docs/RELIABILITY.md has the
/// 1000-iteration run).
#[test]
fn soak_keeps_memory_and_descriptors_flat() {
    let dir = std::env::temp_dir().join(format!("ironweave-soak-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args(["train", "--config", "configs/moe-tiny.toml", "--ranks", "4", "--ckpt", "capricorn", "--iters", "150", "--quiet"])
        .arg("--report-dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    let col = |k: &str| -> Vec<u64> { v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect() };
    let (rss, fds) = (col("rss_bytes"), col("open_fds"));
    assert_eq!(rss.len(), 150);
    assert!(rss.iter().all(|&r| r > 0) && fds.iter().all(|&f| f > 0), "footprint not read: {rss:?} {fds:?}");
    let steady = &fds[20..];
    assert!(steady.iter().all(|&f| f == steady[0]), "open descriptors changed: {fds:?}");
    let (a, b) = (rss[49] as f64, rss[149] as f64);
    assert!((b - a).abs() <= 0.05 * a, "resident memory {a} at iteration 50, {b} at 150");
    std::fs::remove_dir_all(&dir).ok();
}

/// Emulated compute under sharded data parallelism: the report says the mode, each rank's
/// device-busy share and its host work per iteration (the compute lane's time beyond the
/// device's operations, which the simulator does not model): one entry per rank, each a part of
/// the iteration.
#[test]
fn emulated_sdp_reports_device_busy_and_host_work_per_rank() {
    let base = std::env::temp_dir().join(format!("ironweave-emulated-sdp-{}", std::process::id()));
    std::fs::create_dir_all(&base).unwrap();
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let cfg = base.join("gpt-sdp-small.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"gpt-sdp-small\"\n[model]\nlayers = 4\nhidden = 64\nheads = 4\nseq = 32\nexperts = 1\ntop_k = 1\n\
             capacity_factor = 1.0\nmoe_every = 1000\nffn_mult = 4\n[train]\nbatch = 2\nlr = 1e-3\nweight_decay = 0.01\n\
             seed = 42\niters = 5\n[data]\npath = {:?}\n",
            root.join("data/kjv-genesis-esther.txt").display().to_string()
        ),
    )
    .unwrap();
    let dir = base.join("run");
    let out = Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .current_dir(root)
        .args(["train", "--config"])
        .arg(&cfg)
        .args(["--ranks", "2", "--sdp", "full", "--ckpt", "none", "--compute", "emulated", "--device", "a100"])
        .args(["--dilation", "20000", "--quiet", "--report-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert!(r["compute"].as_str().unwrap().starts_with("emulated A100"), "{r}");
    let iters: Vec<f64> = r["iter_time_s"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let longest = iters.iter().copied().fold(0.0, f64::max);
    for key in ["device_busy_share", "host_compute_s"] {
        let v = r[key].as_array().unwrap_or_else(|| panic!("no {key}: {r}"));
        assert_eq!(v.len(), 2, "{key}: one entry per rank: {r}");
        for x in v {
            let x = x.as_f64().unwrap();
            let bound = if key == "device_busy_share" { 1.0 + 1e-6 } else { longest };
            let low_ok = if key == "device_busy_share" { x > 0.0 } else { x >= 0.0 };
            assert!(low_ok && x <= bound, "{key} {x} outside its range (bound {bound}): {r}");
        }
    }
    std::fs::remove_dir_all(&base).ok();
}

/// A training rank the launcher restarts after every rank passed the job's final barrier (the
/// board says `finished`) leaves at once with exit status 0, as documented — not 1, which a
/// launcher would count as a failure (issue 57, item 10).
#[test]
fn a_worker_restarted_after_the_job_finished_leaves_at_once_with_status_0() {
    let base = std::env::temp_dir().join(format!("ironweave-finished-{}", std::process::id()));
    let board = ironweave_transport::board::Board::create(base.join("board")).unwrap();
    board.finish().unwrap();
    let port = ironweave_testkit::master_port(4);
    let o = Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args(["train-worker", "--config", "configs/moe-tiny.toml", "--ckpt", "capricorn", "--iters", "4", "--report-dir"])
        .arg(base.join("run"))
        .env("IRONWEAVE_RANK", "1")
        .env("IRONWEAVE_WORLD_SIZE", "2")
        .env("IRONWEAVE_MASTER_ADDR", "127.0.0.1")
        .env("IRONWEAVE_MASTER_PORT", port.to_string())
        .env("IRONWEAVE_JOB_ID", format!("finished-{port}"))
        .env("IRONWEAVE_GENERATION", "1")
        .env("IRONWEAVE_JOB_BOARD", board.dir())
        // were it to wait for peers, it would wait this long and then fail
        .env("IRONWEAVE_TIMEOUT_S", "20")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("the job finished before this process could join it"), "{err}");
    let _ = std::fs::remove_dir_all(&base);
}
