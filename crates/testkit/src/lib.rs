//! ironweave-testkit: what the workspace's test trees share, as cargo-test-support is for
//! cargo. A dev-dependency only; nothing in a library or binary depends on it.
//!
//! - [`target_bin`], [`example`], [`repo_root`], [`tmpdir`]: the binaries and examples
//!   `cargo test --workspace` built beside the test, and scratch directories;
//! - [`master_port`]: a rendezvous port for a job a test plays the launcher of;
//! - [`launch`] / [`Launch`]: ranks under the real `ironweave launch`, their output streamed
//!   line by line to the test, every wait with a deadline; [`final_states`] reads the digests
//!   the examples print;
//! - [`chromium`]: headless Chromium with the flags this machine kind needs;
//! - [`can_run_emulated`] and [`skip`]: the emulated cluster's precondition, and a skip that is
//!   counted as a skip (`scripts/test.sh`), never as a pass;
//! - [`SplitMix64`]: the workspace's seeded generator.
//!
//! ```no_run
//! let lines = ironweave_testkit::Launch::new(&["-n", "2", "--", "/bin/echo", "final state ab"]).run(|_| {});
//! assert_eq!(ironweave_testkit::final_states(&lines), ["ab", "ab"]);
//! ```

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use ironweave_transport::testing::skip;
pub use ironweave_units::SplitMix64;

/// The repository's root (where `configs/`, `topologies/` and `scripts/` are).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository root exists")
}

/// The directory `cargo test` put this test's binary's siblings in (`target/<profile>`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/<test> -> target/<profile>
    exe.parent().and_then(Path::parent).expect("the test binary lives in target/<profile>/deps").to_path_buf()
}

/// A binary of the workspace built beside this test (`ironweave`, `airq`): `cargo test
/// --workspace` builds every binary before it runs the tests. Panics saying how to build it.
pub fn target_bin(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace` (or build the binary `{name}` first)",
        p.display()
    );
    p
}

/// An example of the workspace built beside this test (`cargo test` builds a package's
/// examples). Panics saying how to build it.
pub fn example(name: &str) -> PathBuf {
    let p = profile_dir().join("examples").join(name);
    assert!(p.exists(), "{} is missing: `cargo test` builds examples; was it run with --tests only?", p.display());
    p
}

/// A fresh, empty directory for this process under the system's temporary directory.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ironweave-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creating a temporary directory");
    d
}

/// A rendezvous port (`IRONWEAVE_MASTER_PORT`) for a job this test starts itself, free with
/// the next `generations - 1` ports (generation `g` listens on `port + g`), below the kernel's
/// ephemeral range so no outgoing connection of the job's can take a later generation's port
/// (see [`ironweave_transport::rendezvous::free_base_port`]).
pub fn master_port(generations: u16) -> u16 {
    ironweave_transport::rendezvous::free_base_port(generations).expect("a free rendezvous port")
}

/// A job under `ironweave launch ARGS` (the workspace's own launcher), run to its end.
#[derive(Debug, Clone)]
pub struct Launch {
    args: Vec<String>,
    env: Vec<(String, String)>,
    deadline: Duration,
}

impl Launch {
    /// `ironweave launch ARGS`, with every wait's deadline `IRONWEAVE_TIMEOUT_S=30` and the whole
    /// job's 300 s.
    pub fn new<S: AsRef<str>>(args: &[S]) -> Launch {
        Launch {
            args: args.iter().map(|a| a.as_ref().to_string()).collect(),
            env: vec![("IRONWEAVE_TIMEOUT_S".into(), "30".into())],
            deadline: Duration::from_secs(300),
        }
    }

    /// Sets a variable in the launcher's environment (its ranks inherit it).
    pub fn env(mut self, key: &str, value: &str) -> Launch {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.into(), value.into()));
        self
    }

    /// The whole job's deadline.
    pub fn deadline(mut self, d: Duration) -> Launch {
        self.deadline = d;
        self
    }

    /// Runs the job, calling `on_line` with each line the ranks print on standard output as it
    /// comes; returns every line. Panics when the job fails (with its output and errors) or
    /// outlives its deadline (the launcher is killed first).
    pub fn run(&self, mut on_line: impl FnMut(&str)) -> Vec<String> {
        let mut child = Command::new(target_bin("ironweave"))
            .arg("launch")
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting ironweave launch");
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let errs = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + self.deadline;
        let mut lines = Vec::new();
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(l) => {
                    on_line(&l);
                    lines.push(l);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the job outlived its {:?} deadline; so far:\n{}", self.deadline, lines.join("\n"));
            }
        }
        let status = child.wait().expect("waiting for ironweave launch");
        let errs = errs.join().unwrap_or_default();
        assert!(status.success(), "launch {:?}: {status}\n{}\n{errs}", self.args, lines.join("\n"));
        lines
    }
}

impl Launch {
    /// [`Launch::run`], killing rank `rank` with SIGKILL as soon as it prints `rank R:
    /// iteration N ` (it dies inside iteration N + 1). The rank must print `rank R pid P`
    /// before. Panics when it never reached iteration N.
    pub fn run_killing(&self, rank: usize, after_iter: u64) -> Vec<String> {
        let (pid_line, iter_line) = (format!("rank {rank} pid "), format!("rank {rank}: iteration {after_iter} "));
        let mut pid: Option<String> = None;
        let mut killed = false;
        let run = self.run(|l| {
            if let Some(rest) = l.strip_prefix(&pid_line) {
                pid = rest.split_whitespace().next().map(String::from);
            }
            if !killed && l.starts_with(&iter_line) {
                let p = pid.clone().unwrap_or_else(|| panic!("rank {rank} printed its pid first"));
                let st = Command::new("kill").args(["-9", &p]).status().expect("running kill");
                assert!(st.success(), "kill -9 {p}");
                killed = true;
            }
        });
        assert!(killed, "rank {rank} never reached iteration {after_iter}: {run:?}");
        run
    }
}

