//! `stasis-bench kube`: issue 11's benchmark. A StatefulSet's opted-in pod (admitted by the
//! webhook, run through containerd's CRI with stasis-nri, as in tests/tests/kubernetes.rs)
//! runs the benchmark workload. A first checkpoint, left running, is the cold full checkpoint
//! (and the periodic one an eviction builds on); then, each round, the workload rewrites part
//! of its memory, the pod is evicted (its preStop hook, timed until it returns: the checkpoint
//! is durable then), and a new pod of the same identity is started, timed until its init says
//! the tree was restored and runs (lazily); its memory checksum is checked against the one
//! before the eviction.
//!
//! Targets (issue 11): eviction <= 0.2x the cold full checkpoint; restart-to-running <= 2 s.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use stasis_tests::containerd::Containerd;
use stasis_tests::kube::{
    Kubelet, NriPlugin, RunningPod, admitted, bundle, grace, pre_stop, stateful_pod, translate,
};
use stasis_tests::podman::Podman;
use stasis_tests::{Daemon, DaemonOptions};

use crate::Args;
use crate::report::median;

const IMAGE: &str = "localhost/stasis-bench-workload:1";
const WORKLOAD: &str = "k8s.test.statefulset.bench.0.main";
const WAIT: Duration = Duration::from_secs(600);

/// One eviction and the restart after it.
pub struct Round {
    /// preStop hook start until it returned (the checkpoint durable).
    pub eviction_ms: u64,
    /// The eviction's checkpoint: durable time and bytes uploaded, as stasisd reports them.
    pub durable_ms: u64,
    pub uploaded: u64,
    /// Of `durable_ms`: the tree frozen, CRIU's dump, and storing after it.
    pub frozen_ms: u64,
    pub dump_ms: u64,
    pub store_ms: u64,
    /// StartContainer of the new pod until its init said the tree runs.
    pub restart_ms: u64,
}

pub struct KubeResults {
    pub cold_ms: u64,
    pub cold_uploaded: u64,
    pub rounds: Vec<Round>,
}

/// The lines of `stream` (stdout or stderr) in a container's CRI log.
fn lines(log: &Path, stream: &str) -> Vec<String> {
    let marker = format!(" {stream} F ");
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter_map(|l| l.split_once(&marker).map(|(_, t)| t.to_owned())).collect()
}

