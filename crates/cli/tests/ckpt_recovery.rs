//! Checkpoint recovery over real processes on TCP: kill -9 ranks in the middle of training,
//! restart them, and check that everyone restores the newest committed iteration bit for bit
//! (from a peer's memory, or from the persistent tier when the replicas died too).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

fn spawn(rank: usize, world: usize, port: u16, dir: &Path, gen: u16, persist_every: u64) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .args(["selftest", "ckpt"])
        .env("IRONWEAVE_RANK", rank.to_string())
        .env("IRONWEAVE_WORLD_SIZE", world.to_string())
        .env("IRONWEAVE_LOCAL_RANK", rank.to_string())
        .env("IRONWEAVE_MASTER_ADDR", "127.0.0.1")
        .env("IRONWEAVE_MASTER_PORT", port.to_string())
        .env("IRONWEAVE_JOB_ID", format!("recovery-{port}"))
        .env("IRONWEAVE_SECRET", "s")
        .env("IRONWEAVE_TIMEOUT_S", "30")
        .env("IRONWEAVE_GENERATION", gen.to_string())
        .env("IRONWEAVE_SELFTEST_DIR", dir)
        .env("IRONWEAVE_SELFTEST_ITERS", "30")
        .env("IRONWEAVE_SELFTEST_PERSIST_EVERY", persist_every.to_string())
        .spawn()
        .expect("start a rank")
}

fn log(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("rank{rank}.log"))).unwrap_or_default()
}

/// Highest committed iteration a rank has logged.
fn committed(dir: &Path, rank: usize) -> i64 {
    log(dir, rank)
        .lines()
        .filter_map(|l| l.rsplit_once("committed ").and_then(|(_, c)| c.trim().parse().ok()))
        .max()
        .unwrap_or(-1)
}

