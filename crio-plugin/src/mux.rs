//! NRI's multiplexing of its one Unix socket into two logical connections: every chunk of
//! either is sent as its connection's id and the chunk's length (both big-endian u32) before
//! the chunk. On connection 1 the runtime calls the plugin (the plugin serves ttRPC); on
//! connection 2 the plugin calls the runtime.

/// The runtime calls the plugin here.
pub const PLUGIN_CONN: u32 = 1;
/// The plugin calls the runtime here.
pub const RUNTIME_CONN: u32 = 2;

const HEADER: usize = 8;

/// `data` as a chunk of connection `conn`.
pub fn encode(conn: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + data.len());
    out.extend_from_slice(&conn.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Takes one whole chunk off the front of `buf`: its connection and bytes.
pub fn take(buf: &mut Vec<u8>) -> Option<(u32, Vec<u8>)> {
    if buf.len() < HEADER {
        return None;
    }
    let conn = u32::from_be_bytes(buf[0..4].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(buf[4..8].try_into().expect("4 bytes")) as usize;
    if buf.len() < HEADER + len {
        return None;
    }
    let data = buf[HEADER..HEADER + len].to_vec();
    buf.drain(..HEADER + len);
    Some((conn, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_of_both_connections_are_told_apart() {
        let mut buf = [encode(RUNTIME_CONN, b"to the runtime"), encode(PLUGIN_CONN, b"")].concat();
        buf.extend_from_slice(&encode(PLUGIN_CONN, b"to the plugin")[..5]);
        assert_eq!(take(&mut buf), Some((RUNTIME_CONN, b"to the runtime".to_vec())));
        assert_eq!(take(&mut buf), Some((PLUGIN_CONN, Vec::new())));
        assert_eq!(take(&mut buf), None, "a partial chunk waits for the rest");
        assert_eq!(buf.len(), 5);
    }
}
