//! Progress of long operations, drawn as one updating line on stderr when it is a terminal.

use std::io::{IsTerminal as _, Write as _};

use stasis_proto::stasis::v1::Progress;

use crate::output;

/// The progress line. It is cleared when dropped, so that nothing is left behind when an
/// operation finishes or fails.
pub struct ProgressLine {
    enabled: bool,
    drawn: bool,
}

impl ProgressLine {
    /// A progress line that draws only if `wanted` and stderr is a terminal.
    pub fn new(wanted: bool) -> Self {
        Self { enabled: wanted && std::io::stderr().is_terminal(), drawn: false }
    }

    /// Redraws the line for `progress`.
    pub fn update(&mut self, progress: &Progress) {
        if self.enabled {
            // "\x1b[K" erases what a longer previous line left to the right.
            draw(&format!("\r{}\x1b[K", describe(progress)));
            self.drawn = true;
        }
    }
}

impl Drop for ProgressLine {
    fn drop(&mut self) {
        if self.drawn {
            draw("\r\x1b[K");
        }
    }
}

/// Progress is best effort: a failed write to stderr is not worth failing the operation.
fn draw(text: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(text.as_bytes());
    let _ = stderr.flush();
}

/// `phase 42% (1.2 MiB / 2.9 MiB)`, or `phase 1.2 MiB` when the total is unknown.
fn describe(p: &Progress) -> String {
    match (p.done_bytes, p.total_bytes) {
        (0, 0) => p.phase.clone(),
        (done, 0) => format!("{} {}", p.phase, output::size(done)),
        (done, total) => format!(
            "{} {}% ({} / {})",
            p.phase,
            u128::from(done.min(total)) * 100 / u128::from(total),
            output::size(done),
            output::size(total)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(done_bytes: u64, total_bytes: u64) -> Progress {
        Progress { phase: "dumping".into(), done_bytes, total_bytes }
    }

    #[test]
    fn describes_percent_and_bytes() {
        assert_eq!(describe(&progress(1 << 20, 4 << 20)), "dumping 25% (1.0 MiB / 4.0 MiB)");
        assert_eq!(describe(&progress(2048, 0)), "dumping 2.0 KiB");
        assert_eq!(describe(&progress(0, 0)), "dumping");
        // Overshooting the total does not show more than 100%.
        assert!(describe(&progress(5, 4)).starts_with("dumping 100% "));
    }

    #[test]
    fn disabled_line_draws_nothing() {
        let mut line = ProgressLine::new(false);
        line.update(&progress(1, 2));
        assert!(!line.drawn);
    }
}
