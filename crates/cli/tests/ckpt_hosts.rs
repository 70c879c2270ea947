//! Replicas on other hosts: on the emulated cluster (2 hosts x 2 ranks) every replica holder
//! of a rank is on the other host, and a whole host killed (all its ranks SIGKILLed together,
//! `--fail host=1,iter=I`) restores from the other host's memory — not the persistent tier —
//! to exactly the clean run's final state, on real and on emulated compute. Needs root and iproute2 (CI runs as root); without
//! them the test says why it is skipped.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ironweave");
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

fn iw(args: &[&str]) -> std::process::Output {
    Command::new(BIN).current_dir(ROOT).args(args).output().unwrap()
}

fn train(topo: &str, dir: &std::path::Path, fail: Option<&str>) -> serde_json::Value {
    train_with(topo, dir, fail, &[])
}

fn train_with(topo: &str, dir: &std::path::Path, fail: Option<&str>, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "train",
        "--config",
        "configs/moe-tiny.toml",
        "--topology",
        topo,
        "--ranks-per-host",
        "2",
        "--ranks",
        "4",
        "--ckpt",
        "capricorn",
        "--iters",
        "16",
        "--persist-every",
        "4",
        "--quiet",
        "--report-dir",
        dir.to_str().unwrap(),
    ];
    if let Some(f) = fail {
        args.extend(["--fail", f]);
    }
    args.extend(extra);
    let out = iw(&args);
    assert!(
        out.status.success(),
        "train {fail:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
}

