//! The systemd unit in deploy/ is one systemd accepts (`systemd-analyze verify`, with
//! ExecStart pointed at the stasisd just built), and stops stasisd the way it must be stopped.

#![forbid(unsafe_code)]

use std::path::Path;

#[test]
fn the_systemd_unit_verifies_and_lets_running_jobs_finish() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/systemd/stasisd.service");
    let text = std::fs::read_to_string(&unit).expect("deploy/systemd/stasisd.service");
    for line in ["KillMode=mixed", "KillSignal=SIGTERM", "TimeoutStopSec=15min"] {
        assert!(text.lines().any(|l| l == line), "the unit should say {line}");
    }
    let Some(analyze) =
        ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"].into_iter().find(|p| Path::new(p).exists())
    else {
        eprintln!("skipping the verification: no systemd-analyze here");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let stasisd = stasis_tests::bin("stasisd");
    let built = text.replace("/usr/local/bin/stasisd", &stasisd.display().to_string());
    let copy = dir.path().join("stasisd.service");
    std::fs::write(&copy, built).unwrap();
    let out = std::process::Command::new(analyze).arg("verify").arg(&copy).output().expect("systemd-analyze");
    let said = String::from_utf8_lossy(&out.stderr);
    // Without a running systemd (containers, CI) it still parses the unit and reports problems.
    let problems: Vec<&str> =
        said.lines().filter(|l| l.contains("stasisd.service") && !l.contains("Failed to connect")).collect();
    assert!(out.status.success() || problems.is_empty(), "systemd-analyze verify: {said}");
    assert!(problems.is_empty(), "systemd-analyze verify: {said}");
}
