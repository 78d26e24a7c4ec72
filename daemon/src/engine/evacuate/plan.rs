//! How long each workload's checkpoint will take, and so in which order to take them.
//!
//! A workload's last checkpoint says how fast this node went through its memory (`dump_ms`
//! per byte) and stored what was new (the rest of `durable_ms` per new byte), and, with the
//! one before it, how fast the workload dirties memory. Now it holds `resident` bytes and has
//! dirtied about `rate × age` of them since: the estimate is the time to go through the one
//! and store the other. A workload never checkpointed is estimated as all new, at a modest
//! default speed.
//!
//! Taking the shortest first makes the most workloads durable by a common deadline (the
//! classic shortest-processing-time rule); the slowest, least likely to fit anyway, go last.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What one checkpoint of a workload cost, kept in the registry for the next estimate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointCost {
    /// When it was taken.
    pub at_unix_ms: u64,
    /// Since the checkpoint before it, if there was one.
    pub since_previous_ms: Option<u64>,
    /// Bytes of memory and images, and of those the ones new to the store.
    pub bytes_total: u64,
    pub bytes_new: u64,
    /// Dumping (CRIU going through memory), and the whole until durable.
    pub dump_ms: u64,
    pub durable_ms: u64,
}

/// A workload to checkpoint, as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    /// Resident memory of its tree now.
    pub resident: u64,
    pub last: Option<CheckpointCost>,
}

/// Fixed cost of any checkpoint: inspecting, freezing, CRIU's start, the manifest.
const OVERHEAD: Duration = Duration::from_millis(500);
/// Bytes per millisecond assumed for a workload never checkpointed here (about 200 MB/s).
const DEFAULT_BYTES_PER_MS: u64 = 200_000;
/// New bytes below this are too few to measure a store speed by, and a checkpoint smaller
/// than [`MIN_MEASURED_TOTAL`] too small to measure a scan speed by (its fixed costs dominate).
const MIN_MEASURED_NEW: u64 = 16 << 20;
const MIN_MEASURED_TOTAL: u64 = 64 << 20;

/// The expected time to make `candidate` durable at `now_unix_ms`.
pub fn estimate(candidate: &Candidate, now_unix_ms: u64) -> Duration {
    let resident = candidate.resident;
    let Some(last) = candidate.last.filter(|c| c.bytes_total > 0 && c.durable_ms > 0) else {
        return OVERHEAD + Duration::from_millis(resident / DEFAULT_BYTES_PER_MS);
    };
    let age_ms = now_unix_ms.saturating_sub(last.at_unix_ms);
    // Dirtied since: at the rate seen between the last two checkpoints; all of it without one.
    let dirtied = match last.since_previous_ms {
        Some(interval) if interval > 0 => {
            (last.bytes_new as u128 * age_ms as u128 / interval as u128).min(resident as u128) as u64
        }
        _ => resident,
    };
    let scan_ms = match last.bytes_total >= MIN_MEASURED_TOTAL {
        true => resident as f64 * last.dump_ms as f64 / last.bytes_total as f64,
        false => (resident / DEFAULT_BYTES_PER_MS) as f64,
    };
    let store_ms = match last.bytes_new >= MIN_MEASURED_NEW {
        true => dirtied as f64 * last.durable_ms.saturating_sub(last.dump_ms) as f64 / last.bytes_new as f64,
        false => (dirtied / DEFAULT_BYTES_PER_MS) as f64,
    };
    OVERHEAD + Duration::from_millis((scan_ms + store_ms) as u64)
}

/// The shortest interval between periodic checkpoints worth adapting to: below it the
/// checkpoints themselves would take most of the job's time.
pub const MIN_INTERVAL: Duration = Duration::from_secs(30);

/// The longest interval, at most `every`, whose delta `candidate`'s eviction still stores
/// within `budget` (its checkpoints' age and dirty rate decide); `every` itself when even
/// [`MIN_INTERVAL`] would not fit (more checkpoints would not help), or nothing is known.
pub fn fitting_interval(candidate: &Candidate, every: Duration, budget: Duration) -> Duration {
    let Some(last) = candidate.last else { return every };
    let at_age = |age: Duration| estimate(candidate, last.at_unix_ms + age.as_millis() as u64);
    if every <= MIN_INTERVAL || at_age(every) <= budget || at_age(MIN_INTERVAL) > budget {
        return every;
    }
    // The estimate grows with the age: the longest age that fits, to the second.
    let (mut fits, mut too_long) = (MIN_INTERVAL.as_secs(), every.as_secs());
    while too_long - fits > 1 {
        let mid = (fits + too_long) / 2;
        match at_age(Duration::from_secs(mid)) <= budget {
            true => fits = mid,
            false => too_long = mid,
        }
    }
    Duration::from_secs(fits)
}

