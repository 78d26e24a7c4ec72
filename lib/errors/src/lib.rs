//! An error and all its sources as one line: what stasis logs and what it answers callers.

/// An error and all its sources, joined with ": ".
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
