//! Tensor parallelism end to end: `ironweave train --tp 2` with both schedules over loopback
//! TCP learns the same losses and draws every rank's compute and communication lanes; `bench
//! overlap` on the emulated cluster writes a row per schedule with the counters behind it.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ironweave");
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

fn train(dir: &std::path::Path, schedule: &str) -> serde_json::Value {
    let out = Command::new(BIN)
        .current_dir(ROOT)
        .args([
            "train",
            "--config",
            "configs/gpt-tp.toml",
            "--ranks",
            "2",
            "--tp",
            "2",
            "--schedule",
            schedule,
            "--iters",
            "4",
            "--quiet",
        ])
        .arg("--report-dir")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "train --tp 2 --schedule {schedule} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
}

#[test]
fn both_schedules_train_the_same_and_show_every_rank_s_lanes() {
    let base = std::env::temp_dir().join(format!("ironweave-tp-{}", std::process::id()));
    let m = train(&base.join("m"), "megatron");
    let o = train(&base.join("o"), "oases");
    let (lm, lo) = (m["loss"].as_array().unwrap(), o["loss"].as_array().unwrap());
    assert_eq!(lm.len(), 4);
    for (a, b) in lm.iter().zip(lo) {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!((a - b).abs() / b.abs() <= 1e-4, "megatron {a} vs oases {b}");
    }
    assert_eq!((o["tp"].as_u64(), o["sub_batches"].as_u64()), (Some(2), Some(2)));
    // every iteration sent activations: the tensor-parallel lane is not empty
    assert!(o["tp_comm_s"].as_array().unwrap().iter().all(|c| c.as_f64().unwrap() > 0.0));
    let svg = std::fs::read_to_string(base.join("o/timeline.svg")).unwrap();
    for lane in ["rank 0 compute", "rank 0 comm tensor-parallel", "rank 1 compute", "rank 1 comm tensor-parallel"] {
        assert!(svg.contains(lane), "timeline.svg lacks the lane {lane}");
    }
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(base.join("o/trace.json")).unwrap()).unwrap();
    let ev = trace["traceEvents"].as_array().unwrap();
    for (pid, tid) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        assert!(ev.iter().any(|e| e["ph"] == "X" && e["pid"] == pid && e["tid"] == tid), "no span of rank {pid} lane {tid}");
    }
    // the run's HTML page is written beside its report
    assert!(std::fs::read_to_string(base.join("o/report.html")).unwrap().contains("tensor parallel 2 x data parallel 1"));
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn layouts_that_cannot_run_are_refused_before_any_rank_starts() {
    for (args, want) in [
        (&["--ranks", "2", "--tp", "3"][..], "--tp 3 must divide --ranks 2"),
        (&["--ranks", "2", "--tp", "2", "--schedule", "gpipe"][..], "use megatron or oases"),
        (&["--ranks", "2", "--tp", "2", "--fail", "rank=1,iter=2"][..], "do not checkpoint yet"),
    ] {
        let out =
            Command::new(BIN).current_dir(ROOT).args(["train", "--config", "configs/gpt-tp.toml"]).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{args:?}: {err}");
    }
    // a MoE config is refused by every rank with the reason
    let out = Command::new(BIN)
        .current_dir(ROOT)
        .args(["train", "--config", "configs/moe-tiny.toml", "--ranks", "2", "--tp", "2", "--iters", "2", "--report-dir"])
        .arg(std::env::temp_dir().join(format!("ironweave-tp-moe-{}", std::process::id())))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("dense models"), "{err}");
}