/// The lines of an elastic job after one rank was killed once: every one of `world` ranks
/// restored once, from memory (its own or a peer's), and the killed rank from a peer.
pub fn assert_restored_from_memory(run: &[String], world: usize, killed: usize) {
    let restored: Vec<&String> = run.iter().filter(|l| l.contains(": restored iteration ")).collect();
    assert_eq!(restored.len(), world, "every rank restores once: {run:?}");
    for l in &restored {
        assert!(l.ends_with("from own memory") || l.ends_with("from peer"), "restored from memory, not {l}");
    }
    let from_peer = format!("rank {killed}:");
    assert!(restored.iter().any(|l| l.starts_with(&from_peer) && l.ends_with("from peer")), "{restored:?}");
}

/// The built `ironweave` binary, to run from the repository's root (where `configs/` and
/// `topologies/` are).
pub fn ironweave() -> Command {
    let mut c = Command::new(target_bin("ironweave"));
    c.current_dir(repo_root());
    c
}

/// Runs `cmd` with `--json PATH` appended, to its end: panics with its output unless it
/// succeeds; returns the JSON document it wrote and its output (standard output, then errors).
pub fn json_of(cmd: &mut Command, json: &Path) -> (serde_json::Value, String) {
    let out = cmd.arg("--json").arg(json).output().expect("starting the command");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?}: {}\n{text}", out.status);
    let bytes = std::fs::read(json).unwrap_or_else(|e| panic!("{cmd:?} wrote no {}: {e}\n{text}", json.display()));
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: not JSON: {e}\n{text}", json.display()));
    (v, text)
}

/// [`Launch::run`] of `ironweave launch ARGS` with a deadline of `secs`.
pub fn launch<S: AsRef<str>>(args: &[S], secs: u64, on_line: impl FnMut(&str)) -> Vec<String> {
    Launch::new(args).deadline(Duration::from_secs(secs)).run(on_line)
}

/// The digests ranks print as `... final state HEX` (one per line that says it).
pub fn final_states(lines: &[String]) -> Vec<String> {
    lines.iter().filter_map(|l| l.split_once("final state ").map(|(_, d)| d.trim().to_string())).collect()
}

/// Headless Chromium with the flags this machine needs (no network, no sandbox as root, a
/// fresh profile in `profile`). Panics saying how to install it.
pub fn chromium(profile: &Path) -> Command {
    let exe = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
        .expect("headless Chromium is needed for this test: apt-get install chromium (scripts/deps.sh does)");
    let mut c = Command::new(exe);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    c
}

/// Whether the emulated cluster can run here (root and iproute2). When it cannot, `test` is
/// reported as skipped ([`skip`]: on the real standard error past the harness's capture, and
/// counted in the skip log `scripts/test.sh` sums up) — unless `IRONWEAVE_REQUIRE_EMULATED=1`
/// (set by `.ci/run`, which runs as root): then a test that cannot run fails instead.
pub fn can_run_emulated(test: &str) -> bool {
    let root = Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false);
    let ip = Command::new("ip").args(["netns", "list"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !(root && ip) {
        let reason = format!("the emulated cluster needs root and iproute2 (root={root}, ip={ip})");
        assert!(
            std::env::var("IRONWEAVE_REQUIRE_EMULATED").as_deref() != Ok("1"),
            "{test}: {reason}, and IRONWEAVE_REQUIRE_EMULATED=1 forbids skipping it"
        );
        skip(test, &reason);
    }
    root && ip
}
