//! Durations as people write them, read the same way wherever stasis takes one (the CLI's
//! flags, the pod annotations): one or more numbers, each with a unit among `ms`, `s`, `m`,
//! `h` and `d`, run together (`1h30m`, `1.5h`, `250ms`, `2m30.5s`). Go's and Kubernetes'
//! durations read the same here (Kubernetes has no `d`).

#![forbid(unsafe_code)]

use std::time::Duration;

/// Why a text is not a duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("expected a duration like 30s, 5m, 1h30m or 1.5h, got `{0}`")]
    Malformed(String),
    #[error("unknown unit `{unit}` in `{text}` (use ms, s, m, h or d)")]
    UnknownUnit { unit: String, text: String },
    #[error("`{0}` needs a unit (ms, s, m, h or d)")]
    NoUnit(String),
    #[error("`{0}` is too long a duration")]
    TooLong(String),
}

/// Reads `text`: numbers with units, run together.
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let malformed = || DurationError::Malformed(text.to_owned());
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(malformed());
    }
    let mut seconds = 0f64;
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_len);
        let value: f64 = number.parse().map_err(|_| malformed())?;
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let scale = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            "" => return Err(DurationError::NoUnit(text.to_owned())),
            _ => return Err(DurationError::UnknownUnit { unit: unit.to_owned(), text: text.to_owned() }),
        };
        seconds += value * scale;
        rest = next;
    }
    Duration::try_from_secs_f64(seconds).map_err(|_| DurationError::TooLong(text.to_owned()))
}

/// [`parse`], where a bare number is a count of seconds (`90`).
pub fn parse_or_seconds(text: &str) -> Result<Duration, DurationError> {
    match text.trim().parse::<f64>() {
        Ok(seconds) => {
            Duration::try_from_secs_f64(seconds).map_err(|_| DurationError::Malformed(text.to_owned()))
        }
        Err(_) => parse(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_run_together_and_fractions_are_read() {
        assert_eq!(parse("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2m30.5s"), Ok(Duration::from_millis(150_500)));
        assert_eq!(parse("1d"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse("1500ms"), Ok(Duration::from_millis(1500)));
    }

    #[test]
    fn anything_else_says_what_is_wrong() {
        assert_eq!(parse("10"), Err(DurationError::NoUnit("10".into())));
        assert_eq!(
            parse("5 days"),
            Err(DurationError::UnknownUnit { unit: " days".into(), text: "5 days".into() })
        );
        assert_eq!(parse("m"), Err(DurationError::Malformed("m".into())));
        assert_eq!(parse("1..5s"), Err(DurationError::Malformed("1..5s".into())));
        assert_eq!(parse(""), Err(DurationError::Malformed("".into())));
        assert_eq!(parse("often"), Err(DurationError::Malformed("often".into())));
        assert!(matches!(parse("99999999999999999999999h"), Err(DurationError::TooLong(_))));
        assert_eq!(parse_or_seconds("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_or_seconds("-1"), Err(DurationError::Malformed("-1".into())));
        assert_eq!(parse_or_seconds("1h30m"), Ok(Duration::from_secs(5400)));
    }
}
