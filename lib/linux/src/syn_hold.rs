//! Holding back new TCP connections to some ports for a while: their SYNs are dropped, so
//! the peers send them again a second later (and again, backing off) instead of being
//! refused.
//!
//! While a reclaimed workload wakes, nothing listens on its ports between the moment the
//! waker closes its own listeners and the moment the restored tree's listeners exist; a
//! connection attempt in that gap would be reset. With a hold in place it waits instead.
//!
//! A hold is an nf_tables table of family inet with one input chain: for each port, a rule
//! `tcp dport PORT tcp flags & (fin|syn|rst|ack) == syn drop`. Only a connection's first
//! segment is dropped; segments of connections already open pass. The table is created with
//! the owner flag, so the kernel removes it with the netlink socket that made it: a hold never
//! outlives stasisd, whatever way stasisd ends.

use std::io;

use super::nft::{
    self, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE, NFT_MSG_NEWTABLE, NLM_F_APPEND, NLM_F_CREATE, NftSocket, attr,
    attr_be32, attr_str, nested,
};

const NFTA_TABLE_FLAGS: u16 = 2;
/// `NFT_TABLE_F_OWNER` (Linux 5.12): the table goes with the socket that made it.
const TABLE_OWNER: u32 = 0x2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NF_INET_LOCAL_IN: u32 = 1;
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
/// The register expressions load into and compare from (`NFT_REG_1`); 0 is the verdict.
const REG: u32 = 1;
const REG_VERDICT: u32 = 0;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_L4PROTO: u32 = 16;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const IPPROTO_TCP: u8 = 6;
/// TCP header: the destination port's offset, and the flags byte's.
const TCP_DPORT_AT: u32 = 2;
const TCP_FLAGS_AT: u32 = 13;
const TCP_FIN_SYN_RST_ACK: u8 = 0x17;
const TCP_SYN: u8 = 0x02;
const CHAIN: &str = "input";

/// New connections to some ports, held back until this is dropped.
pub struct SynHold {
    /// The socket whose closing removes the table.
    _socket: NftSocket,
}

impl SynHold {
    /// Holds back new connections to `ports` (of any local address) in table `table`.
    pub fn hold(table: &str, ports: &[u16]) -> io::Result<SynHold> {
        let mut socket = NftSocket::open()?;
        let mut requests = vec![
            (NFT_MSG_NEWTABLE, NLM_F_CREATE, table_body(table)),
            (NFT_MSG_NEWCHAIN, NLM_F_CREATE, chain_body(table)),
        ];
        requests.extend(
            ports.iter().map(|&port| (NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, rule_body(table, port))),
        );
        socket.batch(&requests)?;
        Ok(SynHold { _socket: socket })
    }
}

/// Table `name`, owned by the socket that creates it.
fn table_body(name: &str) -> Vec<u8> {
    let mut body = nft::table_body(name);
    attr_be32(&mut body, NFTA_TABLE_FLAGS, TABLE_OWNER);
    body
}

/// A filter chain on the input hook that accepts what no rule drops.
fn chain_body(table: &str) -> Vec<u8> {
    let mut body = Vec::new();
    attr_str(&mut body, NFTA_CHAIN_TABLE, table);
    attr_str(&mut body, NFTA_CHAIN_NAME, CHAIN);
    nested(&mut body, NFTA_CHAIN_HOOK, |hook| {
        attr_be32(hook, NFTA_HOOK_HOOKNUM, NF_INET_LOCAL_IN);
        attr_be32(hook, NFTA_HOOK_PRIORITY, 0);
    });
    attr_be32(&mut body, NFTA_CHAIN_POLICY, NF_ACCEPT);
    attr_str(&mut body, NFTA_CHAIN_TYPE, "filter");
    body
}

