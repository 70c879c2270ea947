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