#[test]
fn a_whole_host_killed_restores_from_the_other_host_s_memory() {
    if !ironweave_testkit::can_run_emulated("a_whole_host_killed_restores_from_the_other_host_s_memory") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ironweave-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let topo = dir.join("topo.toml");
    std::fs::write(
        &topo,
        "name = \"iwckh\"\nhosts = 2\n[[links]]\nname = \"a\"\nrate = \"1gbit\"\nsubnet = \"10.233.11.0/24\"\n",
    )
    .unwrap();
    let topo = topo.to_str().unwrap();
    let up = iw(&["cluster", "up", "--topology", topo]);
    assert!(up.status.success(), "{}", String::from_utf8_lossy(&up.stderr));
    let result = std::panic::catch_unwind(|| {
        let clean = train(topo, &dir.join("clean"), None);
        // every replica holder is on the other host
        let hosts: Vec<u64> = clean["hosts"].as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect();
        assert_eq!(hosts, vec![0, 0, 1, 1]);
        let holders = clean["replica_holders"].as_array().unwrap();
        for (r, hs) in holders.iter().enumerate() {
            let hs: Vec<usize> = hs.as_array().unwrap().iter().map(|h| h.as_u64().unwrap() as usize).collect();
            assert!(!hs.is_empty() && hs.iter().all(|&h| hosts[h] != hosts[r]), "rank {r} replicated on {hs:?}");
        }
        // host 1 (ranks 2 and 3) killed mid-backward of iteration 10: their newest committed
        // state is in host 0's memory (and iteration 8 in the persistent tier); memory must win
        let failed = train(topo, &dir.join("fail"), Some("host=1,iter=10"));
        assert_eq!(failed["recoveries"].as_u64(), Some(1), "{failed}");
        let sources: Vec<&str> = failed["restore_sources"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
        assert_eq!(&sources[2..], ["peer", "peer"], "the killed host's ranks restored from {sources:?}");
        assert!(sources[..2].iter().all(|s| *s == "own memory"), "{sources:?}");
        assert_eq!(failed["final_state_sha256"], clean["final_state_sha256"], "the recovered run ended elsewhere");

        // the same on emulated compute (issue 38): a router recorded on this job drives it
        let trace = dir.join("routing.json");
        let t = trace.to_str().unwrap();
        let rec = dir.join("rec");
        train_with(topo, &rec, None, &["--record-routing", t]);
        let emu = ["--compute", "emulated", "--device", "a100", "--routing", t, "--dilation", "20000"];
        let clean = train_with(topo, &dir.join("emu-clean"), None, &emu);
        assert!(clean["compute"].as_str().unwrap().starts_with("emulated A100"), "{clean}");
        let failed = train_with(topo, &dir.join("emu-fail"), Some("host=1,iter=10"), &emu);
        assert_eq!(failed["recoveries"].as_u64(), Some(1), "{failed}");
        let sources: Vec<&str> = failed["restore_sources"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
        assert_eq!(&sources[2..], ["peer", "peer"], "emulated: the killed host's ranks restored from {sources:?}");
        assert_eq!(failed["final_state_sha256"], clean["final_state_sha256"], "the recovered emulated run ended elsewhere");
    });
    let down = iw(&["cluster", "down", "--topology", topo]);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    assert!(down.status.success(), "{}", String::from_utf8_lossy(&down.stderr));
}

/// `bench ckpt` on a 2-host, 2-link emulated cluster (brought up and down by the bench): every
/// row carries the counter that shows its mechanism — checkpoint bytes on the inter-host links
/// (counted on the links) for the in-memory strategies, bytes written to the emulated storage
/// for `async`, bytes over the second link for `capricorn-multilink` — and the replay of the
/// measured run predicts every strategy beside its measured time.
#[test]
fn bench_ckpt_rows_carry_their_mechanism_and_replay() {
    if !ironweave_testkit::can_run_emulated("bench_ckpt_rows_carry_their_mechanism_and_replay") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ironweave-benchckpt-links-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let topo = dir.join("topo.toml");
    std::fs::write(
        &topo,
        // the training link slow enough that its short windows hold less than a chunk (so the
        // idle second link is where chunks must go, whatever the timing)
        "name = \"iwckb\"\nhosts = 2\n[[links]]\nname = \"a\"\nrate = \"100mbit\"\nsubnet = \"10.233.21.0/24\"\n\
         [[links]]\nname = \"b\"\nrate = \"1gbit\"\nsubnet = \"10.233.22.0/24\"\n",
    )
    .unwrap();
    let out_dir = dir.join("out");
    let json = dir.join("rows.json");
    let out = iw(&[
        "bench",
        "ckpt",
        "--config",
        "configs/moe-tiny.toml",
        "--topology",
        topo.to_str().unwrap(),
        "--ranks",
        "4",
        "--ranks-per-host",
        "2",
        "--strategies",
        "none,async,capricorn,capricorn-multilink",
        "--iters",
        "4",
        "--out",
        out_dir.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    let result = std::panic::catch_unwind(|| {
        assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        let rows = v["rows"].as_array().unwrap();
        let row = |s: &str| rows.iter().find(|r| r["strategy"] == s).unwrap_or_else(|| panic!("no {s} row: {v}"));
        for s in ["none", "async", "capricorn", "capricorn-multilink"] {
            let r = row(s);
            // the overhead is the mean's, the median's beside it, each against none's
            let (mean, med) = (r["mean_iter_s"].as_f64().unwrap(), r["iter_time_s"].as_f64().unwrap());
            let (nmean, nmed) = (row("none")["mean_iter_s"].as_f64().unwrap(), row("none")["iter_time_s"].as_f64().unwrap());
            assert!((r["overhead_vs_none"].as_f64().unwrap() - (mean / nmean - 1.0)).abs() < 1e-9, "{r}");
            assert!((r["overhead_vs_none_median"].as_f64().unwrap() - (med / nmed - 1.0)).abs() < 1e-9, "{r}");
            if s != "none" {
                assert!((r["speedup_vs"]["none"].as_f64().unwrap() - nmean / mean).abs() < 1e-9, "{r}");
            }
        }
        let n = |s: &str, k: &str| row(s)[k].as_u64().unwrap_or(0);
        // in-memory replicas cross the inter-host links, counted on the links themselves
        assert!(n("capricorn", "ckpt_bytes_inter_host") > 0 && n("capricorn", "ckpt_bytes_inter_host_sent") > 0, "{v}");
        assert_eq!(n("none", "ckpt_bytes_inter_host_sent"), 0);
        // what each replicated byte cost the cores that train: the replica threads' own clock,
        // counted (None when no thread's clock was read), and every thread's, the processes'
        // CPU against the none run of each round: the column is its rounds' (one round here)
        let cpu = row("capricorn")["replica_threads_cpu_ns_per_byte"].as_f64();
        assert!(cpu.is_some_and(|c| c > 0.0), "capricorn's replica threads' CPU was not counted: {v}");
        let rounds: Vec<f64> = row("capricorn")["ckpt_cpu_ns_per_byte_rounds"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
        assert_eq!(rounds.len(), 1, "{v}");
        assert_eq!(row("capricorn")["ckpt_cpu_ns_per_byte"].as_f64(), Some(rounds[0]), "{v}");
        assert!(row("none")["ckpt_cpu_ns_per_byte"].is_null() && row("none")["replica_threads_cpu_ns_per_byte"].is_null(), "{v}");
        // async writes to the (emulated, paced) persistent tier and sends nothing to peers
        assert!(n("async", "ckpt_bytes_storage") > 0 && row("async")["storage_bytes_per_s_per_host"].as_f64().unwrap() > 0.0);
        assert_eq!(n("async", "ckpt_bytes_inter_host_sent"), 0);
        // the second link carries chunks only when Capricorn may route over it
        let per_link = |s: &str| -> Vec<u64> {
            row(s)["ckpt_bytes_per_link"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
        };
        assert!(per_link("capricorn-multilink").len() == 2 && per_link("capricorn-multilink")[1] > 0, "{v}");
        assert_eq!(per_link("capricorn").len(), 1);
        // the measured run, replayed
        let rj = dir.join("replay.json");
        let rp = iw(&["simulate", "ckpt", "--from-report", out_dir.to_str().unwrap(), "--json", rj.to_str().unwrap()]);
        assert!(rp.status.success(), "{}", String::from_utf8_lossy(&rp.stderr));
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&rj).unwrap()).unwrap();
        for s in ["none", "async", "capricorn", "capricorn-multilink"] {
            let p = r["rows"].as_array().unwrap().iter().find(|x| x["strategy"] == s).unwrap_or_else(|| panic!("{r}"));
            assert!(
                p["predicted_iter_time_s"].as_f64().unwrap() > 0.0 && p["measured_iter_time_s"].as_f64().unwrap() > 0.0,
                "{p}"
            );
        }
    });
    // the bench took its cluster down again
    let status = iw(&["cluster", "status", "--topology", topo.to_str().unwrap()]);
    let _ = iw(&["cluster", "down", "--topology", topo.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    assert!(String::from_utf8_lossy(&status.stdout).contains("down"), "{}", String::from_utf8_lossy(&status.stdout));
}
