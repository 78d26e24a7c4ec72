//! Short programs run to their end through a started reaper. A test binary of its own: a
//! started reaper takes the exit of every child of the process.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use stasis_linux::reaper::{ExitKind, Reaper};

fn sh(script: &str) -> Command {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", script]);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn programs_end_with_their_status_and_output_and_one_past_its_deadline_is_killed() {
    let reaper = Reaper::start().unwrap();
    let (exit, out, err) = reaper.run_output(sh("echo out; echo err >&2; exit 3")).await.unwrap();
    assert_eq!((exit, out.as_str(), err.as_str()), (ExitKind::Exited(3), "out\n", "err\n"));
    let (exit, _, _) = reaper.run_output(sh("kill -TERM $$")).await.unwrap();
    assert_eq!(exit, ExitKind::Signaled(15));

    // Still running at its deadline: killed with its group (the sleep too), and said so.
    let r = reaper.clone();
    let slow = tokio::task::spawn_blocking(move || {
        let mut cmd = sh("sleep 30; echo never");
        cmd.process_group(0);
        r.run_blocking(cmd, Stdio::null(), Some(Duration::from_millis(300)))
    });
    let killed =
        tokio::time::timeout(Duration::from_secs(20), slow).await.expect("the kill ends the run").unwrap();
    assert_eq!(killed.unwrap_err().kind(), std::io::ErrorKind::TimedOut);

    // Runs one after another and side by side: each finds its own program's exit, woken by
    // it (a run that missed its program's exit would wait a second for its next look).
    assert!(stasis_linux::sys::pidfd_open(std::process::id() as i32).is_ok(), "pidfd_open works here");
    let started = std::time::Instant::now();
    for code in 0..10 {
        assert_eq!(reaper.run_output(sh(&format!("exit {code}"))).await.unwrap().0, ExitKind::Exited(code));
    }
    assert!(started.elapsed() < Duration::from_secs(5), "ten runs took {:?}", started.elapsed());
    let side_by_side: Vec<_> = (0..8)
        .map(|code| {
            let r = reaper.clone();
            tokio::spawn(async move { r.run_output(sh(&format!("sleep 0.1; exit {code}"))).await.unwrap().0 })
        })
        .collect();
    for (code, run) in side_by_side.into_iter().enumerate() {
        assert_eq!(run.await.unwrap(), ExitKind::Exited(code as i32));
    }
}