fn wait_all(children: &mut [Child], dir: &Path, within: Duration) {
    let deadline = Instant::now() + within;
    for (i, c) in children.iter_mut().enumerate() {
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                assert!(
                    st.success(),
                    "process {i} failed: {st}\n{}",
                    (0..3).map(|r| format!("--- rank {r}\n{}", log(dir, r))).collect::<String>()
                );
                break;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!(
                    "process {i} did not finish\n{}",
                    (0..3).map(|r| format!("--- rank {r}\n{}", log(dir, r))).collect::<String>()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn setup(name: &str) -> (PathBuf, u16) {
    let dir = std::env::temp_dir().join(format!("ironweave-recovery-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // generation 0 and the re-formed ones after a kill, each on its own port
    let port = ironweave_testkit::master_port(8);
    (dir, port)
}

fn restored_line(dir: &Path, rank: usize) -> String {
    log(dir, rank)
        .lines()
        .find(|l| l.starts_with("restored"))
        .unwrap_or_else(|| panic!("rank {rank} did not restore:\n{}", log(dir, rank)))
        .to_string()
}

fn restored_iter(line: &str) -> i64 {
    line.split_whitespace().nth(2).and_then(|s| s.parse().ok()).expect("restored iteration")
}

#[test]
fn kill_9_of_a_replica_peer_then_restore_from_peer_memory() {
    let (dir, port) = setup("peer");
    let mut ranks: Vec<Child> = (0..3).map(|r| spawn(r, 3, port, &dir, 0, 0)).collect();
    // let training commit a few iterations, then kill rank 0 (it holds the replicas of ranks 1 and 2
    // and is receiving their chunks every iteration)
    let deadline = Instant::now() + Duration::from_secs(60);
    while committed(&dir, 1) < 5 {
        assert!(Instant::now() < deadline, "no progress:\n{}", log(&dir, 1));
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks[0].kill().unwrap(); // SIGKILL
    ranks[0].wait().unwrap();
    let before = (0..3).map(|r| committed(&dir, r)).max().unwrap();
    ranks[0] = spawn(0, 3, port, &dir, 1, 0);
    wait_all(&mut ranks, &dir, Duration::from_secs(120));
    let lines: Vec<String> = (0..3).map(|r| restored_line(&dir, r)).collect();
    // everyone restored the same iteration, at least the last one committed before the kill
    let its: Vec<i64> = lines.iter().map(|l| restored_iter(l)).collect();
    assert!(its.iter().all(|&i| i == its[0]) && its[0] >= before, "{lines:?} (committed before the kill: {before})");
    // the restarted rank got its state from its replica holder's memory, bit for bit
    assert!(lines[0].contains("from Peer(1) identical true"), "{}", lines[0]);
    assert!(lines[1].contains("from Local identical true") && lines[2].contains("from Local identical true"), "{lines:?}");
    // and training went on: every later iteration committed
    for r in 0..3 {
        assert_eq!(committed(&dir, r), 30, "rank {r}:\n{}", log(&dir, r));
        assert!(log(&dir, r).ends_with("done\n"));
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_rank_and_its_replica_peer_killed_together_restore_from_the_persistent_tier() {
    let (dir, port) = setup("persist");
    let mut ranks: Vec<Child> = (0..3).map(|r| spawn(r, 3, port, &dir, 0, 4)).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while committed(&dir, 2) < 9 {
        assert!(Instant::now() < deadline, "no progress:\n{}", log(&dir, 2));
        std::thread::sleep(Duration::from_millis(20));
    }
    // ranks 0 and 1 hold each other's replicas: both gone, only the files remain for them
    ranks[0].kill().unwrap();
    ranks[1].kill().unwrap();
    ranks[0].wait().unwrap();
    ranks[1].wait().unwrap();
    ranks[0] = spawn(0, 3, port, &dir, 1, 4);
    ranks[1] = spawn(1, 3, port, &dir, 1, 4);
    wait_all(&mut ranks, &dir, Duration::from_secs(120));
    let lines: Vec<String> = (0..3).map(|r| restored_line(&dir, r)).collect();
    let its: Vec<i64> = lines.iter().map(|l| restored_iter(l)).collect();
    assert!(its.iter().all(|&i| i == its[0]) && its[0] % 4 == 0 && its[0] >= 8, "{lines:?}");
    assert!(
        lines[0].contains("from Persistent identical true") && lines[1].contains("from Persistent identical true"),
        "{lines:?}"
    );
    assert!(lines[2].contains("identical true"), "{lines:?}");
    for r in 0..3 {
        assert_eq!(committed(&dir, r), 30, "rank {r}:\n{}", log(&dir, r));
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_launcher_restarts_a_killed_rank_and_the_job_recovers() {
    let (dir, _) = setup("launcher");
    let launcher = Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .args(["launch", "-n", "3", "--max-restarts", "1", "--timeout", "120", "--"])
        .arg(env!("CARGO_BIN_EXE_ironweave"))
        .args(["selftest", "ckpt"])
        .env("IRONWEAVE_TIMEOUT_S", "30")
        .env("IRONWEAVE_SELFTEST_DIR", &dir)
        .env("IRONWEAVE_SELFTEST_ITERS", "30")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while committed(&dir, 2) < 5 {
        assert!(Instant::now() < deadline, "no progress:\n{}", log(&dir, 2));
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid: String = log(&dir, 1)
        .lines()
        .find_map(|l| l.strip_prefix("start generation 0 pid ").map(str::to_string))
        .expect("rank 1 logged its pid");
    assert!(Command::new("kill").args(["-9", pid.trim()]).status().unwrap().success());
    let out = launcher.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "launcher failed: {}\n{err}\n{}", out.status, (0..3).map(|r| log(&dir, r)).collect::<String>());
    assert!(err.contains("rank 1 was killed by signal 9 (SIGKILL); restarting it as generation 1"), "{err}");
    let lines: Vec<String> = (0..3).map(|r| restored_line(&dir, r)).collect();
    assert!(lines[1].contains("from Peer(0) identical true"), "{lines:?}");
    for r in 0..3 {
        assert_eq!(committed(&dir, r), 30, "rank {r}:\n{}", log(&dir, r));
    }
    std::fs::remove_dir_all(&dir).ok();
}
