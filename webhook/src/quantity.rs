//! Kubernetes resource quantities ("512Mi", "2G", "1.5Gi", "1e9") as bytes.

/// The bytes `q` stands for; `None` for what is not a quantity.
pub fn bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    const SUFFIXES: [(&str, f64); 12] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("Ei", 1152921504606846976.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    let (number, scale) = SUFFIXES
        .iter()
        .find_map(|(suffix, scale)| q.strip_suffix(suffix).map(|n| (n, *scale)))
        .unwrap_or((q, 1.0));
    // A bare "m" is milli: a fraction of a byte, which no memory limit is.
    let value: f64 = number.parse().ok().filter(|v: &f64| v.is_finite() && *v >= 0.0)?;
    Some((value * scale).ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::bytes;

    #[test]
    fn binary_decimal_and_exponent_forms() {
        assert_eq!(bytes("512Mi"), Some(512 << 20));
        assert_eq!(bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(bytes("2G"), Some(2_000_000_000));
        assert_eq!(bytes("128974848"), Some(128_974_848));
        assert_eq!(bytes("1e9"), Some(1_000_000_000));
        assert_eq!(bytes("16k"), Some(16_000));
    }

    #[test]
    fn what_is_not_a_quantity_is_none() {
        assert_eq!(bytes("lots"), None);
        assert_eq!(bytes("-1Gi"), None);
        assert_eq!(bytes(""), None);
    }
}
