//! The `plan` and `simulate` commands as a user runs them.

use std::process::Command;

fn ironweave(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ironweave"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .output()
        .expect("run ironweave");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn plan_tmp_prints_and_writes_a_plan() {
    let dir = std::env::temp_dir().join(format!("ironweave-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("tmp.json");
    let (code, out, err) = ironweave(&[
        "plan",
        "tp",
        "--model",
        "configs/models/gpt-7b.toml",
        "--cluster",
        "configs/clusters/32x3090-pcie.toml",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("speedup over Megatron"), "{out}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let p = &v["plan"];
    assert!(p["predicted_iter_s"].as_f64().unwrap() > 0.0);
    assert!(p["memory_gib"].as_f64().unwrap() <= p["memory_budget_gib"].as_f64().unwrap());
    assert_eq!(p["sublayers"].as_array().unwrap().len(), 65);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn plan_sdp_prints_the_baselines() {
    let (code, out, err) =
        ironweave(&["plan", "sdp", "--model", "configs/models/gpt-40b.toml", "--cluster", "configs/clusters/2x8-h100.toml"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("FSDP FULL_SHARD") && out.contains("HSDP plan"), "{out}");
}

#[test]
fn simulate_ckpt_prints_five_strategies_and_a_timeline() {
    let dir = std::env::temp_dir().join(format!("ironweave-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("t.svg");
    let (code, out, err) = ironweave(&[
        "simulate",
        "ckpt",
        "--model",
        "configs/models/moe-gpt-32e.toml",
        "--cluster",
        "configs/clusters/4x8-a100.toml",
        "--iterations",
        "5",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    for s in ["none", "blocking", "async", "gemini", "capricorn"] {
        assert!(out.lines().any(|l| l.trim_start().starts_with(s)), "no row for {s}:\n{out}");
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.contains("ckpt chunk"), "timeline lacks checkpoint chunks");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_inputs_fail_with_a_message() {
    let (code, _, err) =
        // the old name still works (an alias)
        ironweave(&["plan", "tmp", "--model", "configs/models/nope.toml", "--cluster", "configs/clusters/2x8-h100.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("nope.toml"), "{err}");
    let (code, _, err) =
        ironweave(&["plan", "tp", "--model", "configs/models/gpt-13b.toml", "--cluster", "configs/clusters/32x3090-pcie.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("no feasible plan"), "{err}");
    let (code, _, err) =
        ironweave(&["simulate", "ckpt", "--model", "configs/models/gpt-7b.toml", "--cluster", "configs/clusters/4x8-a100.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("no [moe] section"), "{err}");
    let (code, _, err) =
        ironweave(&["simulate", "warp", "--model", "configs/models/gpt-7b.toml", "--cluster", "configs/clusters/4x8-a100.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("unknown scenario"), "{err}");
}

#[test]
fn probe_figures_replace_the_description() {
    let dir = std::env::temp_dir().join(format!("ironweave-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let probe = dir.join("probe.json");
    std::fs::write(
        &probe,
        r#"[{"name":"tcp:a","latency_s":0.0001,"bandwidth_bytes_per_s":119000000.0,"declared_bytes_per_s":125000000.0,"streamed_bytes":1000000}]"#,
    )
    .unwrap();
    let args = ["--model", "configs/models/gpt-125m.toml", "--cluster", "configs/clusters/emulated-2host.toml"];
    let mut a = vec!["plan", "sdp"];
    a.extend(args);
    a.extend(["--probe", probe.to_str().unwrap()]);
    let (code, out, err) = ironweave(&a);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("link a: measured 100.0 us, 0.119 GB/s"), "{err}");
    std::fs::write(
        &probe,
        r#"[{"name":"tcp:zz","latency_s":0.0001,"bandwidth_bytes_per_s":1.0,"declared_bytes_per_s":null,"streamed_bytes":1}]"#,
    )
    .unwrap();
    let (code, _, err) = ironweave(&a);
    assert_ne!(code, 0);
    assert!(err.contains("matches no link") && err.contains("its links: a"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
