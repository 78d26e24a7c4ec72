//! What this CRIU can do for sockets on this kernel: whether it can dump network sockets at all,
//! and how it can lock established TCP connections while it dumps and restores them.

use std::path::Path;
use std::process::{Command, Stdio};

use super::{CriuOps, CriuVersion};

/// How CRIU keeps established TCP connections quiet (no packet in or out) from the moment it
/// freezes a tree until the tree runs again: without a lock the kernel would answer the peer's
/// packets to a dumped (or killed) socket with a reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkLock {
    /// Rules in an nftables table of CRIU's own, through libnftables: needs no program.
    Nftables,
    /// iptables rules, two per connection, each added and removed by running `iptables`
    /// (`ip6tables`): needs those programs, and is slow (bench/RESULTS.md).
    Iptables,
}

impl NetworkLock {
    pub fn name(self) -> &'static str {
        match self {
            Self::Nftables => "nftables",
            Self::Iptables => "iptables",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "nftables" => Some(Self::Nftables),
            "iptables" => Some(Self::Iptables),
            _ => None,
        }
    }
}

/// The first kernel that refuses SO_PASSCRED/SO_PASSSEC on sockets other than Unix and
/// netlink ones (EOPNOTSUPP), and the first CRIU that copes with it; older CRIU gives up on
/// the first such socket it dumps.
const STRICT_SOCKOPT_KERNEL: (u32, u32) = (6, 16);
const STRICT_SOCKOPT_CRIU: CriuVersion = CriuVersion { major: 4, minor: 2, sublevel: 0 };

/// `Err(why)` when `criu` cannot dump network (TCP, UDP, packet) sockets on a kernel of
/// release `kernel`.
pub fn network_sockets(criu: CriuVersion, kernel: &str) -> Result<(), String> {
    let Some(release) = kernel_version(kernel) else { return Ok(()) };
    if release >= STRICT_SOCKOPT_KERNEL && criu < STRICT_SOCKOPT_CRIU {
        return Err(format!(
            "CRIU {criu} cannot dump network (TCP, UDP, packet) sockets on kernel {kernel}: \
             kernels from 6.16 on need CRIU 4.2 or newer (run scripts/setup-criu.sh, or pass \
             --criu PATH)"
        ));
    }
    Ok(())
}

/// `(major, minor)` of a kernel release string like "6.18.44-fc-v782".
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Whether CRIU can dump, on `kernel`, a process that registered restartable sequences
/// (glibc 2.35 and later register one for every thread): it reads the registration with
/// PTRACE_GET_RSEQ_CONFIGURATION, which Linux has from 5.13 on. `Err(why)` where it cannot
/// (CRIU then fails the dump: "has rseq but kernel lacks get_rseq_conf feature").
pub fn rseq_dumpable(kernel: &str) -> Result<(), String> {
    match kernel_version(kernel) {
        Some(version) if version < (5, 13) => Err(format!(
            "kernel {kernel} lacks PTRACE_GET_RSEQ_CONFIGURATION (Linux 5.13), without which CRIU cannot dump \
             a process that registered rseq (glibc 2.35 and later do)"
        )),
        _ => Ok(()),
    }
}

/// The lock to use: `forced` if given and available; else nftables when this CRIU was built
/// with it and the kernel has it (no program needed), else iptables when its programs are
/// installed. `Err(why)` when none of those is available.
pub fn choose_network_lock(criu: &dyn CriuOps, forced: Option<NetworkLock>) -> Result<NetworkLock, String> {
    const NO_NFTABLES: &str = "CRIU's nftables lock is unavailable (`criu check --feature nftables` fails)";
    const NO_IPTABLES: &str = "iptables is not installed (no iptables on PATH)";
    let nftables = || criu.supports_nftables().then_some(NetworkLock::Nftables).ok_or(NO_NFTABLES);
    let iptables = || {
        stasis_linux::find_program("iptables").is_some().then_some(NetworkLock::Iptables).ok_or(NO_IPTABLES)
    };
    let chosen = match forced {
        Some(NetworkLock::Nftables) => nftables(),
        Some(NetworkLock::Iptables) => iptables(),
        None => nftables()
            .or_else(|_| iptables())
            .map_err(|_| "neither CRIU's nftables lock nor iptables is available"),
    };
    chosen.map_err(String::from)
}

/// `criu check --feature nftables`: the feature checks have no RPC form.
pub(super) fn nftables_supported(criu: &Path) -> bool {
    Command::new(criu)
        .args(["check", "--feature", "nftables"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn v(major: i32, minor: i32) -> CriuVersion {
        CriuVersion { major, minor, sublevel: 0 }
    }

    #[test]
    fn old_criu_on_a_strict_kernel_cannot_dump_network_sockets() {
        let err = network_sockets(v(4, 1), "6.18.44-fc-v782").unwrap_err();
        assert!(err.contains("CRIU 4.1.0") && err.contains("6.18.44") && err.contains("4.2"), "{err}");
        assert!(network_sockets(v(4, 1), "6.16.0").is_err());
        assert!(network_sockets(v(4, 2), "6.18.44").is_ok());
        assert!(network_sockets(v(4, 1), "6.15.9-arch1").is_ok());
        assert!(network_sockets(v(4, 0), "5.10.0-32-amd64").is_ok());
        assert!(network_sockets(v(3, 17), "weird").is_ok());
    }

    #[test]
    fn rseq_is_dumpable_from_linux_5_13() {
        assert!(rseq_dumpable("5.10.0-32-amd64").unwrap_err().contains("PTRACE_GET_RSEQ_CONFIGURATION"));
        assert!(rseq_dumpable("5.12.19").is_err());
        assert_eq!(rseq_dumpable("5.13.0"), Ok(()));
        assert_eq!(rseq_dumpable("6.1.0-50-amd64"), Ok(()));
        assert_eq!(rseq_dumpable("6.18.44-fc-v657"), Ok(()));
    }

    #[test]
    fn lock_names_round_trip() {
        for lock in [NetworkLock::Nftables, NetworkLock::Iptables] {
            assert_eq!(NetworkLock::from_name(lock.name()), Some(lock));
        }
        assert_eq!(NetworkLock::from_name("pf"), None);
    }
}
