//! The emulated cluster (network namespaces, veth, bridges, tc): `up` then `down` leaves
//! `ip netns list` as it was, and a 2-host × 2-rank job over two links computes correctly,
//! striped over both links and on each alone. Needs root and iproute2; without them the tests
//! say why they are skipped (CI runs as root).

use ironweave_units::Locked;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ironweave");

/// The tests compare the whole `ip netns list`, so they must not run at the same time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn netns() -> Vec<String> {
    let o = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let mut v: Vec<String> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| l.split_whitespace().next().unwrap_or("").to_string()).collect();
    v.sort();
    v
}

fn topology(name: &str, hosts: usize) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("iw-topo-{name}-{}.toml", std::process::id()));
    let text = format!(
        "name = \"{name}\"\nhosts = {hosts}\n[[links]]\nname = \"a\"\nrate = \"1gbit\"\n[[links]]\nname = \"b\"\nrate = \"300mbit\"\nsubnet = \"10.232.7.0/24\"\n"
    );
    std::fs::write(&p, text).unwrap();
    p
}

fn iw(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().unwrap()
}

#[test]
fn up_then_down_leaves_namespaces_as_they_were() {
    let _serial = SERIAL.locked();
    if !ironweave_testkit::can_run_emulated("up_then_down_leaves_namespaces_as_they_were") {
        return;
    }
    let t = topology("ut1", 3);
    let t = t.to_str().unwrap();
    let before = netns();
    let o = iw(&["cluster", "up", "--topology", t]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let during = netns();
    for ns in ["iw-ut1-h0", "iw-ut1-h1", "iw-ut1-h2", "iw-ut1-sw"] {
        assert!(during.contains(&ns.to_string()), "{ns} missing: {during:?}");
    }
    // Addresses and shaping are in place.
    let a = Command::new("ip").args(["-n", "iw-ut1-h2", "-br", "addr"]).output().unwrap();
    let a = String::from_utf8_lossy(&a.stdout);
    assert!(a.contains("10.231.1.3/24") && a.contains("10.232.7.3/24"), "{a}");
    let q = Command::new("ip").args(["netns", "exec", "iw-ut1-h0", "tc", "qdisc", "show", "dev", "b"]).output().unwrap();
    assert!(String::from_utf8_lossy(&q.stdout).contains("tbf"), "{}", String::from_utf8_lossy(&q.stdout));
    // A second `up` is refused with a hint, and changes nothing.
    let again = iw(&["cluster", "up", "--topology", t]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already exists"));
    assert!(iw(&["cluster", "status", "--topology", t]).status.success());
    assert!(iw(&["cluster", "down", "--topology", t]).status.success());
    assert_eq!(netns(), before);
    // `down` again is a no-op that succeeds.
    assert!(iw(&["cluster", "down", "--topology", t]).status.success());
    assert_eq!(netns(), before);
    assert_eq!(iw(&["cluster", "status", "--topology", t]).status.code(), Some(3));
}

#[test]
fn two_hosts_two_ranks_each_over_two_links() {
    let _serial = SERIAL.locked();
    if !ironweave_testkit::can_run_emulated("two_hosts_two_ranks_each_over_two_links") {
        return;
    }
    let t = topology("ut2", 2);
    let t = t.to_str().unwrap();
    let before = netns();
    assert!(iw(&["cluster", "up", "--topology", t]).status.success());
    let run = |link: &str| {
        iw(&[
            "bench",
            "collectives",
            "--topology",
            t,
            "--ranks-per-host",
            "2",
            "--link",
            link,
            "--ops",
            "allreduce,allgather,reducescatter,alltoall,broadcast",
            "--sizes",
            "4K,1M",
            "--min-time",
            "0.01",
        ])
    };
    let outs: Vec<_> = ["all", "a", "b"].into_iter().map(|l| (l, run(l))).collect();
    assert!(iw(&["cluster", "down", "--topology", t]).status.success());
    assert_eq!(netns(), before);
    for (l, o) in outs {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "link {l}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(out.matches("| yes |").count(), 10, "link {l}: every row verified:\n{out}");
    }
}
