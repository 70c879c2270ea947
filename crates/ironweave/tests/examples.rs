//! The examples run as a user runs them: `data_parallel` as a 2-rank job (this test plays the
//! launcher, as torchrun would), stopped and started again to resume from its checkpoint, and
//! `plan` on the descriptions under configs/.

use std::path::{Path, PathBuf};
use std::process::Command;

fn example(name: &str) -> PathBuf {
    // cargo test builds the package's examples next to the test binary's folder
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let p = dir.join("examples").join(name);
    assert!(p.exists(), "{} is missing: `cargo test` builds examples; was it run with --tests only?", p.display());
    p
}

/// Runs `data_parallel ITERS DIR` on two ranks; returns each rank's stdout.
fn job(iters: u64, dir: &Path) -> Vec<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let kids: Vec<_> = (0..2)
        .map(|r| {
            Command::new(example("data_parallel"))
                .args([iters.to_string(), dir.display().to_string()])
                .env("IRONWEAVE_RANK", r.to_string())
                .env("IRONWEAVE_WORLD_SIZE", "2")
                .env("IRONWEAVE_MASTER_ADDR", "127.0.0.1")
                .env("IRONWEAVE_MASTER_PORT", port.to_string())
                .env("IRONWEAVE_JOB_ID", format!("example-{port}"))
                .env("IRONWEAVE_TIMEOUT_S", "60")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    kids.into_iter()
        .enumerate()
        .map(|(r, k)| {
            let o = k.wait_with_output().unwrap();
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            assert!(o.status.success(), "rank {r}: {out}\n{}", String::from_utf8_lossy(&o.stderr));
            out
        })
        .collect()
}

fn last_line(s: &str) -> &str {
    s.lines().last().unwrap_or("")
}

#[test]
fn data_parallel_example_resumes_from_its_checkpoint_where_it_left_off() {
    let base = std::env::temp_dir().join(format!("iw-example-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let clean = job(10, &base.join("clean"));
    let first = job(6, &base.join("resumed"));
    assert!(first[0].contains("last committed Some(6)"), "{}", first[0]);
    let second = job(10, &base.join("resumed"));
    for r in 0..2 {
        assert!(second[r].contains("restored iteration 6 from"), "rank {r}: {}", second[r]);
        // the resumed job ends where the uninterrupted one does, to the last digit printed
        assert_eq!(last_line(&second[r]), last_line(&clean[r]), "rank {r}");
    }
    assert!(last_line(&clean[0]).contains("10 iterations"), "{}", clean[0]);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn plan_example_plans_a_model_on_a_cluster() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let o = Command::new(example("plan"))
        .args([format!("{root}/configs/models/gpt-2.7b.toml"), format!("{root}/configs/clusters/32x3090-pcie.toml")])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("Oases plan for") && out.contains("TP ") && out.contains("HSDP"), "{out}");
}

/// The `ironweave` command (crates/cli), built beside the examples by `cargo test --workspace`.
fn cli() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().and_then(Path::parent).unwrap().join("ironweave");
    assert!(
        p.exists(),
        "{} is missing: these tests launch ranks with the CLI; run `cargo test --workspace` (or build -p ironweave-cli)",
        p.display()
    );
    p
}

/// Runs `ironweave launch ARGS` to the end (at most `secs`), calling `on_line` with each line
/// the ranks print; returns every line. Panics when the job fails or outlives its deadline.
fn launch(args: &[String], secs: u64, mut on_line: impl FnMut(&str)) -> Vec<String> {
    use std::io::BufRead;
    let mut child = Command::new(cli())
        .arg("launch")
        .args(args)
        .env("IRONWEAVE_TIMEOUT_S", "30")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let errs = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut lines = Vec::new();
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(l) => {
                on_line(&l);
                lines.push(l);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the job outlived its {secs} s deadline; so far:\n{}", lines.join("\n"));
        }
    }
    let status = child.wait().unwrap();
    let errs = errs.join().unwrap();
    assert!(status.success(), "launch {args:?}: {status}\n{}\n{errs}", lines.join("\n"));
    lines
}

fn final_states(lines: &[String]) -> Vec<String> {
    lines.iter().filter_map(|l| l.split_once("final state ").map(|(_, d)| d.trim().to_string())).collect()
}