/// `candidates` with their estimates, shortest first (by name among equals).
pub fn order(candidates: Vec<Candidate>, now_unix_ms: u64) -> Vec<(Candidate, Duration)> {
    let mut planned: Vec<_> = candidates.into_iter().map(|c| (estimate(&c, now_unix_ms), c)).collect();
    planned.sort_by(|(ea, a), (eb, b)| ea.cmp(eb).then_with(|| a.name.cmp(&b.name)));
    planned.into_iter().map(|(e, c)| (c, e)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn checkpointed(name: &str, resident: u64, cost: CheckpointCost) -> Candidate {
        Candidate { name: name.into(), resident, last: Some(cost) }
    }

    #[test]
    fn a_workload_never_checkpointed_counts_as_all_new() {
        let fresh = Candidate { name: "fresh".into(), resident: GIB, last: None };
        let e = estimate(&fresh, 0);
        assert_eq!(e, OVERHEAD + Duration::from_millis(GIB / DEFAULT_BYTES_PER_MS));
    }

    #[test]
    fn a_recent_checkpoint_with_a_small_delta_is_cheap_and_grows_with_its_age() {
        // Last time: 1 GiB gone through in 1 s, 256 MiB new stored in 2 s more, 64 s after
        // the one before.
        let cost = CheckpointCost {
            at_unix_ms: 100_000,
            since_previous_ms: Some(64_000),
            bytes_total: GIB,
            bytes_new: GIB / 4,
            dump_ms: 1_000,
            durable_ms: 3_000,
        };
        let w = checkpointed("w", GIB, cost);
        // 8 s later an eighth of the last delta is dirty again (32 MiB, 0.25 s to store).
        assert_eq!(estimate(&w, 108_000), OVERHEAD + Duration::from_millis(1_000 + 250));
        // After ten intervals the delta is capped at the whole memory.
        assert_eq!(estimate(&w, 100_000 + 640_000), OVERHEAD + Duration::from_millis(1_000 + 8_000));
        assert!(estimate(&w, 108_000) < estimate(&Candidate { last: None, ..w.clone() }, 108_000));
    }

    #[test]
    fn a_fitting_interval_shrinks_until_the_delta_fits_the_window() {
        // 1 GiB scanned in 1 s; 256 MiB new in 256 s (1 MiB/s dirtied), stored in 2 s (128
        // MiB/s): an eviction t seconds after the last checkpoint takes 0.5 + 1 + t / 128 s.
        let cost = CheckpointCost {
            at_unix_ms: 0,
            since_previous_ms: Some(256_000),
            bytes_total: GIB,
            bytes_new: GIB / 4,
            dump_ms: 1_000,
            durable_ms: 3_000,
        };
        let w = checkpointed("w", GIB, cost);
        let ten_minutes = Duration::from_secs(600);
        // 3 s: 192 s of dirtying fit.
        assert_eq!(fitting_interval(&w, ten_minutes, Duration::from_secs(3)), Duration::from_secs(192));
        // 7 s: the whole interval fits.
        assert_eq!(fitting_interval(&w, ten_minutes, Duration::from_secs(7)), ten_minutes);
        // 1.6 s: not even the floor fits (the scan alone nearly fills it): no shortening.
        assert_eq!(fitting_interval(&w, ten_minutes, Duration::from_millis(1_600)), ten_minutes);
        // Nothing known: as configured.
        let fresh = Candidate { last: None, ..w };
        assert_eq!(fitting_interval(&fresh, ten_minutes, Duration::from_secs(3)), ten_minutes);
    }

    #[test]
    fn the_shortest_go_first() {
        let cost = CheckpointCost {
            at_unix_ms: 0,
            since_previous_ms: Some(10_000),
            bytes_total: GIB,
            bytes_new: 64 << 20,
            dump_ms: 500,
            durable_ms: 1_000,
        };
        let planned = order(
            vec![
                Candidate { name: "big-fresh".into(), resident: 4 * GIB, last: None },
                checkpointed("small", GIB / 4, cost),
                checkpointed("large", 2 * GIB, cost),
                Candidate { name: "tiny-fresh".into(), resident: 1 << 20, last: None },
            ],
            5_000,
        );
        let names: Vec<&str> = planned.iter().map(|(c, _)| c.name.as_str()).collect();
        assert_eq!(names, ["tiny-fresh", "small", "large", "big-fresh"]);
        assert!(planned.windows(2).all(|w| w[0].1 <= w[1].1));
    }
}
