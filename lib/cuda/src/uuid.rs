//! GPU UUIDs in the text form `nvidia-smi -L` prints: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.

use std::fmt::Write as _;

use super::CudaError;

/// The 16 raw bytes of a GPU UUID (`CUuuid`).
pub type GpuUuid = [u8; 16];

/// `GPU-` followed by the 8-4-4-4-12 lowercase hex groups, as nvidia-smi prints it.
pub fn format_uuid(u: &GpuUuid) -> String {
    let mut s = String::with_capacity(40);
    s.push_str("GPU-");
    for (i, b) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        // Writing to a String cannot fail.
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Parses a GPU UUID with or without the `GPU-` prefix, in the 8-4-4-4-12 form or as 32 bare
/// hex digits; hex digits in either case.
pub fn parse_uuid(s: &str) -> Result<GpuUuid, CudaError> {
    let invalid = |reason| CudaError::InvalidUuid { input: s.to_string(), reason };
    let body = s.strip_prefix("GPU-").or_else(|| s.strip_prefix("gpu-")).unwrap_or(s);
    let hex: Vec<u8> = match body.len() {
        36 => {
            let bytes = body.as_bytes();
            if [8, 13, 18, 23].iter().any(|&i| bytes[i] != b'-') {
                return Err(invalid("expected hyphens after 8, 12, 16 and 20 hex digits"));
            }
            bytes.iter().copied().filter(|&c| c != b'-').collect()
        }
        32 => body.as_bytes().to_vec(),
        _ => return Err(invalid("expected 32 hex digits, optionally as 8-4-4-4-12 after \"GPU-\"")),
    };
    if hex.len() != 32 {
        return Err(invalid("expected 32 hex digits, optionally as 8-4-4-4-12 after \"GPU-\""));
    }
    let mut out = [0u8; 16];
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        let hi = hex_digit(pair[0]).ok_or_else(|| invalid("not a hex digit"))?;
        let lo = hex_digit(pair[1]).ok_or_else(|| invalid("not a hex digit"))?;
        *o = (hi << 4) | lo;
    }
    Ok(out)
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: GpuUuid =
        [0x5b, 0x1e, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71, 0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7, 0xe8, 0xf9];

    #[test]
    fn formats_like_nvidia_smi() {
        assert_eq!(format_uuid(&SAMPLE), "GPU-5b1e2c3d-4e5f-6071-8293-a4b5c6d7e8f9");
        assert_eq!(format_uuid(&[0; 16]), "GPU-00000000-0000-0000-0000-000000000000");
    }

    #[test]
    fn round_trip() {
        for u in [SAMPLE, [0xff; 16], [0; 16]] {
            assert_eq!(parse_uuid(&format_uuid(&u)).unwrap(), u);
        }
    }

    #[test]
    fn accepts_without_prefix_and_in_upper_case() {
        assert_eq!(parse_uuid("5b1e2c3d-4e5f-6071-8293-a4b5c6d7e8f9").unwrap(), SAMPLE);
        assert_eq!(parse_uuid("GPU-5B1E2C3D-4E5F-6071-8293-A4B5C6D7E8F9").unwrap(), SAMPLE);
        assert_eq!(parse_uuid("5b1e2c3d4e5f60718293a4b5c6d7e8f9").unwrap(), SAMPLE);
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "GPU-",
            "GPU-5b1e2c3d-4e5f-6071-8293-a4b5c6d7e8f",
            "GPU-5b1e2c3d-4e5f-6071-8293-a4b5c6d7e8f9a",
            "GPU-5b1e2c3d4-e5f-6071-8293-a4b5c6d7e8f9",
            "GPU-5b1e2c3d-4e5f-6071-8293-a4b5c6d7e8fg",
            "MIG-5b1e2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
            "GPU-5b1e2c3d-4e5f-6071-8293-a4b5c6d7e8é",
        ] {
            let err = parse_uuid(bad).expect_err(bad);
            assert!(err.to_string().starts_with("invalid GPU UUID"), "{err}");
        }
    }
}
