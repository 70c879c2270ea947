//! `airq train` on 4 ranks through `ironweave launch`, a Capricorn checkpoint every iteration:
//! once clean, once with rank 1 killed by SIGKILL after iteration 10 and restarted by the
//! launcher. Every rank restores from memory (its own or a peer's) and the job ends in the
//! clean run's state, bit for bit, with the same scores and the same loss curve.

mod common;

use common::{launch, train_args};
use ironweave_testkit::final_states;
use std::process::Command;

#[test]
fn airq_survives_kill_9_of_a_rank_bit_identical_on_4_ranks() {
    let base = std::env::temp_dir().join(format!("airq-elastic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let iters = 24;
    let clean = launch(&train_args(4, 0, &base.join("clean"), iters), 300, |_| {});
    let clean_state = final_states(&clean);
    assert_eq!(clean_state.len(), 4, "{clean:?}");

    let mut pid: Option<String> = None;
    let mut killed = false;
    let run = launch(&train_args(4, 2, &base.join("killed"), iters), 300, |l| {
        if let Some(rest) = l.strip_prefix("rank 1 pid ") {
            pid = rest.split_whitespace().next().map(String::from);
        }
        if !killed && l.starts_with("rank 1: iteration 10 ") {
            let p = pid.clone().expect("rank 1 printed its pid first");
            assert!(Command::new("kill").args(["-9", &p]).status().unwrap().success(), "kill -9 {p}");
            killed = true;
        }
    });
    assert!(killed, "rank 1 never reached iteration 10: {run:?}");
    let restored: Vec<&String> = run.iter().filter(|l| l.contains(": restored iteration ")).collect();
    assert_eq!(restored.len(), 4, "every rank restores once: {run:?}");
    for l in &restored {
        assert!(l.ends_with("from own memory") || l.ends_with("from peer"), "restored from memory, not {l}");
    }
    assert!(restored.iter().any(|l| l.starts_with("rank 1:") && l.ends_with("from peer")), "{restored:?}");
    assert!(run.iter().any(|l| l.contains("1 recoveries")), "{run:?}");
    assert_eq!(final_states(&run), clean_state, "{run:?}");

    // rank 0 scored the same model and kept the whole loss curve through the recovery
    let metrics = |d: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(base.join(d).join("metrics.json")).unwrap()).unwrap()
    };
    let (a, b) = (metrics("clean"), metrics("killed"));
    assert_eq!(a["model"], b["model"]);
    assert_eq!(a["losses"], b["losses"]);
    let losses = a["losses"].as_array().unwrap();
    assert_eq!(losses.len(), iters as usize);
    assert!(losses.iter().all(|l| l["total"].as_f64().unwrap() > 0.0), "every iteration's loss recorded");
    let _ = std::fs::remove_dir_all(&base);
}
