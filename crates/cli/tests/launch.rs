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
fn restart_all_stops_the_survivors_and_restarts_every_rank_as_the_next_generation() {
    // generation 0: rank 1 fails, rank 0 would sleep for a minute; generation 1: both print
    let script = "if [ \"$IRONWEAVE_GENERATION\" = 0 ]; then [ \"$IRONWEAVE_RANK\" = 1 ] && exit 3; sleep 60; fi; \
                  echo \"generation $IRONWEAVE_GENERATION\"";
    let o = Command::new(BIN)
        .args(["launch", "-n", "2", "--max-restarts", "1", "--restart-all", "--", "sh", "-c", script])
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("rank 1 exited with status 3; restarting it as generation 1"), "{err}");
    assert!(err.contains("rank 0 was stopped (--restart-all); restarting it as generation 1"), "{err}");
    assert!(out.contains("[rank 0] generation 1") && out.contains("[rank 1] generation 1"), "{out}");
    // without it only the failed rank comes back (rank 0 of generation 0 runs on)
    let o = Command::new(BIN)
        .args(["launch", "-n", "2", "--max-restarts", "1", "--timeout", "3", "--", "sh", "-c", script])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("rank 1 exited with status 3; restarting it as generation 1") && !err.contains("rank 0 was stopped"),
        "{err}"
    );
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
fn disabled_backends_say_which_feature_is_missing_and_doctor_agrees() {
    let o = Command::new(BIN).args(["doctor", "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reports: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = reports.iter().filter_map(|r| r["backend"].as_str()).collect();
    assert_eq!(names, ["tcp", "ucx", "verbs", "nccl"]);
    for (name, compiled) in [("ucx", cfg!(feature = "ucx")), ("verbs", cfg!(feature = "verbs")), ("nccl", cfg!(feature = "nccl"))]
    {
        let r = reports.iter().find(|r| r["backend"] == name).unwrap();
        assert_eq!(r["compiled"], serde_json::json!(compiled), "{r}");
        assert!(!r["detail"].as_str().unwrap_or("").is_empty(), "doctor must say why or what: {r}");
        let o = Command::new(BIN)
            .args(["bench", "collectives", "--ranks", "2", "--backend", name, "--ops", "allreduce", "--sizes", "4K"])
            .env("IRONWEAVE_TIMEOUT_S", "30")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        if !compiled {
            assert!(!o.status.success());
            assert!(err.contains(&format!("--features {name}")), "{err}");
        } else if r["usable"] == serde_json::json!(false) {
            // Compiled in but no hardware here: a clean error naming the reason, no panic.
            assert!(!o.status.success(), "{name} ran without being usable?");
            assert!(!err.contains("panicked"), "{err}");
            let why = r["detail"].as_str().unwrap();
            assert!(err.contains(&why[..why.len().min(30)]), "the job should fail with doctor's reason {why:?}:\n{err}");
        }
    }
    // The TCP backend always lists at least the loopback interface.
    let tcp = &reports[0];
    assert!(tcp["links"].as_array().unwrap().iter().any(|l| l["name"] == "tcp:lo"), "{tcp}");
}

#[cfg(feature = "ucx")]
#[test]
fn bench_collectives_over_ucx_verifies_every_row() {
    let json = std::env::temp_dir().join(format!("iw-ucx-bench-{}.json", std::process::id()));
    let o = Command::new(BIN)
        .args(["bench", "collectives", "--ranks", "2", "--backend", "ucx", "--ops", "allreduce,alltoall,stream,pingpong"])
        .args(["--sizes", "1M,16M", "--min-time", "0.05", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 8);
    assert!(rows.iter().all(|r| r["verified"] == serde_json::json!(true) && r["backend"] == "ucx"), "{rows:?}");
    let _ = std::fs::remove_file(&json);
}

/// Runs `launch` with `env` (thread variables removed first) and returns each rank's
/// "RAYON OMP" line and the launcher's stderr.
fn thread_vars(extra: &[&str], env: &[(&str, &str)]) -> (Vec<String>, String) {
    let mut c = Command::new(BIN);
    c.args(["launch", "-n", "2"]).args(extra).args(["--", "sh", "-c", "echo \"threads $RAYON_NUM_THREADS $OMP_NUM_THREADS\""]);
    c.env_remove("RAYON_NUM_THREADS").env_remove("OMP_NUM_THREADS");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(o.status.success(), "{out}\n{err}");
    let lines = (0..2)
        .map(|r| {
            let p = format!("[rank {r}] threads ");
            out.lines().find_map(|l| l.strip_prefix(&p)).unwrap_or_else(|| panic!("rank {r} printed nothing: {out}")).to_string()
        })
        .collect();
    (lines, err)
}

#[test]
fn the_launcher_sets_compute_threads_per_rank_and_keeps_the_users() {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let fair = (cores / 2).max(1);
    // default: cores / ranks on this host, both variables, said once
    let (ranks, err) = thread_vars(&[], &[]);
    assert_eq!(ranks, vec![format!("{fair} {fair}"); 2]);
    assert_eq!(err.matches("compute thread").count(), 1, "{err}");
    assert!(err.contains(&format!("{cores} cores / 2 ranks on this host")), "{err}");
    // a user's value is kept, and fills in the variable left unset
    let (ranks, err) = thread_vars(&[], &[("OMP_NUM_THREADS", "3")]);
    assert_eq!(ranks, vec!["3 3".to_string(); 2]);
    assert!(err.contains("OMP_NUM_THREADS set by the user"), "{err}");
    let (ranks, _) = thread_vars(&[], &[("RAYON_NUM_THREADS", "5"), ("OMP_NUM_THREADS", "7")]);
    assert_eq!(ranks, vec!["5 7".to_string(); 2]);
    // the flag overrides both
    let (ranks, err) = thread_vars(&["--threads-per-rank", "4"], &[("RAYON_NUM_THREADS", "5")]);
    assert_eq!(ranks, vec!["4 4".to_string(); 2]);
    assert!(err.contains("(--threads-per-rank)"), "{err}");
    // nonsense is refused before anything starts
    let o = Command::new(BIN).args(["launch", "-n", "2", "--", "true"]).env("RAYON_NUM_THREADS", "many").output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("RAYON_NUM_THREADS=\"many\""));
}

/// A job board that cannot be written is the launcher's error, with the path and the free
/// space, before any rank starts; a rank that could not write it (exit status 74) stops the
/// job, named with the board's path and free space, and is not restarted (issue 57, item 9).
#[test]
fn a_board_that_cannot_be_written_is_reported_with_its_path_and_free_space() {
    // the temporary directory is a regular file: no board can be made under it, even by root
    let file = std::env::temp_dir().join(format!("iw-no-board-{}", std::process::id()));
    std::fs::write(&file, b"x").unwrap();
    let o = Command::new(BIN).args(["launch", "-n", "2", "--", "true"]).env("TMPDIR", &file).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("cannot be written") && err.contains(&*file.to_string_lossy()) && err.contains("bytes free of"),
        "{err}"
    );
    std::fs::remove_file(&file).unwrap();
    // a rank that says the board failed it: reported, and not restarted although restarts are left
    let o = Command::new(BIN)
        .args(["launch", "-n", "2", "--max-restarts", "3", "--", "sh", "-c", "[ \"$IRONWEAVE_RANK\" = 1 ] && exit 74; sleep 60"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(74), "{err}");
    assert!(err.contains("rank 1 could not write the job board") && err.contains("bytes free of"), "{err}");
    assert!(!err.contains("restarting it"), "{err}");
}
