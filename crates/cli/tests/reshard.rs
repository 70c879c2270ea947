//! Checkpoints that load onto another layout (issue 30): a MoE job written by 4 ranks resumes
//! on 2 and one written by 2 resumes on 4 — every rank reads only the tensors its experts need
//! — and the layout-free digest of the state as loaded equals the writer's at that iteration;
//! `ckpt inspect` verifies the files and says the same digest, and so does `ckpt reshard`'s
//! rewrite for the other world size; a kill in the middle of a
//! persistent write leaves an incomplete iteration that inspection and a resume pass over.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// `ironweave`, run from the repository root.
fn ironweave() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ironweave"));
    c.current_dir(root());
    c
}

/// Runs `c`: whether it succeeded, and its standard output and error together.
fn output(c: &mut Command) -> (bool, String) {
    let out = c.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ironweave-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `ironweave train` on moe-tiny with `ranks`, `iters`, a persistent write every 3 iterations,
/// plus `extra`; returns report.json.
fn train(dir: &Path, ranks: usize, iters: u64, extra: &[&str], env: &[(&str, &str)]) -> (bool, serde_json::Value, String) {
    train_cfg("configs/moe-tiny.toml", dir, ranks, iters, extra, env)
}

fn train_cfg(
    config: &str,
    dir: &Path,
    ranks: usize,
    iters: u64,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (bool, serde_json::Value, String) {
    let (ok, text) = output(
        ironweave()
            .args(["train", "--config", config, "--quiet", "--persist-every", "3"])
            .args(["--ranks", &ranks.to_string(), "--iters", &iters.to_string(), "--report-dir"])
            .arg(dir)
            .args(extra)
            .envs(env.iter().copied()),
    );
    let rep = std::fs::read(dir.join("report.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    (ok, rep, text)
}

fn inspect(dir: &Path) -> (serde_json::Value, String) {
    let json = dir.with_extension("inspect.json");
    let (ok, text) = output(ironweave().args(["ckpt", "inspect"]).arg(dir).arg("--json").arg(&json));
    assert!(ok, "{text}");
    (serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap(), text)
}

#[test]
fn a_moe_checkpoint_of_4_ranks_loads_onto_2_and_one_of_2_onto_4_bit_exact() {
    let base = tmp("reshard");
    for (from, to) in [(4usize, 2usize), (2, 4)] {
        let (a, b) = (base.join(format!("w{from}")), base.join(format!("r{from}to{to}")));
        // the writer: 6 iterations, persistent writes at 3 and 6
        let (ok, wrote, text) = train(&a, from, 6, &[], &[]);
        assert!(ok, "{text}");
        let g = wrote["global_state_sha256"].as_str().expect("the writer's global digest").to_string();
        let persist = a.join("persist");
        let (ins, text) = inspect(&persist);
        assert_eq!(ins["iter"], 6, "{text}");
        assert_eq!(ins["world"], from as u64, "{text}");
        assert_eq!(ins["global_state_sha256"], g.as_str(), "inspect and the job disagree on the state\n{text}");
        // the files and manifests alone give the same global state (standard-library Python)
        let py = Command::new("python3").arg(root().join("scripts/ckpt_global.py")).arg(&persist).output().unwrap();
        let py_out = String::from_utf8_lossy(&py.stdout);
        assert!(
            py.status.success() && py_out.contains(&format!("global_state_sha256 {g}")),
            "{py_out}{}",
            String::from_utf8_lossy(&py.stderr)
        );
        // an expert's Adam moments are global tensors with one owner, like its weights
        let owners = &ins["tensors"]["adam.m.l1.e3.w1"]["slices"];
        assert_eq!(owners.as_array().map(Vec::len), Some(1), "{owners}");
        assert_eq!(owners[0][0], (3 % from) as u64, "expert 3's moments live with expert 3: {owners}");
        // offline: rewritten for the other world size, the same global state
        let off = base.join(format!("resharded{from}to{to}"));
        let (ok, text) = output(ironweave().args(["ckpt", "reshard"]).arg(&persist).arg("--to").arg(&off).args([
            "--ranks",
            &to.to_string(),
            "--config",
            "configs/moe-tiny.toml",
        ]));
        assert!(ok && text.contains(&g), "{text}");
        let (ins2, text) = inspect(&off);
        assert_eq!((ins2["world"].as_u64(), ins2["iter"].as_u64()), (Some(to as u64), Some(6)), "{text}");
        assert_eq!(ins2["global_state_sha256"], g.as_str(), "{text}");
        // the reader: another world size, two more iterations
        let (ok, read, text) = train(&b, to, 8, &["--resume-from", persist.to_str().unwrap()], &[]);
        assert!(ok, "{text}");
        assert_eq!(read["resumed_from_iter"], 6, "{text}");
        assert_eq!(read["resumed_from_world"], from as u64, "{text}");
        assert_eq!(read["restored_global_state_sha256"], g.as_str(), "{from} -> {to} ranks: the load is not exact\n{text}");
        // it trained on from there (a different world reduces in another order: no digest
        // equality is expected after that)
        assert_eq!(read["iterations"], 8, "{text}");
        assert_ne!(read["global_state_sha256"], g.as_str(), "{text}");
    }
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn a_kill_during_the_persistent_write_leaves_the_previous_checkpoint_to_load() {
    let base = tmp("reshard-kill");
    let a = base.join("w");
    // rank 1 dies after the first block of its iteration-6 file; nobody restarts it
    let (ok, _, text) =
        train(&a, 4, 6, &["--max-restarts", "0"], &[("IRONWEAVE_FAULT", "persist:1:6"), ("IRONWEAVE_TIMEOUT_S", "5")]);
    assert!(!ok, "the job was meant to die: {text}");
    let persist = a.join("persist");
    let (ins, text) = inspect(&persist);
    assert_eq!(ins["iter"], 3, "the newest complete iteration is 3\n{text}");
    // rank 1 began iteration 6's files and never finished them (the other ranks may or may not
    // have finished theirs before the launcher stopped them: either way 6 is not complete)
    let six = persist.join("iter-00000006");
    assert!(six.is_dir() && !six.join("rank-00001.json").exists(), "rank 1's write of iteration 6 was not cut short\n{text}");
    if let Some(x) = ins["incomplete"][0].as_str() {
        assert!(x.contains("iteration 6") && x.contains("rank-0000"), "{text}");
    }
    let b = base.join("r");
    let (ok, read, text) = train(&b, 2, 5, &["--resume-from", persist.to_str().unwrap()], &[]);
    assert!(ok, "{text}");
    assert_eq!(read["resumed_from_iter"], 3, "{text}");
    assert_eq!(read["restored_global_state_sha256"], ins["global_state_sha256"], "{text}");
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn a_resumed_job_killed_before_its_first_commit_continues_from_the_resumed_iteration() {
    // a 4-rank writer persists iteration 6; a 2-rank job resumes from it and rank 1 dies
    // mid-backward in iteration 7, before anything of the new job is committed (Capricorn
    // commits an iteration late): it must load iteration 6 again, never start over from the
    // initial state, and end bit-identical to the same resumed run without the kill
    let base = tmp("resume-kill");
    let (ok, _, text) = train(&base.join("w"), 4, 6, &[], &[]);
    assert!(ok, "{text}");
    let persist = base.join("w").join("persist");
    let from = ["--resume-from", persist.to_str().unwrap()];
    let (ok, clean, text) = train(&base.join("clean"), 2, 10, &from, &[]);
    assert!(ok, "{text}");
    let (ok, killed, text) = train(&base.join("killed"), 2, 10, &[&from[..], &["--fail", "rank=1,iter=7"]].concat(), &[]);
    assert!(ok, "{text}");
    assert!(!text.contains("starts over from the initial state"), "{text}");
    assert!(text.contains("restored iteration 6") && text.contains("resumed checkpoint"), "{text}");
    assert_eq!(killed["resumed_from_iter"], 6, "{text}");
    assert!(killed["recoveries"].as_u64() >= Some(1), "the kill was recovered from: {killed}");
    assert_eq!(killed["global_state_sha256"], clean["global_state_sha256"], "{text}");
    assert_eq!(killed["final_state_sha256"], clean["final_state_sha256"], "{text}");
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn bad_checkpoints_are_refused_naming_the_tensor_and_the_file() {
    let base = tmp("reshard-bad");
    let a = base.join("w");
    let (ok, _, text) = train(&a, 2, 3, &[], &[]);
    assert!(ok, "{text}");
    let persist = a.join("persist");
    let it = persist.join("iter-00000003");
    // a flipped byte in rank 1's data: inspect names the tensor and the file
    let data = it.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&data).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0x40;
    std::fs::write(&data, &bytes).unwrap();
    let out = ironweave().args(["ckpt", "inspect"]).arg(&persist).arg("--iter").arg("3").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("rank-00001"), "{err}");
    // a truncated file: a resume refuses it (no iteration is complete and valid)
    bytes[n - 100] ^= 0x40;
    std::fs::write(&data, &bytes[..n / 2]).unwrap();
    let (ok, _, text) = train(&base.join("r"), 2, 5, &["--resume-from", persist.to_str().unwrap()], &[]);
    assert!(!ok && (text.contains("truncated") || text.contains("rank-00001")), "{text}");
    // a model of another shape: refused by tensor name
    std::fs::write(&data, &bytes).unwrap();
    let (ok, _, text) =
        train_cfg("configs/moe-small.toml", &base.join("r2"), 2, 5, &["--resume-from", persist.to_str().unwrap()], &[]);
    assert!(!ok && text.contains("another model"), "{text}");
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn bench_reshard_prints_a_row_per_target_and_checks_the_digest() {
    let base = tmp("bench-reshard");
    let json = base.join("rows.json");
    let (ok, text) = output(
        ironweave()
            .args(["bench", "reshard", "--config", "configs/moe-tiny.toml", "--to", "2,1", "--rounds", "1", "--out"])
            .arg(base.join("out"))
            .arg("--json")
            .arg(&json),
    );
    assert!(ok, "{text}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{text}");
    for r in rows {
        assert_eq!(r["exact"], true, "{r}");
        assert!(r["load_s"].as_f64().unwrap() > 0.0 && r["plain_read_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["bytes_read"].as_u64().unwrap() > 0, "{r}");
    }
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn a_full_shard_gpt_checkpoint_of_4_ranks_loads_replicated_on_2_bit_exact() {
    // FULL_SHARD keeps a quarter of every layer's flat parameters and moments per rank (padding
    // left out of the files); replicated data parallelism wants whole layers: each of the 2
    // ranks reads every rank's slices of each layer and the loaded global state is the one the
    // files hold (`ckpt inspect` assembles it from the shards)
    let base = tmp("reshard-gpt");
    let a = base.join("full4");
    let (ok, _, text) = train_cfg("configs/gpt-sdp.toml", &a, 4, 3, &["--sdp", "full"], &[]);
    assert!(ok, "{text}");
    let persist = a.join("persist");
    let (ins, text) = inspect(&persist);
    assert_eq!(ins["world"], 4, "{text}");
    let split = ins["tensors"]["layer0.m"]["slices"].as_array().map(Vec::len);
    assert_eq!(split, Some(4), "layer 0's first moment is in 4 shards: {text}");
    let b = base.join("rep2");
    let (ok, read, text) =
        train_cfg("configs/gpt-sdp.toml", &b, 2, 4, &["--sdp", "replicated", "--resume-from", persist.to_str().unwrap()], &[]);
    assert!(ok, "{text}");
    assert_eq!(read["resumed_from_iter"], 3, "{text}");
    assert_eq!(read["restored_global_state_sha256"], ins["global_state_sha256"], "full 4 -> replicated 2 is not exact\n{text}");
    std::fs::remove_dir_all(&base).ok();
}
