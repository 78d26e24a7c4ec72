//! Removing the rules CRIU's iptables network lock leaves for a connection of a tree it dumped
//! and left stopped: one DROP rule in INPUT (packets from the peer) and one in OUTPUT (packets
//! to it), matching the connection's addresses and ports and every packet not carrying CRIU's
//! own mark (0xC114, what its repair socket uses). IPv4-mapped IPv6 connections are locked
//! with `iptables` under their IPv4 addresses, like IPv4 ones.

use std::net::SocketAddr;
use std::process::Command;

/// The mark CRIU's own packets carry; the lock lets those through.
const CRIU_MARK: &str = "0xC114";

/// The two commands deleting the lock rules of the connection `local` <-> `remote`.
pub fn unlock_commands(local: SocketAddr, remote: SocketAddr) -> [Command; 2] {
    let (local, remote) = (canonical(local), canonical(remote));
    let program = if local.is_ipv4() { "iptables" } else { "ip6tables" };
    [("INPUT", remote, local), ("OUTPUT", local, remote)].map(|(chain, from, to)| {
        let mut cmd = Command::new(program);
        cmd.args(rule_args(chain, from, to));
        cmd
    })
}

fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn rule_args(chain: &str, from: SocketAddr, to: SocketAddr) -> Vec<String> {
    let mut args: Vec<String> =
        ["-w", "-t", "filter", "-D", chain, "--protocol", "tcp", "-m", "mark", "!", "--mark", CRIU_MARK]
            .map(String::from)
            .to_vec();
    args.extend(["--source".into(), from.ip().to_string(), "--sport".into(), from.port().to_string()]);
    args.extend(["--destination".into(), to.ip().to_string(), "--dport".into(), to.port().to_string()]);
    args.extend(["-j".into(), "DROP".into()]);
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_match_criu_s_lock() {
        let [input, output] =
            unlock_commands("[::ffff:10.0.0.1]:40000".parse().unwrap(), "10.0.0.2:80".parse().unwrap());
        assert_eq!(input.get_program(), "iptables");
        let args: Vec<String> = input.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(
            args.join(" "),
            "-w -t filter -D INPUT --protocol tcp -m mark ! --mark 0xC114 --source 10.0.0.2 --sport 80 \
             --destination 10.0.0.1 --dport 40000 -j DROP"
        );
        let args: Vec<String> = output.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert!(
            args.join(" ").contains("-D OUTPUT --protocol tcp -m mark ! --mark 0xC114 --source 10.0.0.1")
        );
        let [v6, _] = unlock_commands("[2001:db8::1]:1".parse().unwrap(), "[2001:db8::2]:2".parse().unwrap());
        assert_eq!(v6.get_program(), "ip6tables");
    }
}
