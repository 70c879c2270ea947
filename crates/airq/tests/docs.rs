//! The experiment commands of docs/AIR-QUALITY.md reproduce its tables: each documented
//! `airq experiment` and `airq hourly` command line is run with `--dry-run`, and the settings
//! line it prints must
//! be the one printed under the command (the line `airq experiment` writes above its table); each
//! table's `seeds` column must count the seeds of those settings.

use std::process::Command;

fn doc() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/AIR-QUALITY.md")).unwrap()
}

/// The settings line `airq experiment ARGS --dry-run` prints.
fn settings_of(args: &str) -> String {
    settings_of_cmd("experiment", args)
}

/// The settings line `airq CMD ARGS --dry-run` prints.
fn settings_of_cmd(cmd: &str, args: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_airq")).arg(cmd).args(args.split_whitespace()).arg("--dry-run").output().unwrap();
    assert!(out.status.success(), "airq {cmd} {args} --dry-run: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn documented_experiment_commands_give_the_settings_of_their_tables() {
    let doc = doc();
    let lines: Vec<&str> = doc.lines().collect();
    let mut checked = 0;
    for (i, l) in lines.iter().enumerate() {
        let (cmd, rest) = match (
            l.trim().strip_prefix("target/release/airq experiment"),
            l.trim().strip_prefix("target/release/airq hourly"),
        ) {
            (Some(r), _) => ("experiment", r),
            (_, Some(r)) => ("hourly", r),
            _ => continue,
        };
        // the command, then (optionally) a comment `# = ...` spelling out its defaults
        let (args, comment) = match rest.split_once('#') {
            Some((a, c)) => (a.trim(), Some(c.trim())),
            None => (rest.trim(), None),
        };
        let got = settings_of_cmd(cmd, args);
        if let Some(c) = comment.and_then(|c| c.strip_prefix('=')) {
            // the comment's spelled-out form, continued on `#` lines below
            let mut spelled = c.trim().to_string();
            for more in lines[i + 1..].iter().take_while(|m| m.trim().starts_with('#')) {
                spelled.push(' ');
                spelled.push_str(more.trim().trim_start_matches('#').trim());
            }
            assert_eq!(settings_of_cmd(cmd, &spelled), got, "line {}: the comment's settings differ from the command's", i + 1);
        }
        // the settings line after the code block, then the table
        let after: Vec<&str> = lines[i..].iter().skip_while(|m| !m.starts_with("```")).skip(1).copied().collect();
        let said =
            after.iter().find(|m| m.starts_with("settings:")).unwrap_or_else(|| panic!("line {}: no settings line", i + 1));
        assert_eq!(*said, got, "line {}: the table's settings are not the command's", i + 1);
        let seeds = got.split("seeds ").nth(1).unwrap().split(',').take_while(|s| s.parse::<u64>().is_ok()).count();
        let rows: Vec<&str> = after
            .iter()
            .skip_while(|m| !m.starts_with("| sources") && !m.starts_with("| inputs"))
            .skip(2)
            .take_while(|m| m.starts_with('|'))
            .copied()
            .collect();
        assert!(!rows.is_empty(), "line {}: no table after the settings", i + 1);
        for r in rows {
            let cols: Vec<&str> = r.split('|').map(str::trim).collect();
            // the baselines that are not trained run once
            let want = if ["persistence", "climatology", "ridge-ar"].contains(&cols[2]) { 1 } else { seeds };
            assert_eq!(cols[3], want.to_string(), "line {}: row `{r}` has another number of seeds", i + 1);
        }
        checked += 1;
    }
    assert!(checked >= 3, "{checked} documented experiment commands found");
    assert!(doc.contains("target/release/airq hourly"), "the hourly experiment is documented with its command");
}

#[test]
fn the_defaults_are_the_documented_ones() {
    // the settings the docs call the defaults
    let s = settings_of("");
    assert!(s.contains("seeds 1,2,3,4,5") && s.contains("iterations 400"), "{s}");
    assert!(
        s.contains("target Niedersachsen") && s.contains("target days 365") && s.contains("unlabelled days = target days"),
        "{s}"
    );
}
