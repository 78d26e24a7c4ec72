//! Progress of long operations, drawn by indicatif on stderr when it is a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};
use stasis_proto::stasis::v1::Progress;

/// What a progress event tells besides its phase, which decides how it is drawn.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shape {
    /// Only the phase: `restore`.
    Phase,
    /// Bytes done of an unknown total: `upload 1.20 MiB`.
    Bytes,
    /// Bytes done of a known total: `dump [=====>    ] 42% (1.20 MiB / 2.86 MiB)`.
    Fraction,
}

impl Shape {
    fn of(progress: &Progress) -> Self {
        match (progress.done_bytes, progress.total_bytes) {
            (0, 0) => Self::Phase,
            (_, 0) => Self::Bytes,
            _ => Self::Fraction,
        }
    }

    fn style(self) -> ProgressStyle {
        let template = match self {
            Self::Phase => "{msg}",
            Self::Bytes => "{msg} {binary_bytes}",
            Self::Fraction => "{msg} [{bar:30}] {percent}% ({binary_bytes} / {binary_total_bytes})",
        };
        // The templates are constants, each drawn in the tests.
        ProgressStyle::with_template(template).expect("valid progress template").progress_chars("=> ")
    }
}

/// The progress line. It is cleared when dropped, so that nothing is left behind when an
/// operation finishes or fails.
pub struct ProgressLine {
    bar: ProgressBar,
    shape: Option<Shape>,
}

impl ProgressLine {
    /// A progress line on stderr if `wanted`; indicatif hides it when stderr is not a
    /// terminal (or `TERM` is unset or `dumb`).
    pub fn new(wanted: bool) -> Self {
        Self::with_target(if wanted { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() })
    }

    fn with_target(target: ProgressDrawTarget) -> Self {
        let bar = ProgressBar::with_draw_target(None, target).with_finish(ProgressFinish::AndClear);
        Self { bar, shape: None }
    }

    /// Redraws the line for `progress`.
    pub fn update(&mut self, progress: &Progress) {
        let shape = Shape::of(progress);
        if self.shape != Some(shape) {
            self.bar.set_style(shape.style());
            self.shape = Some(shape);
        }
        self.bar.set_length(progress.total_bytes);
        // Overshooting the total does not show more than 100%.
        let done = match shape {
            Shape::Fraction => progress.done_bytes.min(progress.total_bytes),
            Shape::Phase | Shape::Bytes => progress.done_bytes,
        };
        self.bar.set_position(done);
        self.bar.set_message(progress.phase.clone());
    }
}

#[cfg(test)]
mod tests {
    use indicatif::InMemoryTerm;

    use super::*;

    fn progress(phase: &str, done_bytes: u64, total_bytes: u64) -> Progress {
        Progress { phase: phase.into(), done_bytes, total_bytes }
    }

    /// The screen after each of `events`, drawn on an in-memory terminal.
    fn screens(events: &[Progress]) -> (Vec<String>, InMemoryTerm) {
        let term = InMemoryTerm::new(4, 80);
        let mut line = ProgressLine::with_target(ProgressDrawTarget::term_like(Box::new(term.clone())));
        let screens = events
            .iter()
            .map(|event| {
                line.update(event);
                term.contents()
            })
            .collect();
        (screens, term)
    }

    #[test]
    fn draws_each_shape_and_clears_when_dropped() {
        let (screens, term) = screens(&[
            progress("dump", 1 << 20, 4 << 20),
            progress("upload", 2048, 0),
            progress("restore", 0, 0),
            progress("download", 5, 4),
        ]);
        assert_eq!(screens[0], "dump [=======>                      ] 25% (1.00 MiB / 4.00 MiB)");
        assert_eq!(screens[1], "upload 2.00 KiB");
        assert_eq!(screens[2], "restore");
        assert_eq!(screens[3], "download [==============================] 100% (4 B / 4 B)");
        assert_eq!(term.contents(), "");
    }

    #[test]
    fn hidden_line_draws_nothing() {
        let mut line = ProgressLine::new(false);
        line.update(&progress("dump", 1, 2));
        assert!(line.bar.is_hidden());
    }
}
