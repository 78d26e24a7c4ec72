//! Output: API messages as JSON (their serde derives, see proto/build.rs), and helpers for
//! human-readable text.

use std::io::Write as _;

use anyhow::Context as _;
use comfy_table::{Table, presets::NOTHING};
use jiff::Timestamp;

/// Prints `message` as the single JSON object of the command's stdout.
pub fn print_json(message: &impl serde::Serialize) -> anyhow::Result<()> {
    print(&serde_json::to_string(message).context("encoding the result as JSON")?)
}

/// Prints `text` and a newline on stdout, reporting failures (such as a closed pipe) as
/// errors instead of panicking.
pub fn print(text: &str) -> anyhow::Result<()> {
    writeln!(std::io::stdout().lock(), "{text}").context("writing to stdout")
}

/// Milliseconds since the Unix epoch as UTC `YYYY-MM-DDTHH:MM:SSZ`; times past jiff's range
/// (the end of the year 9999) show as its end.
pub fn utc(unix_ms: u64) -> String {
    let time =
        Timestamp::from_millisecond(i64::try_from(unix_ms).unwrap_or(i64::MAX)).unwrap_or(Timestamp::MAX);
    time.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Lays out `rows` under `header` in left-aligned columns separated by two spaces, without
/// borders or colours.
pub fn table<const N: usize>(header: [&str; N], rows: impl IntoIterator<Item = [String; N]>) -> String {
    let mut table = Table::new();
    table.load_style(NOTHING).set_header(header).add_rows(rows);
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    table.trim_fmt()
}

#[cfg(test)]
mod tests;
