//! What counts as a workload being used: CPU time its processes spent, bytes they read (from
//! sockets, pipes or files), sampled from /proc at every tick of the idle monitor, and on GPU
//! nodes whether NVML saw any of them use a GPU since the last tick.
//!
//! A workload is idle for as long as no tick saw either above its threshold. The thresholds
//! are rates, so a tick's length does not change what counts: by default 0.5 % of one core
//! and 1 KiB read per second. An idle Jupyter kernel stays below both (measured: no CPU and
//! 16 bytes a second), one that runs a cell or receives a request does not.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::cuda::nvml::Nvml;
use crate::engine::host::Host;
use crate::engine::{lock, now_unix_ms};

/// Which processes used a GPU lately.
pub trait GpuActivity: Send + Sync {
    /// Host pids with GPU (SM or memory) utilization in samples newer than `since_us`
    /// (microseconds since the epoch).
    fn active_since(&self, since_us: u64) -> Result<HashSet<u32>, String>;
}

impl GpuActivity for Nvml {
    fn active_since(&self, since_us: u64) -> Result<HashSet<u32>, String> {
        Nvml::active_since(self, since_us).map_err(|e| e.to_string())
    }
}

/// A [`GpuActivity`] asked, at each tick, for what happened since it was asked before.
pub struct GpuWatch {
    source: Arc<dyn GpuActivity>,
    /// When it was last asked (microseconds since the epoch).
    asked_us: Mutex<Option<u64>>,
}

impl GpuWatch {
    pub fn new(source: Arc<dyn GpuActivity>) -> GpuWatch {
        GpuWatch { source, asked_us: Mutex::new(None) }
    }

    /// The processes that used a GPU since the last question (the first covers one `tick`);
    /// none when it cannot tell.
    pub fn active(&self, tick: Duration) -> HashSet<u32> {
        let now_us = now_unix_ms() * 1000;
        let tick_us = tick.as_micros() as u64;
        let since = lock(&self.asked_us).replace(now_us).unwrap_or(now_us.saturating_sub(tick_us));
        self.source.active_since(since).unwrap_or_else(|why| {
            warn!(reason = %why, "cannot read GPU activity; idle workloads are judged by CPU and reads");
            HashSet::new()
        })
    }
}

/// GPU activity on cue, for tests: the pids it names, or why it cannot tell.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct FakeGpuActivity {
    /// Host pids it reports as having used a GPU.
    pub active: std::sync::Mutex<HashSet<u32>>,
    /// Its answer instead, when set: NVML failing.
    pub failure: std::sync::Mutex<Option<String>>,
    /// The `since_us` of each question, in order.
    pub asked: std::sync::Mutex<Vec<u64>>,
}

#[cfg(test)]
impl GpuActivity for FakeGpuActivity {
    fn active_since(&self, since_us: u64) -> Result<HashSet<u32>, String> {
        self.asked.lock().unwrap().push(since_us);
        match self.failure.lock().unwrap().clone() {
            Some(why) => Err(why),
            None => Ok(self.active.lock().unwrap().clone()),
        }
    }
}

/// One sample of a tree's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub at: Instant,
    /// CPU time of every thread, in nanoseconds.
    pub cpu_ns: u64,
    /// Bytes read by `read`-like calls (`rchar`), from anything.
    pub read_bytes: u64,
    /// A process of the tree used a GPU since the previous sample.
    pub gpu: bool,
}

/// Above what a tick counts as activity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Percent of one CPU core.
    pub cpu_percent: f64,
    pub read_bytes_per_sec: u64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { cpu_percent: 0.5, read_bytes_per_sec: 1024 }
    }
}

/// How long a workload has been idle, from its samples.
#[derive(Debug, Clone)]
pub struct IdleClock {
    last: Option<Sample>,
    active_at: Instant,
}

impl IdleClock {
    /// A clock that starts counting now (a workload just started, restored or woken).
    pub fn new(now: Instant) -> IdleClock {
        IdleClock { last: None, active_at: now }
    }

    /// Takes a sample; returns how long the workload has been idle.
    pub fn observe(&mut self, sample: Sample, limits: Thresholds) -> Duration {
        if let Some(last) = self.last.replace(sample) {
            let span = sample.at.saturating_duration_since(last.at).as_secs_f64();
            // Counters go down when a process of the tree exits: nothing was used then.
            let cpu = sample.cpu_ns.saturating_sub(last.cpu_ns) as f64;
            let read = sample.read_bytes.saturating_sub(last.read_bytes) as f64;
            let busy_cpu = cpu > span * 1e9 * limits.cpu_percent / 100.0;
            let busy_read = read > span * limits.read_bytes_per_sec as f64;
            if busy_cpu || busy_read || sample.gpu {
                self.active_at = sample.at;
            }
        }
        sample.at.saturating_duration_since(self.active_at)
    }