#[test]
fn a_plan_is_executed_as_planned_or_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("ironweave-tpplan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let out = Command::new(BIN)
        .current_dir(ROOT)
        .args([
            "plan",
            "tp",
            "--model",
            "configs/models/gpt-tp-cpu.toml",
            "--cluster",
            "configs/clusters/emulated-2host.toml",
            "--json",
        ])
        .arg(&plan)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    // a uniform plan runs: its degree, schedule and batch per group in the report
    let sub = v["plan"]["sublayers"].as_array().unwrap().clone();
    let tp = sub[0]["tp"].as_u64().unwrap();
    let out = Command::new(BIN)
        .current_dir(ROOT)
        .args(["train", "--config", "configs/gpt-tp.toml", "--ranks", "2", "--iters", "3", "--quiet", "--tp-plan"])
        .arg(&plan)
        .arg("--report-dir")
        .arg(dir.join("run"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("executing the plan: tensor-parallel degree"), "{err}");
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("run/report.json")).unwrap()).unwrap();
    assert_eq!(rep["tp"].as_u64(), Some(tp));
    // global batch 8 over 2 devices: 8 x tp / 2 sequences per group, dp = 2 / tp groups
    assert_eq!(rep["tokens_per_iter"].as_u64(), Some(8 * 128), "{rep}");
    // different degrees per sub-layer: activations resharded between them, same training
    v["plan"]["sublayers"][1]["tp"] = serde_json::json!(if tp == 1 { 2 } else { 1 });
    std::fs::write(&plan, serde_json::to_vec(&v).unwrap()).unwrap();
    let out = Command::new(BIN)
        .current_dir(ROOT)
        .args(["train", "--config", "configs/gpt-tp.toml", "--ranks", "2", "--iters", "3", "--quiet", "--tp-plan"])
        .arg(&plan)
        .arg("--report-dir")
        .arg(dir.join("mixed"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let mixed: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("mixed/report.json")).unwrap()).unwrap();
    let degrees: Vec<u64> = mixed["degrees"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
    assert_eq!(degrees.len(), 8, "{mixed}");
    assert!(degrees[1] != degrees[0], "{degrees:?}");
    // the same 8 sequences per iteration, so the same first loss as the uniform plan's
    let (l0, l1) = (rep["loss"][0].as_f64().unwrap(), mixed["loss"][0].as_f64().unwrap());
    assert!((l0 - l1).abs() / l0 < 1e-4, "{l0} vs {l1}");
    // the resharding collectives have lanes of their own
    let svg = std::fs::read_to_string(dir.join("mixed/timeline.svg")).unwrap();
    assert!(svg.contains("comm reshard"), "no reshard lane in the timeline");
    let out = Command::new(BIN)
        .current_dir(ROOT)
        .args(["train", "--config", "configs/gpt-tp.toml", "--ranks", "4", "--tp-plan"])
        .arg(&plan)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("run it with --ranks 2"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_overlap_writes_a_row_per_schedule_with_its_counters() {
    if !ironweave_testkit::can_run_emulated("bench_overlap_writes_a_row_per_schedule_with_its_counters") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ironweave-ov-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let topo = dir.join("topo.toml");
    std::fs::write(
        &topo,
        "name = \"iwovt\"\nhosts = 2\n[[links]]\nname = \"a\"\nrate = \"200mbit\"\nsubnet = \"10.233.9.0/24\"\n",
    )
    .unwrap();
    let json = dir.join("out.json");
    let out = Command::new(BIN)
        .current_dir(ROOT)
        .args(["bench", "overlap", "--iters", "3", "--quiet", "--also-rates", "10gbit", "--topology"])
        .arg(&topo)
        .arg("--out")
        .arg(dir.join("runs"))
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    // megatron and oases on each of the two beds, and the planner's plan on the first when the
    // runtime can execute it (a uniform degree)
    let names: Vec<&str> = rows.iter().map(|r| r["schedule"].as_str().unwrap()).collect();
    assert_eq!(names.iter().filter(|n| **n == "megatron").count(), 2, "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "oases").count(), 2, "{names:?}");
    assert!(dir.join("runs/plan.json").exists());
    for r in rows {
        for k in ["iter_time_s", "predicted_iter_time_s", "replayed_iter_time_s", "speedup_vs_megatron"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k} in {r}");
        }
        let f = |k: &str| r[k].as_f64().unwrap();
        // bytes crossed the link: activations (tensor parallel) or gradients (a data-parallel plan)
        let (tp, dp) = (r["tp"].as_u64().unwrap(), r["dp"].as_u64().unwrap());
        assert_eq!(tp * dp, 2, "{r}");
        assert!(if tp > 1 { f("comm_s") > 0.0 } else { f("dp_comm_s") > 0.0 }, "nothing communicated: {r}");
        match r["schedule"].as_str().unwrap() {
            // Megatron waits for every sub-layer's all-reduce right after issuing it
            "megatron" => assert!(f("comm_hidden_fraction") < 0.01, "megatron hid {r}"),
            "oases" => assert!(f("comm_hidden_fraction") > 0.0, "oases hid nothing: {r}"),
            _ => {}
        }
    }
    // the bench took its beds down again
    let ns = String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).to_string();
    assert!(!ns.contains("iwovt"), "{ns}");
    let _ = std::fs::remove_dir_all(&dir);
}
