//! Output: one JSON conversion per API message, and helpers for human-readable text.

use std::io::Write as _;

use anyhow::Context as _;
use serde_json::{Value, json};
use stasis_proto::stasis::v1::{
    CheckpointInfo, CheckpointResult, CheckpointStats, GcResponse, ListResponse, RestoreResult, RestoreStats,
    RunResponse, StatusResponse, WorkloadStatus,
};

pub fn run_response(r: &RunResponse) -> Value {
    json!({ "workload": r.workload, "pid": r.pid, "log": r.log_path })
}

pub fn checkpoint_stats(s: &CheckpointStats) -> Value {
    json!({
        "frozen_ms": s.frozen_ms,
        "total_ms": s.total_ms,
        "bytes_total": s.bytes_total,
        "dump_ms": s.dump_ms,
        "store_ms": s.store_ms,
        "durable_ms": s.durable_ms,
        "bytes_uploaded": s.bytes_uploaded,
        "chunks_total": s.chunks_total,
        "chunks_new": s.chunks_new,
        "chunks_zero": s.chunks_zero,
        "gpu_lock_ms": s.gpu_lock_ms,
        "gpu_checkpoint_ms": s.gpu_checkpoint_ms,
                "gpu_restore_ms": s.gpu_restore_ms,
        "gpu_bytes": s.gpu_bytes,
    })
}

pub fn checkpoint_result(r: &CheckpointResult) -> Value {
    json!({
        "id": r.id,
        "workload": r.workload,
        "pid": r.pid,
        "left_running": r.left_running,
        "durable": r.durable,
        "stats": r.stats.as_ref().map(checkpoint_stats),
    })
}

pub fn restore_stats(s: &RestoreStats) -> Value {
    json!({
        "restore_ms": s.restore_ms,
        "fetch_ms": s.fetch_ms,
        "criu_ms": s.criu_ms,
        "bytes_fetched": s.bytes_fetched,
        "gpu_restore_ms": s.gpu_restore_ms,
        "lazy": s.lazy,
        "first_run_ms": s.first_run_ms,
        "resident_ms": s.resident_ms,
    })
}

pub fn restore_result(r: &RestoreResult) -> Value {
    json!({
        "id": r.id,
        "workload": r.workload,
        "pid": r.pid,
        "warnings": r.warnings,
        "stats": r.stats.as_ref().map(restore_stats),
    })
}

pub fn checkpoint_info(c: &CheckpointInfo) -> Value {
    json!({
        "id": c.id,
        "workload": c.workload,
        "pid": c.pid,
        "created_unix_ms": c.created_unix_ms,
        "bytes_total": c.bytes_total,
        "node": c.node,
        "kernel": c.kernel,
        "criu_version": c.criu_version,
        "command": c.command,
        "pids": c.pids,
        "files": c.files,
        "criu_options": c.criu_options,
        "sockets": c.sockets,
        "stats": c.stats.as_ref().map(checkpoint_stats),
    })
}

pub fn list_response(l: &ListResponse) -> Value {
    let checkpoints: Vec<Value> = l.checkpoints.iter().map(checkpoint_info).collect();
    json!({ "checkpoints": checkpoints })
}

pub fn workload_status(w: &WorkloadStatus) -> Value {
    json!({ "name": w.name, "pid": w.pid, "running": w.running, "command": w.command })
}

pub fn status_response(s: &StatusResponse) -> Value {
    let workloads: Vec<Value> = s.workloads.iter().map(workload_status).collect();
    json!({
        "daemon_version": s.daemon_version,
        "criu_version": s.criu_version,
        "criu_path": s.criu_path,
        "kernel": s.kernel,
        "gpu_support": s.gpu_support,
        "socket_support": s.socket_support,
        "network_lock": s.network_lock,
        "store_url": s.store_url,
        "state_dir": s.state_dir,
        "workloads": workloads,
    })
}

/// Prints `value` as the single JSON object of the command's stdout.
pub fn gc_response(r: &GcResponse) -> Value {
    json!({
        "checkpoints_deleted": r.checkpoints_deleted,
        "packs_deleted": r.packs_deleted,
        "packs_repacked": r.packs_repacked,
        "bytes_freed": r.bytes_freed,
    })
}

pub fn print_json(value: &Value) -> anyhow::Result<()> {
    print(&value.to_string())
}

/// Prints `text` and a newline on stdout, reporting failures (such as a closed pipe) as
/// errors instead of panicking.
pub fn print(text: &str) -> anyhow::Result<()> {
    writeln!(std::io::stdout().lock(), "{text}").context("writing to stdout")
}

/// `bytes` in binary units with one decimal: `512 B`, `1.5 KiB`, `3.2 GiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    // Precision loss above 2^53 bytes is irrelevant for one decimal.
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `bytes` in MiB with one decimal, for the one-line checkpoint summary.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Milliseconds since the Unix epoch as UTC `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm,
/// restricted to dates after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Lays out `rows` under `header` in left-aligned columns separated by two spaces.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    std::iter::once(&header)
        .chain(rows)
        .map(|row| {
            let cells: Vec<String> =
                row.iter().zip(&widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
            cells.join("  ").trim_end().to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests;