    /// Idle time as of `now`, without a new sample.
    pub fn idle_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.active_at)
    }
}

/// The counters of `pids` on `host` now, and whether one of them is in `gpu_active`;
/// processes that are gone count nothing.
pub fn sample(host: &dyn Host, pids: &[i32], gpu_active: &HashSet<u32>) -> Sample {
    let (mut cpu_ns, mut read_bytes) = (0, 0);
    for &pid in pids {
        let usage = host.usage(pid);
        cpu_ns += usage.cpu_ns;
        read_bytes += usage.read_bytes;
    }
    let gpu = pids.iter().any(|&pid| u32::try_from(pid).is_ok_and(|pid| gpu_active.contains(&pid)));
    Sample { at: Instant::now(), cpu_ns, read_bytes, gpu }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::LinuxHost;

    fn at(start: Instant, secs: u64, cpu_ms: u64, read: u64) -> Sample {
        Sample {
            at: start + Duration::from_secs(secs),
            cpu_ns: cpu_ms * 1_000_000,
            read_bytes: read,
            gpu: false,
        }
    }

    #[test]
    fn quiet_ticks_add_up_and_any_busy_one_resets() {
        let t0 = Instant::now();
        let limits = Thresholds::default();
        let mut clock = IdleClock::new(t0);
        assert_eq!(clock.observe(at(t0, 1, 100, 5000), limits), Duration::from_secs(1), "first sample");
        // 4 ms of CPU and 100 bytes in a second: below 5 ms and 1 KiB.
        assert_eq!(clock.observe(at(t0, 2, 104, 5100), limits), Duration::from_secs(2));
        // 20 ms of CPU in a second: busy.
        assert_eq!(clock.observe(at(t0, 3, 124, 5100), limits), Duration::ZERO);
        assert_eq!(clock.observe(at(t0, 5, 124, 5100), limits), Duration::from_secs(2));
        // 4 KiB read in a second: busy.
        assert_eq!(clock.observe(at(t0, 6, 124, 9200), limits), Duration::ZERO);
        assert_eq!(clock.idle_for(t0 + Duration::from_secs(9)), Duration::from_secs(3));
    }

    #[test]
    fn gpu_use_alone_is_activity() {
        let t0 = Instant::now();
        let mut clock = IdleClock::new(t0);
        clock.observe(at(t0, 1, 0, 0), Thresholds::default());
        // No CPU, nothing read: a kernel runs on the GPU while its process waits.
        let on_gpu = Sample { gpu: true, ..at(t0, 5, 0, 0) };
        assert_eq!(clock.observe(on_gpu, Thresholds::default()), Duration::ZERO);
        let me = std::process::id();
        assert!(sample(&LinuxHost, &[me as i32], &HashSet::from([me])).gpu);
        assert!(!sample(&LinuxHost, &[me as i32], &HashSet::from([me + 1])).gpu);
    }

    #[test]
    fn a_process_leaving_the_tree_is_not_activity() {
        let t0 = Instant::now();
        let mut clock = IdleClock::new(t0);
        clock.observe(at(t0, 1, 5000, 10_000), Thresholds::default());
        assert_eq!(clock.observe(at(t0, 2, 100, 10), Thresholds::default()), Duration::from_secs(2));
    }

    #[test]
    fn rates_do_not_depend_on_the_tick() {
        let t0 = Instant::now();
        let mut clock = IdleClock::new(t0);
        clock.observe(at(t0, 0, 0, 0), Thresholds::default());
        // 40 ms over 10 s is 0.4 %: idle.
        assert_eq!(clock.observe(at(t0, 10, 40, 0), Thresholds::default()), Duration::from_secs(10));
    }

    #[test]
    fn this_process_is_sampled() {
        let me = std::process::id() as i32;
        let before = sample(&LinuxHost, &[me], &HashSet::new());
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_add(std::hint::black_box(i));
        }
        std::hint::black_box(x);
        let _ = std::fs::read("/proc/self/status");
        let after = sample(&LinuxHost, &[me, i32::MAX], &HashSet::new());
        assert!(after.cpu_ns > before.cpu_ns, "{before:?} {after:?}");
        assert!(after.read_bytes > before.read_bytes, "{before:?} {after:?}");
    }
}