/// `elastic_train` on 4 ranks under `layout`: once clean, once with rank 1 killed by SIGKILL
/// as soon as it has finished iteration 10 (it dies inside iteration 11) and restarted by the
/// launcher. Every rank restores from memory (own or a peer's), and the job ends in the clean
/// run's state, to the last bit.
fn elastic_kill_9(layout: &str) {
    let ex = example("elastic_train").display().to_string();
    let args = |restarts: &str| -> Vec<String> {
        ["-n", "4", "--no-prefix", "--max-restarts", restarts, "--", &ex, "60", layout].iter().map(|s| s.to_string()).collect()
    };
    let clean = launch(&args("0"), 300, |_| {});
    let clean_state = final_states(&clean);
    assert_eq!(clean_state.len(), 4, "{clean:?}");
    let mut pid: Option<String> = None;
    let mut killed = false;
    let run = launch(&args("2"), 300, |l| {
        if let Some(rest) = l.strip_prefix("rank 1 pid ") {
            pid = rest.split_whitespace().next().map(String::from);
        }
        if !killed && l.starts_with("rank 1: iteration 10 ") {
            let p = pid.clone().expect("rank 1 printed its pid first");
            let st = Command::new("kill").args(["-9", &p]).status().unwrap();
            assert!(st.success(), "kill -9 {p}");
            killed = true;
        }
    });
    assert!(killed, "rank 1 never reached iteration 10: {run:?}");
    let restored: Vec<&String> = run.iter().filter(|l| l.contains(": restored iteration ")).collect();
    assert_eq!(restored.len(), 4, "every rank restores once: {run:?}");
    for l in &restored {
        assert!(l.ends_with("from own memory") || l.ends_with("from peer"), "restored from memory, not {l}");
    }
    // the restarted rank restored from its replica holder's memory
    assert!(restored.iter().any(|l| l.starts_with("rank 1:") && l.ends_with("from peer")), "{restored:?}");
    // and the job ends where the uninterrupted one does, to the last bit
    assert_eq!(final_states(&run), clean_state, "{run:?}");
}

#[test]
fn elastic_train_survives_kill_9_from_peers_memory_bit_identical() {
    elastic_kill_9("dp");
}

#[test]
fn elastic_sharded_train_survives_kill_9_from_peers_memory_bit_identical() {
    elastic_kill_9("full");
}

#[test]
fn sharded_train_follows_data_parallel_with_a_quarter_of_the_state() {
    let ex = example("sharded_train").display().to_string();
    let run = |mode: &str| -> (Vec<f64>, Vec<u64>) {
        let args: Vec<String> = ["-n", "4", "--no-prefix", "--", &ex, mode, "10", "2"].iter().map(|s| s.to_string()).collect();
        let lines = launch(&args, 300, |_| {});
        let loss: Vec<f64> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("iteration ").and_then(|r| r.split_once(" loss ")).map(|(_, x)| x.parse().unwrap()))
            .collect();
        let bytes: Vec<u64> = lines
            .iter()
            .filter_map(|l| l.split_once(" holds ").and_then(|(_, r)| r.split_whitespace().next()).map(|x| x.parse().unwrap()))
            .collect();
        assert_eq!((loss.len(), bytes.len()), (10, 4), "{mode}: {lines:?}");
        (loss, bytes)
    };
    let (dp, dp_bytes) = run("dp");
    assert!(dp[9] < dp[0], "the model learns: {dp:?}");
    for mode in ["full", "hsdp"] {
        let (l, bytes) = run(mode);
        for (i, (a, b)) in dp.iter().zip(&l).enumerate() {
            assert!((a - b).abs() <= 1e-4, "{mode} iteration {}: {b} vs data parallel {a}", i + 1);
        }
        if mode == "full" {
            // a quarter of the parameters and moments (shards padded to equal blocks)
            for b in &bytes {
                assert!((*b as f64) <= dp_bytes[0] as f64 / 4.0 * 1.01 + 64.0, "full holds {b} of {}", dp_bytes[0]);
                assert!((*b as f64) >= dp_bytes[0] as f64 / 4.0 * 0.99, "full holds {b} of {}", dp_bytes[0]);
            }
        }
    }
}