/// `meta l4proto tcp tcp dport PORT tcp flags & (fin|syn|rst|ack) == syn drop`.
fn rule_body(table: &str, port: u16) -> Vec<u8> {
    let mut body = Vec::new();
    attr_str(&mut body, NFTA_RULE_TABLE, table);
    attr_str(&mut body, NFTA_RULE_CHAIN, CHAIN);
    nested(&mut body, NFTA_RULE_EXPRESSIONS, |list| {
        expression(list, "meta", |e| {
            attr_be32(e, NFTA_META_DREG, REG);
            attr_be32(e, NFTA_META_KEY, NFT_META_L4PROTO);
        });
        equals(list, &[IPPROTO_TCP]);
        transport_bytes(list, TCP_DPORT_AT, 2);
        equals(list, &port.to_be_bytes());
        transport_bytes(list, TCP_FLAGS_AT, 1);
        expression(list, "bitwise", |e| {
            attr_be32(e, NFTA_BITWISE_SREG, REG);
            attr_be32(e, NFTA_BITWISE_DREG, REG);
            attr_be32(e, NFTA_BITWISE_LEN, 1);
            nested(e, NFTA_BITWISE_MASK, |d| attr(d, NFTA_DATA_VALUE, &[TCP_FIN_SYN_RST_ACK]));
            nested(e, NFTA_BITWISE_XOR, |d| attr(d, NFTA_DATA_VALUE, &[0]));
        });
        equals(list, &[TCP_SYN]);
        expression(list, "immediate", |e| {
            attr_be32(e, NFTA_IMMEDIATE_DREG, REG_VERDICT);
            nested(e, NFTA_IMMEDIATE_DATA, |d| {
                nested(d, NFTA_DATA_VERDICT, |v| attr_be32(v, NFTA_VERDICT_CODE, NF_DROP));
            });
        });
    });
    body
}

/// One expression of a rule: its name and its attributes.
fn expression(list: &mut Vec<u8>, name: &str, data: impl FnOnce(&mut Vec<u8>)) {
    nested(list, NFTA_LIST_ELEM, |elem| {
        attr_str(elem, NFTA_EXPR_NAME, name);
        nested(elem, NFTA_EXPR_DATA, data);
    });
}

/// Loads `len` bytes at `offset` of the transport header into the register.
fn transport_bytes(list: &mut Vec<u8>, offset: u32, len: u32) {
    expression(list, "payload", |e| {
        attr_be32(e, NFTA_PAYLOAD_DREG, REG);
        attr_be32(e, NFTA_PAYLOAD_BASE, NFT_PAYLOAD_TRANSPORT_HEADER);
        attr_be32(e, NFTA_PAYLOAD_OFFSET, offset);
        attr_be32(e, NFTA_PAYLOAD_LEN, len);
    });
}

/// Ends the rule unless the register holds `value`.
fn equals(list: &mut Vec<u8>, value: &[u8]) {
    expression(list, "cmp", |e| {
        attr_be32(e, NFTA_CMP_SREG, REG);
        attr_be32(e, NFTA_CMP_OP, NFT_CMP_EQ);
        nested(e, NFTA_CMP_DATA, |d| attr(d, NFTA_DATA_VALUE, value));
    });
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    use super::*;

    /// Whether a connection to `port` on loopback is refused (rather than answered or left
    /// waiting) within `wait`.
    fn connect(port: u16, wait: Duration) -> io::Result<TcpStream> {
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), wait)
    }

    #[test]
    fn a_held_port_makes_connections_wait_instead_of_being_refused() {
        if !nix::unistd::geteuid().is_root() {
            assert!(SynHold::hold("stasis-test-hold", &[1]).is_err(), "only root may change nftables");
            return;
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        assert_eq!(connect(port, Duration::from_secs(1)).unwrap_err().kind(), ErrorKind::ConnectionRefused);

        let table = format!("stasis-test-hold-{}", std::process::id());
        let hold = SynHold::hold(&table, &[port]).unwrap();
        let waited = connect(port, Duration::from_millis(300)).unwrap_err();
        assert_eq!(waited.kind(), ErrorKind::TimedOut, "the SYN is dropped, not refused: {waited}");
        // A connection attempt under way when a listener appears and the hold goes succeeds
        // on its next SYN.
        let attempt = std::thread::spawn(move || connect(port, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(200));
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        drop(hold);
        attempt.join().unwrap().expect("the held connection is made once the hold goes");
        drop(listener);
        assert!(!nft::delete_inet_table(&table).unwrap(), "the table went with its socket");
    }
}