/// Waits for a stdout line of `pod` starting with `prefix` after the first `skip`; returns
/// its rest.
fn line_after(pod: &RunningPod, skip: usize, prefix: &str) -> anyhow::Result<String> {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if let Some(line) = lines(&pod.log, "stdout").into_iter().skip(skip).find(|l| l.starts_with(prefix)) {
            return Ok(line[prefix.len()..].to_owned());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    bail!("the workload did not print `{prefix}`")
}

/// Signals the workload (the container init's one child) and waits for its answer.
fn ask(init: i32, pod: &RunningPod, signal: Signal, prefix: &str) -> anyhow::Result<String> {
    let workload =
        stasis_tests::procfs::children(init).first().copied().context("the container runs no workload")?;
    let skip = lines(&pod.log, "stdout").len();
    kill(Pid::from_raw(workload), signal).context("signalling the workload")?;
    line_after(pod, skip, prefix)
}

pub async fn run(args: &Args) -> anyhow::Result<KubeResults> {
    let podman = Podman::start().context("Podman (scripts/test.sh installs it)")?;
    let containerd = Containerd::start(&podman).context("containerd (scripts/setup-containerd.sh)")?;
    // The workload with a loader and libraries of its own: one whose program were the bundle's
    // loader, CRIU's own, could not be restored (the kernel refuses to set a process's program
    // to the file it already maps, EBUSY).
    let libs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/pod-bundle");
    let files = [
        (stasis_tests::bin("stasis-bench-workload"), "/bench/workload"),
        (libs.join("ld.so"), "/bench/ld.so"),
        (libs.join("lib/libc.so.6"), "/bench/lib/libc.so.6"),
        (libs.join("lib/libgcc_s.so.1"), "/bench/lib/libgcc_s.so.1"),
    ];
    let files: Vec<(&Path, &str)> = files.iter().map(|(host, inside)| (host.as_path(), *inside)).collect();
    containerd.add_image(&podman, IMAGE, &files);
    let run_dir = args.store_dir.join(format!("kube-{}", std::process::id()));
    let endpoint = run_dir.join("endpoint");
    std::fs::create_dir_all(&endpoint)?;
    let d = Daemon::start_with(&DaemonOptions {
        args: [
            vec!["--pod-socket".into(), endpoint.join("pod.sock").display().to_string()],
            args.daemon_flags(),
        ]
        .concat(),
        store: Some(format!("file://{}", run_dir.join("store").display())),
        ..Default::default()
    });
    let _nri = NriPlugin::start(&containerd, &d.socket(), &bundle(d.dir()), &endpoint);
    let mut kubelet = Kubelet::new(&containerd).await;
    let (mib, dirty) = (args.rss_mib.to_string(), args.dirty.to_string());
    let command = [
        "/bench/ld.so",
        "--library-path",
        "/bench/lib",
        "/bench/workload",
        "--rss-mib",
        &mib,
        "--dirty",
        &dirty,
        "--churn",
    ];
    let spec = admitted(&stateful_pod("bench-0", "bench", "0", &[("main", IMAGE, &command)]));
    let (sandbox, main) = translate(&kubelet, &spec);
    let mut pod = kubelet.run(sandbox, main).await;
    line_after(&pod, 0, "ready")?;

    let cold = d.json(&["checkpoint", "--workload", WORKLOAD, "--leave-running", "--json"]);
    let stat = |v: &Value, key: &str| v["stats"][key].as_u64().unwrap_or_default();
    let (cold_ms, cold_uploaded) = (stat(&cold, "durable_ms"), stat(&cold, "bytes_uploaded"));
    let mut rounds = Vec::new();
    for _ in 0..args.rounds {
        let init = kubelet.init_pid(&pod).await;
        ask(init, &pod, Signal::SIGUSR1, "dirtied ")?;
        let sum = ask(init, &pod, Signal::SIGUSR2, "checksum ")?;
        let started = Instant::now();
        let (code, out, err) = kubelet.exec(&pod, pre_stop(&spec), grace(&spec)).await;
        let eviction_ms = started.elapsed().as_millis() as u64;
        ensure!(code == 0, "the preStop hook failed: {out}{err}\n{}", d.log_tail(30));
        let listed = d.json(&["list", "--workload", WORKLOAD, "--json"]);
        let evicted = listed["checkpoints"]
            .as_array()
            .and_then(|c| c.last())
            .cloned()
            .context("no checkpoint listed")?;
        kubelet.delete(pod, grace(&spec)).await;

        let (sandbox, main) = translate(&kubelet, &spec);
        let started = Instant::now();
        pod = kubelet.run(sandbox, main).await;
        while !lines(&pod.log, "stderr").iter().any(|l| l.contains("restored from checkpoint")) {
            ensure!(started.elapsed() < WAIT, "the new pod did not say it was restored\n{}", d.log_tail(30));
            std::thread::sleep(Duration::from_millis(5));
        }
        let restart_ms = started.elapsed().as_millis() as u64;
        let init = kubelet.init_pid(&pod).await;
        let restored = ask(init, &pod, Signal::SIGUSR2, "checksum ")?;
        ensure!(restored == sum, "the restored memory differs: {restored} vs {sum}");
        rounds.push(Round {
            eviction_ms,
            durable_ms: stat(&evicted, "durable_ms"),
            uploaded: stat(&evicted, "bytes_uploaded"),
            frozen_ms: stat(&evicted, "frozen_ms"),
            dump_ms: stat(&evicted, "dump_ms"),
            store_ms: stat(&evicted, "store_ms"),
            restart_ms,
        });
    }
    kubelet.delete(pod, grace(&spec)).await;
    drop(d);
    if !args.keep {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    Ok(KubeResults { cold_ms, cold_uploaded, rounds })
}

impl KubeResults {
    pub fn table(&self, args: &Args) -> String {
        let col = |f: fn(&Round) -> u64| self.rounds.iter().map(|r| f(r) as f64).collect::<Vec<f64>>();
        let (eviction, restart) = (median(&col(|r| r.eviction_ms)), median(&col(|r| r.restart_ms)));
        let verdict = |ok: bool| if ok { "met" } else { "missed" };
        let cold = self.cold_ms as f64;
        let mut out = format!(
            "Kubernetes eviction and restart: a {} MiB workload (churning, {} rewritten per round) in a \
             StatefulSet's pod on containerd 1.7 via the CRI, with stasis-nri and the webhook's spec; cold \
             full checkpoint (left running, the one evictions build on) {} ms, {} MiB uploaded; {} round(s), \
             medians; memory checksums identical after every restore\n\n",
            args.rss_mib,
            args.dirty,
            self.cold_ms,
            self.cold_uploaded >> 20,
            self.rounds.len()
        );
        out.push_str("| measure | stasis | reference | ratio | target | |\n|---|---|---|---|---|---|\n");
        out.push_str(&format!(
            "| eviction: preStop start until durable, ms (vs cold full checkpoint) | {eviction:.0} | {cold:.0} | {:.3} | ≤ 0.2 | {} |\n",
            eviction / cold,
            verdict(eviction <= 0.2 * cold)
        ));
        out.push_str(&format!(
            "| restart: new container start until the job runs, ms | {restart:.0} | 2000 | {:.3} | ≤ 1 | {} |\n",
            restart / 2000.0,
            verdict(restart <= 2000.0)
        ));
        for (i, r) in self.rounds.iter().enumerate() {
            out.push_str(&format!(
                "\n- round {}: eviction {} ms (stasisd's durable_ms {}: frozen {}, dump {}, store {}; {} MiB \
                 uploaded), restart {} ms",
                i + 1,
                r.eviction_ms,
                r.durable_ms,
                r.frozen_ms,
                r.dump_ms,
                r.store_ms,
                r.uploaded >> 20,
                r.restart_ms
            ));
        }
        out
    }
}
