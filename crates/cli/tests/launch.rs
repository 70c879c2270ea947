//! `ironweave launch`: success, a failing rank, a rank killed by a signal, and the bench
//! command's verified JSON.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ironweave");

#[test]
fn launch_runs_every_rank_with_prefixed_output() {
    let o = Command::new(BIN).args(["launch", "-n", "3", "--", BIN, "selftest", "ok"]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    for r in 0..3 {
        assert!(out.contains(&format!("[rank {r}] selftest ok rank {r} of 3 sum-correct=true")), "{out}");
    }
}

#[test]
fn a_failing_rank_is_named_with_its_status() {
    let o = Command::new(BIN)
        .args(["launch", "-n", "3", "--", "sh", "-c", "if [ \"$IRONWEAVE_RANK\" = 2 ]; then exit 3; fi; sleep 60"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("rank 2 exited with status 3"), "{err}");
}

#[test]
fn a_rank_killed_by_a_signal_is_named() {
    let o = Command::new(BIN)
        .args(["launch", "-n", "2", "--", "sh", "-c", "if [ \"$IRONWEAVE_RANK\" = 1 ]; then kill -9 $$; fi; sleep 60"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("rank 1 was killed by signal 9 (SIGKILL)"), "{err}");
}

#[test]
fn sigint_reaches_every_rank() {
    let dir = std::env::temp_dir().join(format!("iw-sigint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Each rank records the signal it got.
    let script = format!(
        "trap 'echo got > {}/$IRONWEAVE_RANK; exit 0' INT TERM; touch {}/ready$IRONWEAVE_RANK; while true; do sleep 0.05; done",
        dir.display(),
        dir.display()
    );
    let mut child = Command::new(BIN).args(["launch", "-n", "2", "--", "sh", "-c", &script]).spawn().unwrap();
    let start = std::time::Instant::now();
    while !(dir.join("ready0").exists() && dir.join("ready1").exists()) {
        assert!(start.elapsed().as_secs() < 60, "ranks never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY-free: use the kill command to send SIGINT to the launcher only.
    Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    let st = child.wait().unwrap();
    assert!(!st.success());
    for r in 0..2 {
        assert!(dir.join(r.to_string()).exists(), "rank {r} never saw the signal");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_collectives_writes_verified_json() {
    let json = std::env::temp_dir().join(format!("iw-bench-{}.json", std::process::id()));
    let o = Command::new(BIN)
        .args([
            "bench",
            "collectives",
            "--ranks",
            "3",
            "--backend",
            "tcp",
            "--ops",
            "allreduce,allgather,reducescatter,alltoall,broadcast",
        ])
        .args(["--sizes", "4K,1M", "--min-time", "0.01", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 10);
    assert!(rows.iter().all(|r| r["verified"] == serde_json::json!(true)), "{rows:?}");
    let _ = std::fs::remove_file(&json);
}

#[test]
fn disabled_backends_say_which_feature_is_missing() {
    let o = Command::new(BIN).args(["bench", "collectives", "--backend", "ucx"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("--features ucx"), "{err}");
}
